"""A fake GPU state file can be rewritten by whoever may write it at every poll: the work one
poll does for it is bounded, whatever it holds. Too big a file is refused, quickly, naming the
limit it passes, and the last good state stays in force."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import (
    MAX_GPUS,
    MAX_MIG_DEVICES,
    MAX_PROCESSES,
    MAX_STATE_BYTES,
    FakeBackend,
    FakeState,
    write_state_file,
)
from tests.blackbox.daemon_harness import TWO_GPUS

# A poll's CPU time for the state file, on the slowest machine the tests run on, with room.
POLL_CPU_BUDGET_S = 0.25


def gpu(i: int, processes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}",
        "index": i,
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_bytes": 80 << 30,
        "minor": i,
        "processes": processes or [],
    }


def processes(n: int, first_pid: int = 1) -> list[dict[str, Any]]:
    return [
        {"pid": pid, "used_memory_bytes": 1 << 20, "sm_demand_percent": 0}
        for pid in range(first_pid, first_pid + n)
    ]


@pytest.fixture
def backend(tmp_path: Path) -> Any:
    path = tmp_path / "gpus.json"
    write_state_file(path, FakeState(gpus=TWO_GPUS))
    b = FakeBackend(path)
    try:
        yield b, path
    finally:
        b.close()


def poll_cpu_s(backend: FakeBackend, path: Path, content: bytes) -> float:
    """The calling thread's CPU time for the first poll after `path` is rewritten."""
    path.write_bytes(content)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))  # a new signature for sure
    start = time.thread_time()
    reading = backend.poll()
    spent = time.thread_time() - start
    assert [g.info.uuid for g in reading.gpus] == [g.uuid for g in TWO_GPUS]  # the last good
    return spent


def test_a_file_near_sixteen_mib_costs_a_poll_no_more_than_a_small_one(
    backend: tuple[FakeBackend, Path], caplog: pytest.LogCaptureFixture
) -> None:
    b, path = backend
    big = json.dumps({"gpus": [gpu(0, processes(250_000))]}).encode()
    assert len(big) > 15 << 20
    spent = poll_cpu_s(b, path, big)
    assert spent < POLL_CPU_BUDGET_S, f"a poll took {spent:.2f} s of CPU"
    assert f"larger than {MAX_STATE_BYTES} bytes" in caplog.text
    # Rewritten again and again (a poll each): each poll costs as little.
    for n in range(3):
        spent = poll_cpu_s(b, path, big + b" " * n)
        assert spent < POLL_CPU_BUDGET_S, f"a poll took {spent:.2f} s of CPU"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"gpus": [gpu(0, processes(MAX_PROCESSES + 1))]}, f"more than {MAX_PROCESSES} processes"),
        ({"gpus": [gpu(i) for i in range(MAX_GPUS + 1)]}, f"at most {MAX_GPUS}"),
        (
            {
                "gpus": [
                    {**gpu(0), "mig": {"enabled": True, "devices": [{}] * (MAX_MIG_DEVICES + 1)}}
                ]
            },
            f"at most {MAX_MIG_DEVICES}",
        ),
        ({"gpus": [{**gpu(0), "name": "x" * 100_000}]}, "a string of 100000 characters"),
    ],
    ids=["processes", "gpus", "mig-devices", "long-name"],
)
def test_a_file_under_the_size_cap_but_too_big_to_check_is_refused_quickly(
    backend: tuple[FakeBackend, Path],
    caplog: pytest.LogCaptureFixture,
    data: dict[str, Any],
    says: str,
) -> None:
    b, path = backend
    content = json.dumps(data).encode()
    assert len(content) <= MAX_STATE_BYTES
    spent = poll_cpu_s(b, path, content)
    assert spent < POLL_CPU_BUDGET_S, f"a poll took {spent:.2f} s of CPU"
    assert "too big to read at every poll" in caplog.text
    assert says in caplog.text


def test_a_node_at_the_limits_is_served(tmp_path: Path) -> None:
    """The limits leave room for any real node: 64 GPUs and 4096 processes, pretty-printed."""
    per_gpu = MAX_PROCESSES // MAX_GPUS
    gpus = [gpu(i, processes(per_gpu, 1 + i * per_gpu)) for i in range(MAX_GPUS)]
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": gpus}, indent=2))
    assert path.stat().st_size <= MAX_STATE_BYTES
    with FakeBackend(path) as b:
        reading = b.poll()
        assert len(reading.gpus) == MAX_GPUS
        assert sum(len(g.processes) for g in reading.gpus) == MAX_PROCESSES


def test_a_state_file_that_is_a_device_or_a_fifo_is_refused_without_blocking(
    backend: tuple[FakeBackend, Path], caplog: pytest.LogCaptureFixture
) -> None:
    b, path = backend
    path.unlink()
    path.symlink_to("/dev/zero")
    start = time.monotonic()
    assert len(b.poll().gpus) == len(TWO_GPUS)
    assert "not a regular file" in caplog.text
    path.unlink()
    os.mkfifo(path)
    # A FIFO with no writer must not block the poll.
    polled: list[int] = []
    poll = threading.Thread(target=lambda: polled.append(len(b.poll().gpus)), daemon=True)
    poll.start()
    poll.join(5)
    try:
        assert not poll.is_alive(), "the poll is blocked opening a FIFO"
    finally:
        with contextlib.suppress(OSError):  # a reader blocked in open() is let go
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        poll.join(5)
    assert polled == [len(TWO_GPUS)]
    assert time.monotonic() - start < 10
