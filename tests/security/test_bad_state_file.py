"""A fake GPU state file with hostile content is refused with a clear message while the last good
state stays in force: the sampler never dies, values out of range never reach the kubelet, and
check-config says what is wrong instead of printing a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deviceplugin.errors import StateFileError
from deviceplugin.gpu.fake import FakeBackend, FakeState, read_state_file
from deviceplugin.gpu.fake import write_state_file as write_state
from tests.blackbox.daemon_harness import TWO_GPUS

CLI = [sys.executable, "-m", "deviceplugin"]
GOOD = FakeState(gpus=TWO_GPUS)


def good_gpu(**changes: object) -> dict[str, object]:
    gpu = GOOD.to_json()["gpus"][0]
    assert isinstance(gpu, dict)
    return {**gpu, **changes}


HOSTILE: dict[str, bytes] = {
    "nested-100k": b'{"gpus": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "integer-5000-digits": b'{"gpus": [{"index": 1' + b"0" * 5000 + b"}]}",
    "numa-node-2**63": json.dumps({"gpus": [good_gpu(numa_node=2**63)]}).encode(),
    "index-2**63": json.dumps({"gpus": [good_gpu(index=2**63)]}).encode(),
    "memory-2**70": json.dumps({"gpus": [good_gpu(memory_total_bytes=2**70)]}).encode(),
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_content_is_refused_with_a_message(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "gpus.json"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as caught:
        read_state_file(path)
    message = str(caught.value)
    assert str(path) in message
    assert len(message) < 1000


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_last_good_state_stays_in_force_and_the_sampler_lives(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "gpus.json"
    write_state(path, GOOD)
    with FakeBackend(path, sample_interval_s=0.005) as backend:
        before = backend.poll()
        path.write_bytes(content)
        time.sleep(0.3)  # many sampler rounds over the bad file
        during = backend.poll()  # raised BackendError for good once the sampler had died
        assert [g.info for g in during.gpus] == [g.info for g in before.gpus]
        changed = FakeState(gpus=TWO_GPUS[:1])
        write_state(path, changed)
        deadline = time.monotonic() + 5
        while len(backend.poll().gpus) != 1:
            assert time.monotonic() < deadline, "a good file after a bad one was not taken"
            time.sleep(0.01)


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_check_config_names_the_problem_without_a_traceback(tmp_path: Path, content: bytes) -> None:
    state = tmp_path / "gpus.json"
    state.write_bytes(content)
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    result = subprocess.run(
        [*CLI, "check-config", str(config), "--backend", f"fake:{state}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3  # the config is valid; its backend cannot start
    assert "Traceback" not in result.stderr
    assert str(state) in result.stderr
