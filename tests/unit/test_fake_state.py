"""The fake backend's state file (docs/design.md §8) and its time-slicing model, on a fake
/proc tree."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.errors import BackendError, StateFileError
from deviceplugin.gpu.fake import (
    FakeBackend,
    FakeGpu,
    FakeProcess,
    FakeState,
    parse_state,
    proc_stat_state,
    read_state_file,
    write_state_file,
)
from deviceplugin.model import GpuInfo

# The example of docs/design.md §8, verbatim.
CONTRACT_EXAMPLE: dict[str, Any] = {
    "gpus": [
        {
            "uuid": "GPU-0a1b",
            "index": 0,
            "name": "NVIDIA A100-SXM4-80GB",
            "memory_total_bytes": 85899345920,
            "minor": 0,
            "numa_node": 0,
            "healthy": True,
            "processes": [{"pid": 4242, "used_memory_bytes": 1073741824, "sm_demand_percent": 80}],
        }
    ]
}


def two_gpus() -> dict[str, Any]:
    return {
        "gpus": [
            {"uuid": "GPU-a", "index": 0, "name": "A100", "memory_total_bytes": 1000, "minor": 0},
            {
                "uuid": "GPU-b",
                "index": 1,
                "name": "A100",
                "memory_total_bytes": 1000,
                "minor": 1,
                "processes": [
                    {"pid": 10, "used_memory_bytes": 5, "sm_demand_percent": 30},
                    {"pid": 11, "used_memory_bytes": 6, "sm_demand_percent": 40.5},
                ],
            },
        ]
    }


# -- valid files -------------------------------------------------------------------------------


def test_design_example_parses_with_every_field() -> None:
    state = parse_state(CONTRACT_EXAMPLE)
    assert state == FakeState(
        gpus=(
            FakeGpu(
                uuid="GPU-0a1b",
                index=0,
                name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=85899345920,
                minor=0,
                numa_node=0,
                healthy=True,
                processes=(
                    FakeProcess(pid=4242, used_memory_bytes=1073741824, sm_demand_percent=80),
                ),
            ),
        )
    )


def test_optional_keys_take_their_defaults() -> None:
    state = parse_state(
        {"gpus": [{"uuid": "GPU-x", "index": 3, "name": "T4", "memory_total_bytes": 0, "minor": 7}]}
    )
    (gpu,) = state.gpus
    assert gpu.healthy is True
    assert gpu.numa_node is None
    assert gpu.processes == ()
    assert gpu.pci_bus_id is None
    assert gpu.mig_enabled is False
    assert gpu.health_reason == ""


def test_a_process_without_demand_computes_nothing() -> None:
    data = two_gpus()
    data["gpus"][0]["processes"] = [{"pid": 5, "used_memory_bytes": 7}]
    assert parse_state(data).gpus[0].processes == (FakeProcess(5, 7, 0),)


def test_a_node_without_gpus_is_valid() -> None:
    assert parse_state({"gpus": []}) == FakeState(gpus=())


def test_extras_beyond_design_are_accepted_and_reach_gpu_info() -> None:
    data = two_gpus()
    data["gpus"][0].update(
        pci_bus_id="00000000:3B:00.0", mig_enabled=True, healthy=False, health_reason="Xid 79"
    )
    gpu = parse_state(data).gpus[0]
    assert gpu.health_reason == "Xid 79"
    assert gpu.info == GpuInfo(
        uuid="GPU-a",
        index=0,
        name="A100",
        memory_total_bytes=1000,
        minor=0,
        numa_node=None,
        pci_bus_id="00000000:3B:00.0",
        mig_enabled=True,
    )


def test_the_same_pid_may_use_two_gpus() -> None:
    data = two_gpus()
    data["gpus"][0]["processes"] = [{"pid": 10, "used_memory_bytes": 1, "sm_demand_percent": 5}]
    assert parse_state(data).gpus[0].processes[0].pid == 10


def test_to_json_round_trips() -> None:
    data = two_gpus()
    data["gpus"][1].update(pci_bus_id="0000:01:00.0", mig_enabled=True, health_reason="lost")
    state = parse_state(data)
    as_json = state.to_json()
    assert parse_state(json.loads(json.dumps(as_json))) == state


def test_to_json_of_the_design_example_is_the_example() -> None:
    assert parse_state(CONTRACT_EXAMPLE).to_json() == CONTRACT_EXAMPLE


# -- invalid files: every problem names the JSON path, the bad value and what is expected ------


def mutate(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = copy.deepcopy(two_gpus())
    change(data)
    return data


INVALID = [
    pytest.param(
        mutate(lambda d: d["gpus"][1].update(memory_total_bytes="80G")),
        'gpus[1].memory_total_bytes: expected a non-negative integer, got "80G"',
        id="memory as text",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(memory_total_bytes=8.5e10)),
        "gpus[0].memory_total_bytes: expected a non-negative integer, got 85000000000.0",
        id="memory as float",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(index=-1)),
        "gpus[0].index: expected a non-negative integer, got -1",
        id="negative index",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(minor=True)),
        "gpus[0].minor: expected a non-negative integer, got true",
        id="boolean minor",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(numa_node="0")),
        'gpus[0].numa_node: expected a non-negative integer or null, got "0"',
        id="numa node as text",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(healthy="yes")),
        'gpus[0].healthy: expected true or false, got "yes"',
        id="healthy as text",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(uuid="")),
        'gpus[0].uuid: expected a non-empty string, got ""',
        id="empty uuid",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(name=None)),
        "gpus[0].name: expected a string, got null",
        id="null name",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(pci_bus_id=3)),
        "gpus[0].pci_bus_id: expected a string or null, got 3",
        id="numeric pci bus id",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].pop("uuid")),
        "gpus[0].uuid: required key is missing",
        id="missing uuid",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(memroy_total_bytes=5)),
        'gpus[0].memroy_total_bytes: unknown key (did you mean "memory_total_bytes"?)',
        id="typo in a key",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][0].update(colour="green")),
        "gpus[0].colour: unknown key (known keys: uuid, index,",
        id="unknown key",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][0].update(sm_demand_percent=150)),
        "gpus[1].processes[0].sm_demand_percent: expected a number from 0 to 100, got 150",
        id="demand above 100",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][0].update(sm_demand_percent=float("nan"))),
        "gpus[1].processes[0].sm_demand_percent: expected a number from 0 to 100, got NaN",
        id="demand NaN",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].update(pid="42")),
        'gpus[1].processes[1].pid: expected a positive integer, got "42"',
        id="pid as text",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].update(pid=0)),
        "gpus[1].processes[1].pid: expected a positive integer, got 0",
        id="pid zero",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].update(used_memory_bytes=-1)),
        "gpus[1].processes[1].used_memory_bytes: expected a non-negative integer, got -1",
        id="negative process memory",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].pop("used_memory_bytes")),
        "gpus[1].processes[1].used_memory_bytes: required key is missing",
        id="process memory missing",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].update(sm_demand=3)),
        'gpus[1].processes[1].sm_demand: unknown key (did you mean "sm_demand_percent"?)',
        id="typo in a process key",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1].update(processes={"pid": 1})),
        'gpus[1].processes: expected a list of processes, got {"pid": 1}',
        id="processes not a list",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"].append(12)),
        "gpus[1].processes[2]: expected an object with pid, used_memory_bytes, "
        "sm_demand_percent, got 12",
        id="process not an object",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"].append("GPU-c")),
        'gpus[2]: expected an object describing a GPU, got "GPU-c"',
        id="gpu not an object",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1].update(uuid="GPU-a")),
        'gpus[1].uuid: duplicate of gpus[0].uuid, got "GPU-a"',
        id="duplicate uuid",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1].update(index=0)),
        "gpus[1].index: duplicate of gpus[0].index, got 0",
        id="duplicate index",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1].update(minor=0)),
        "gpus[1].minor: duplicate of gpus[0].minor, got 0",
        id="duplicate minor",
    ),
    pytest.param(
        mutate(lambda d: d["gpus"][1]["processes"][1].update(pid=10)),
        "gpus[1].processes[1].pid: duplicate of gpus[1].processes[0].pid, got 10",
        id="duplicate pid on one gpu",
    ),
    pytest.param(
        {"gpus": {"GPU-a": {}}},
        'gpus: expected a list of GPUs, got {"GPU-a": {}}',
        id="gpus not a list",
    ),
    pytest.param({}, "gpus: required key is missing", id="no gpus key"),
    pytest.param(
        {"gpus": [], "gpu": []},
        'gpu: unknown key (did you mean "gpus"?)',
        id="unknown top-level key",
    ),
    pytest.param(
        [{"uuid": "GPU-a"}],
        'document: expected an object like {"gpus": [...]}, got [{"uuid": "GPU-a"}]',
        id="document is a list",
    ),
]


@pytest.mark.parametrize(("data", "message"), INVALID)
def test_invalid_state_is_rejected_naming_path_and_value(data: object, message: str) -> None:
    with pytest.raises(StateFileError) as caught:
        parse_state(data)
    assert message in str(caught.value)


def test_every_problem_is_reported_at_once() -> None:
    data = two_gpus()
    data["gpus"][0]["index"] = "zero"
    data["gpus"][1]["processes"][0]["sm_demand_percent"] = -5
    with pytest.raises(StateFileError) as caught:
        parse_state(data)
    assert 'gpus[0].index: expected a non-negative integer, got "zero"' in str(caught.value)
    assert "gpus[1].processes[0].sm_demand_percent" in str(caught.value)


def test_a_long_bad_value_is_shortened() -> None:
    data = two_gpus()
    data["gpus"][0]["name"] = list(range(1000))
    with pytest.raises(StateFileError) as caught:
        parse_state(data)
    assert len(str(caught.value)) < 200


# -- reading and writing files -----------------------------------------------------------------


def test_write_then_read_gives_the_same_state_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = parse_state(two_gpus())
    write_state_file(path, state)
    assert read_state_file(path) == state
    write_state_file(path, CONTRACT_EXAMPLE)
    assert read_state_file(path) == parse_state(CONTRACT_EXAMPLE)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_write_refuses_an_invalid_state_unless_told(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    bad = {"gpus": [{"uuid": "GPU-a"}]}
    with pytest.raises(StateFileError, match=re.escape("gpus[0].index: required key is missing")):
        write_state_file(path, bad)
    assert not path.exists()
    write_state_file(path, bad, validate=False)
    assert json.loads(path.read_text()) == bad


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"", "the file is empty", id="empty"),
        pytest.param(
            b'{"gpus": [}', "not valid JSON: Expecting value at line 1 column 11", id="json"
        ),
        pytest.param(b"\xff\xfe{}", "not UTF-8", id="encoding"),
        pytest.param(b'{"gpus": 3}', "gpus: expected a list of GPUs, got 3", id="schema"),
    ],
)
def test_reading_a_bad_file_names_the_file_and_the_problem(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as caught:
        read_state_file(path)
    assert str(path) in str(caught.value)
    assert message in str(caught.value)


def test_reading_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="does not exist"):
        read_state_file(tmp_path / "nope.json")


# -- /proc/<pid>/stat --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stat", "state"),
    [
        (b"4242 (python3) S 1 4242 4242 0 -1 4194560", "S"),
        (b"4242 (sleep) T 1 4242 4242 0 -1", "T"),
        (b"7 (my (weird) T proc) R 1 7 7 0", "R"),
        (b"7 (a) t (b) t 1 7", "t"),
        (b"7 (\xff\xfe) Z 1 7", "Z"),
        ("8 (text) D 1 8", "D"),
    ],
)
def test_run_state_is_the_field_after_the_last_paren(stat: bytes | str, state: str) -> None:
    assert proc_stat_state(stat) == state


@pytest.mark.parametrize("stat", [b"", b"4242 (python3", b"4242 (python3)   "])
def test_a_stat_line_without_a_state_is_an_error(stat: bytes) -> None:
    with pytest.raises(ValueError, match="/proc/<pid>/stat"):
        proc_stat_state(stat)


# -- the time-slicing model, on a fake /proc and a fake clock ---------------------------------

# The sampler runs every 5 ms; SETTLE_S leaves it many rounds to see a change.
SAMPLE_INTERVAL_S = 0.005
SETTLE_S = 0.1


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class FakeProc:
    """A /proc tree with a stat file per pid, replaced atomically as a real one changes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def set(self, pid: int, state: str, comm: str = "worker") -> None:
        directory = self.root / str(pid)
        directory.mkdir(exist_ok=True)
        tmp = directory / "stat.tmp"
        tmp.write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 100 0 0 0\n")
        os.replace(tmp, directory / "stat")

    def remove(self, pid: int) -> None:
        (self.root / str(pid) / "stat").unlink()
        (self.root / str(pid)).rmdir()


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_backend(
    tmp_path: Path, proc: FakeProc, clock: FakeClock
) -> Iterator[Callable[[list[tuple[int, int]]], FakeBackend]]:
    """A backend over one GPU whose processes are (pid, demand) pairs."""
    backends: list[FakeBackend] = []

    def make(processes: list[tuple[int, int]]) -> FakeBackend:
        path = tmp_path / "state.json"
        gpu = {"uuid": "GPU-a", "index": 0, "name": "A100", "memory_total_bytes": 100, "minor": 0}
        gpu["processes"] = [
            {"pid": pid, "used_memory_bytes": 3, "sm_demand_percent": demand}
            for pid, demand in processes
        ]
        write_state_file(path, {"gpus": [gpu]})
        backend = FakeBackend(
            path, sample_interval_s=SAMPLE_INTERVAL_S, proc_root=proc.root, clock=clock
        )
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


def utilisation(backend: FakeBackend) -> dict[int, float | None]:
    (gpu,) = backend.poll().gpus
    return {p.pid: p.sm_util_percent for p in gpu.processes}


def test_demands_within_capacity_are_met(
    proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    proc.set(1, "R")
    proc.set(2, "S")
    backend = make_backend([(1, 80), (2, 20)])
    clock.now_s += 1
    (gpu,) = backend.poll().gpus
    assert {p.pid: p.sm_util_percent for p in gpu.processes} == {1: 80.0, 2: 20.0}
    assert gpu.sm_util_percent == 100.0
    assert gpu.memory_used_bytes == 6


def test_oversubscribed_demands_are_scaled_down_in_proportion(
    proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    proc.set(1, "R")
    proc.set(2, "R")
    proc.set(3, "R")
    backend = make_backend([(1, 80), (2, 80), (3, 40)])
    clock.now_s += 2
    assert utilisation(backend) == {1: 40.0, 2: 40.0, 3: 20.0}


def test_a_stopped_process_computes_nothing_and_frees_the_gpu_for_the_others(
    proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    proc.set(1, "T")
    proc.set(2, "R", comm="my (odd) T name")
    backend = make_backend([(1, 80), (2, 80)])
    clock.now_s += 1
    assert utilisation(backend) == {1: 0.0, 2: 80.0}


@pytest.mark.parametrize("state", ["t", "Z", "X"])
def test_traced_and_dead_processes_compute_nothing(
    proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend], state: str
) -> None:
    proc.set(1, state)
    backend = make_backend([(1, 50)])
    clock.now_s += 1
    assert utilisation(backend) == {1: 0.0}


def test_a_missing_process_computes_nothing_but_keeps_its_memory(
    clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    backend = make_backend([(99, 50)])
    clock.now_s += 1
    (gpu,) = backend.poll().gpus
    assert gpu.processes[0].sm_util_percent == 0.0
    assert gpu.processes[0].used_memory_bytes == 3
    assert gpu.memory_used_bytes == 3


def test_utilisation_is_averaged_since_the_previous_poll(
    proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    proc.set(1, "R")
    backend = make_backend([(1, 90)])
    clock.now_s += 1  # running for 1 s
    time.sleep(SETTLE_S)
    proc.set(1, "T")
    time.sleep(SETTLE_S)
    clock.now_s += 2  # then stopped for 2 s
    assert utilisation(backend) == {1: pytest.approx(30.0)}
    proc.remove(1)
    time.sleep(SETTLE_S)
    clock.now_s += 1  # a new window: gone all along
    assert utilisation(backend) == {1: 0.0}


def test_a_broken_proc_tree_fails_the_next_poll_loudly(
    proc: FakeProc,
    clock: FakeClock,
    make_backend: Callable[..., FakeBackend],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proc.set(1, "R")
    backend = make_backend([(1, 50)])
    (proc.root / "1" / "stat").write_text("garbage")
    deadline = time.monotonic() + 5
    with pytest.raises(BackendError, match="sampler failed"):  # noqa: PT012
        while time.monotonic() < deadline:
            backend.poll()
            time.sleep(SAMPLE_INTERVAL_S)
    failures = [r for r in caplog.records if "sampler failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.ERROR
    assert failures[0].exc_info is not None


def test_a_proc_tree_that_cannot_be_read_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    not_a_directory = tmp_path / "proc"
    not_a_directory.write_text("")
    state = two_gpus()
    write_state_file(path, state)
    with pytest.raises(BackendError, match="run state"):
        FakeBackend(path, proc_root=not_a_directory)


def test_health_transitions_are_counted(
    tmp_path: Path, proc: FakeProc, clock: FakeClock, make_backend: Callable[..., FakeBackend]
) -> None:
    backend = make_backend([])
    path = tmp_path / "state.json"
    gpu = {"uuid": "GPU-a", "index": 0, "name": "A100", "memory_total_bytes": 100, "minor": 0}
    counts: list[tuple[bool, int]] = []
    for healthy in (True, False, False, True, False):
        write_state_file(path, {"gpus": [{**gpu, "healthy": healthy}]})
        os.utime(path, ns=(len(counts) + 1, len(counts) + 1))  # a new mtime: re-read for sure
        (reading,) = backend.poll().gpus
        counts.append((reading.healthy, reading.unhealthy_transitions))
    assert counts == [(True, 0), (False, 1), (False, 1), (True, 1), (False, 2)]
