"""The fake GPU backend against real processes: what `--backend fake:PATH` users and the demo see.

Every process signalled here is a child spawned by the test; the `spawn` fixture resumes and kills
each one whatever the outcome.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.errors import BackendError, StateFileError
from deviceplugin.gpu.fake import (
    FakeBackend,
    FakeGpu,
    FakeMigDevice,
    FakeState,
    proc_stat_state,
    write_state_file,
)
from deviceplugin.model import GpuInfo, NodeReading

Spawn = Callable[[], "subprocess.Popen[bytes]"]
MakeBackend = Callable[[Path], FakeBackend]

GIB = 1024**3


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        child = subprocess.Popen(["sleep", "60"])
        children.append(child)
        return child

    yield start
    for child in children:
        try:
            child.send_signal(signal.SIGCONT)
            child.kill()
        finally:
            child.wait(timeout=10)


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "state.json"


@pytest.fixture
def make_backend() -> Iterator[MakeBackend]:
    backends: list[FakeBackend] = []

    def make(path: Path) -> FakeBackend:
        backend = FakeBackend(path)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


def gpu(
    uuid: str, index: int, processes: Sequence[tuple[int, int, float]] = (), **extra: Any
) -> dict[str, Any]:
    """A GPU of a state file; processes are (pid, used memory bytes, SM demand percent)."""
    entry: dict[str, Any] = {
        "uuid": uuid,
        "index": index,
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_bytes": 80 * GIB,
        "minor": index,
        "processes": [
            {"pid": pid, "used_memory_bytes": memory, "sm_demand_percent": demand}
            for pid, memory, demand in processes
        ],
    }
    entry.update(extra)
    return entry


def write_raw(path: Path, text: str) -> None:
    """Replace the file atomically with arbitrary text, as a careful editor would."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for_run_state(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        state = proc_stat_state(Path(f"/proc/{pid}/stat").read_bytes())
        if (state in "Tt") == stopped:
            return
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not become {'stopped' if stopped else 'running'}")


def utilisation(reading: NodeReading, index: int = 0) -> dict[int, float | None]:
    return {p.pid: p.sm_util_percent for p in reading.gpus[index].processes}


def measure(backend: FakeBackend, window_s: float) -> NodeReading:
    """The reading over a fresh window of about `window_s`."""
    backend.poll()
    time.sleep(window_s)
    return backend.poll()


def rejections(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "state file rejected" in r.getMessage()]


# -- inventory and the state file --------------------------------------------------------------


def test_inventory_and_memory_come_from_the_file(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    a, b = spawn(), spawn()
    write_state_file(
        state_path,
        {
            "gpus": [
                gpu("GPU-b", 1, [(a.pid, 2 * GIB, 10)], healthy=False, health_reason="Xid 79"),
                gpu("GPU-a", 0, [(a.pid, 1 * GIB, 10), (b.pid, 3 * GIB, 0)], numa_node=1),
            ]
        },
    )
    backend = make_backend(state_path)
    assert backend.name == f"fake:{state_path}"
    reading = backend.poll()

    assert [g.info.uuid for g in reading.gpus] == ["GPU-a", "GPU-b"]
    first, second = reading.gpus
    assert first.info == GpuInfo(
        uuid="GPU-a",
        index=0,
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GIB,
        minor=0,
        numa_node=1,
    )
    assert first.healthy
    assert first.memory_used_bytes == 4 * GIB
    assert [(p.pid, p.used_memory_bytes) for p in first.processes] == [
        (a.pid, 1 * GIB),
        (b.pid, 3 * GIB),
    ]
    assert not second.healthy
    assert second.health_reason == "Xid 79"
    assert second.memory_used_bytes == 2 * GIB


def test_a_rewritten_file_is_picked_up_on_the_next_poll(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    a, b = spawn(), spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(a.pid, GIB, 10)])]})
    backend = make_backend(state_path)
    assert backend.poll().gpus[0].memory_used_bytes == GIB

    write_state_file(
        state_path,
        {"gpus": [gpu("GPU-a", 0, [(a.pid, 2 * GIB, 10), (b.pid, GIB, 10)]), gpu("GPU-c", 1)]},
    )
    reading = backend.poll()
    assert [g.info.uuid for g in reading.gpus] == ["GPU-a", "GPU-c"]
    assert reading.gpus[0].memory_used_bytes == 3 * GIB
    assert [p.pid for p in reading.gpus[0].processes] == [a.pid, b.pid]


def test_a_bad_file_is_reported_once_per_problem_and_the_last_good_state_kept(
    state_path: Path, make_backend: MakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="deviceplugin.gpu.fake")
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0)]})
    backend = make_backend(state_path)
    good = backend.poll().gpus

    write_raw(state_path, '{"gpus": [')
    for _ in range(3):
        assert backend.poll().gpus == good
        time.sleep(0.05)  # the sampler looks at the file too
    (first,) = rejections(caplog)
    assert first.levelno == logging.ERROR
    assert str(state_path) in first.getMessage()
    assert "not valid JSON" in first.getMessage()
    assert "keeping the last good state" in first.getMessage()

    bad = gpu("GPU-a", 0, memory_total_bytes="80G")
    write_state_file(state_path, {"gpus": [bad]}, validate=False)
    assert backend.poll().gpus == good
    state_path.unlink()
    assert backend.poll().gpus == good
    time.sleep(0.05)
    assert backend.poll().gpus == good
    messages = [r.getMessage() for r in rejections(caplog)]
    assert len(messages) == 3
    assert 'gpus[0].memory_total_bytes: expected a non-negative integer, got "80G"' in messages[1]
    assert "does not exist" in messages[2]

    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0), gpu("GPU-b", 1)]})
    assert [g.info.uuid for g in backend.poll().gpus] == ["GPU-a", "GPU-b"]
    assert any("accepted again" in r.getMessage() for r in caplog.records)
    assert len(rejections(caplog)) == 3


def test_a_missing_file_stops_the_start_and_says_how_to_fix_it(state_path: Path) -> None:
    with pytest.raises(StateFileError) as caught:
        FakeBackend(state_path)
    assert str(state_path) in str(caught.value)
    assert "does not exist" in str(caught.value)
    assert "create it" in str(caught.value)


def test_an_invalid_file_stops_the_start_naming_the_field(state_path: Path) -> None:
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, numa_node="zero")]}, validate=False)
    with pytest.raises(StateFileError) as caught:
        FakeBackend(state_path)
    assert str(state_path) in str(caught.value)
    assert 'gpus[0].numa_node: expected a non-negative integer or null, got "zero"' in str(
        caught.value
    )


# -- the time-slicing model on real processes --------------------------------------------------


@pytest.mark.parametrize(
    ("demands", "expected"),
    [
        pytest.param((80, 80), (50, 50), id="oversubscribed"),
        pytest.param((80, 20), (80, 20), id="at capacity"),
    ],
)
def test_running_processes_share_the_gpu_by_demand(
    spawn: Spawn,
    state_path: Path,
    make_backend: MakeBackend,
    demands: tuple[int, int],
    expected: tuple[int, int],
) -> None:
    a, b = spawn(), spawn()
    write_state_file(
        state_path,
        {"gpus": [gpu("GPU-a", 0, [(a.pid, GIB, demands[0]), (b.pid, GIB, demands[1])])]},
    )
    backend = make_backend(state_path)
    reading = measure(backend, 0.2)
    assert utilisation(reading) == {
        a.pid: pytest.approx(expected[0], abs=1),
        b.pid: pytest.approx(expected[1], abs=1),
    }
    assert reading.gpus[0].sm_util_percent == pytest.approx(sum(expected), abs=1)


def test_a_stopped_process_computes_nothing_until_it_is_resumed(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    a, b = spawn(), spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(a.pid, GIB, 80), (b.pid, GIB, 80)])]})
    backend = make_backend(state_path)

    a.send_signal(signal.SIGSTOP)
    wait_for_run_state(a.pid, stopped=True)
    time.sleep(0.1)  # several sampling rounds
    reading = measure(backend, 0.2)
    assert utilisation(reading) == {a.pid: pytest.approx(0, abs=1), b.pid: pytest.approx(80, abs=1)}
    assert reading.gpus[0].memory_used_bytes == 2 * GIB

    a.send_signal(signal.SIGCONT)
    wait_for_run_state(a.pid, stopped=False)
    time.sleep(0.1)
    reading = measure(backend, 0.2)
    assert utilisation(reading) == {
        a.pid: pytest.approx(50, abs=1),
        b.pid: pytest.approx(50, abs=1),
    }


def test_a_duty_cycle_shows_as_its_average_over_the_poll_interval(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    child = spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(child.pid, GIB, 100)])]})
    backend = make_backend(state_path)
    done = threading.Event()

    def duty_cycle() -> None:
        stopped = False
        while not done.wait(0.1):
            child.send_signal(signal.SIGCONT if stopped else signal.SIGSTOP)
            stopped = not stopped

    toggler = threading.Thread(target=duty_cycle, daemon=True)
    toggler.start()
    try:
        reading = measure(backend, 1.0)
    finally:
        done.set()
        toggler.join(timeout=5)
        child.send_signal(signal.SIGCONT)
    assert 30 <= (utilisation(reading)[child.pid] or 0) <= 70


def test_a_pid_that_does_not_exist_computes_nothing_but_keeps_its_memory(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    gone = spawn()
    gone.kill()
    gone.wait(timeout=10)
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(gone.pid, 5 * GIB, 60)])]})
    backend = make_backend(state_path)
    reading = measure(backend, 0.1)
    assert utilisation(reading) == {gone.pid: 0.0}
    assert reading.gpus[0].memory_used_bytes == 5 * GIB


def test_close_stops_the_sampler_and_later_polls_fail(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    child = spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(child.pid, GIB, 50)])]})
    before = set(threading.enumerate())
    backend = make_backend(state_path)
    (sampler,) = set(threading.enumerate()) - before
    assert sampler.daemon
    assert sampler.is_alive()

    backend.close()
    assert not sampler.is_alive()
    backend.close()  # idempotent
    with pytest.raises(BackendError, match="after close"):
        backend.poll()


def test_processes_added_to_a_file_that_had_none_are_sampled(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    # The sampler sleeps while no process is listed; the poll that reads the new file wakes it.
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [])]})
    backend = make_backend(state_path)
    assert utilisation(measure(backend, 0.1)) == {}
    a = spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(a.pid, GIB, 60)])]})
    backend.poll()  # reads the new file
    reading = measure(backend, 0.3)
    assert utilisation(reading) == {a.pid: pytest.approx(60, abs=1)}


def test_a_steady_gpu_reads_the_same_until_a_process_stops(
    spawn: Spawn, state_path: Path, make_backend: MakeBackend
) -> None:
    """Polls of a GPU whose processes hold still give the very reading of the poll before (what
    the snapshot build recognises without comparing it field by field), at exactly the demand."""
    a, b = spawn(), spawn()
    write_state_file(state_path, {"gpus": [gpu("GPU-a", 0, [(a.pid, GIB, 30), (b.pid, GIB, 20)])]})
    backend = make_backend(state_path)
    time.sleep(0.2)  # sampling rounds that find both running
    backend.poll()
    time.sleep(0.1)
    steady = backend.poll()
    time.sleep(0.1)
    again = backend.poll()
    assert again.gpus[0] is steady.gpus[0]
    assert utilisation(again) == {a.pid: 30.0, b.pid: 20.0}

    a.send_signal(signal.SIGSTOP)
    wait_for_run_state(a.pid, stopped=True)
    time.sleep(0.1)
    backend.poll()  # the poll whose window saw the change
    time.sleep(0.1)
    stopped = backend.poll()
    assert stopped.gpus[0] is not steady.gpus[0]
    assert utilisation(stopped) == {a.pid: 0.0, b.pid: 20.0}
    assert stopped.gpus[0].processes[1] is steady.gpus[0].processes[1]  # b's figures held


# --- python -m deviceplugin.gpu.fake ------------------------------------------------------------


def fake_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deviceplugin.gpu.fake", *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_run_lists_the_command_on_its_gpu_while_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "new" / "gpus.json"
    assert fake_cli("write", str(path)).returncode == 0
    gpus = json.loads(path.read_text())["gpus"]
    uuid = gpus[1]["uuid"]
    # The GPU comes from the container's NVIDIA_VISIBLE_DEVICES; the command sees the file with
    # its own PID on that GPU.
    show = "import json,os,sys; d=json.load(open(sys.argv[1])); print(os.getpid(), d['gpus'][1])"
    result = fake_cli(
        "run", str(path), "--memory", "2Gi", "--sm", "30", "--",
        sys.executable, "-c", show, str(path),
        env={"NVIDIA_VISIBLE_DEVICES": uuid},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pid, gpu = result.stdout.split(" ", 1)
    assert f"'pid': {pid}, 'used_memory_bytes': 2147483648, 'sm_demand_percent': 30" in gpu
    # Ended: off the file again, and its exit code is run's.
    assert '"pid"' not in path.read_text()
    assert fake_cli("run", str(path), "--gpu", "0", "--", "false").returncode == 1


def test_run_takes_a_mig_device_by_index_as_deviceidstrategy_index_names_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gpus.json"
    parent = FakeGpu(
        "GPU-p", 1, "A100", 80 * GIB, 1, mig_enabled=True, mig_block=True,
        mig_devices=(
            FakeMigDevice("MIG-a", 1, 0, "3g.40gb", 40 * GIB),
            FakeMigDevice("MIG-b", 2, 0, "1g.10gb", 10 * GIB),
        ),
    )  # fmt: skip
    write_state_file(path, FakeState(gpus=(parent,)))
    show = "import json,sys; d=json.load(open(sys.argv[1])); print(d['gpus'][0]['mig'])"
    result = fake_cli(
        "run", str(path), "--", sys.executable, "-c", show, str(path),
        env={"NVIDIA_VISIBLE_DEVICES": "1:1,1:0"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "on GPU MIG-b" in result.stderr
    devices = result.stdout.split("'uuid': ")
    assert "'pid'" not in next(d for d in devices if d.startswith("'MIG-a'"))
    assert "'pid'" in next(d for d in devices if d.startswith("'MIG-b'"))


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--", "true"], {"NVIDIA_VISIBLE_DEVICES": ""}, "name the GPU with --gpu"),
        (["--gpu", "7", "--", "true"], {}, "no GPU '7' in the state file; it has 0 ("),
        (["--gpu", "0"], {}, "give the command to run after --"),
        (["--gpu", "0", "--memory", "10GB", "--", "true"], {}, "is not a size"),
    ],
)
def test_run_says_what_is_missing(
    tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    path = tmp_path / "gpus.json"
    assert fake_cli("write", str(path)).returncode == 0
    result = fake_cli("run", str(path), *args, env=env)
    assert result.returncode == 2
    assert says in result.stderr
