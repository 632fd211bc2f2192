"""The fake GPUs' memory partitions (docs/design.md §8, §15): the state file's `driver_version`
and `memory_partitions`, what each GPU can enforce, and limits set, read, cleared and kept in the
fake driver's file, with the driver's rules and codes, on any host (no cgroup v2 needed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.errors import MemoryLimitError, StateFileError
from deviceplugin.gpu.fake import FakeBackend, FakeGpu, parse_state
from deviceplugin.gpu.fake.partitionstate import read_partitions
from deviceplugin.partitions import (
    LIMIT_MAX,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimits,
    PartitionMode,
    PollCause,
)
from tests.support.cgroup_tree import GiB, Hierarchy, gpu_entry, leaf_of

LEAF = leaf_of("app")
POD = LEAF.rsplit("/", 1)[0]


gpu = gpu_entry


STATE = {
    "gpus": [
        gpu("GPU-dmem", 0, driver_version="615.71", memory_partitions="dmem"),
        gpu("GPU-misc", 1, driver_version="615.71.09", memory_partitions="misc"),
        gpu("GPU-old", 2, driver_version="580.65", memory_partitions="dmem"),
        gpu("GPU-none", 3, driver_version="615.71"),
        gpu("GPU-mig", 4, driver_version="615.71", memory_partitions="dmem", mig_enabled=True),
    ]
}


class Clock:
    def __init__(self) -> None:
        self.now = 1796422981.123456

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cgroups(tmp_path: Path) -> Hierarchy:
    tree = Hierarchy(tmp_path / "h")
    tree.mkdir(LEAF)
    return tree


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(STATE))
    return path


@pytest.fixture
def backend(state_file: Path, cgroups: Hierarchy, clock: Clock) -> Iterator[FakeBackend]:
    with FakeBackend(state_file, cgroup_root=cgroups.root, wall_clock=clock) as b:
        yield b


def limits_file(state_file: Path) -> dict[str, Any]:
    return read_partitions(state_file.with_name(state_file.name + ".memory-limits.json"))


# -- the state file ------------------------------------------------------------------------------


def test_the_state_file_takes_a_driver_version_and_a_store_and_writes_them_back() -> None:
    state = parse_state(STATE)
    assert state.gpus[0].driver_version == "615.71"
    assert state.gpus[0].memory_partitions == "dmem"
    assert state.gpus[3].memory_partitions is None
    assert parse_state(state.to_json()) == state


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"driver_version": "six"}, 'driver_version: expected a driver version like "615.71"'),
        ({"driver_version": 615}, "driver_version: expected a driver version"),
        (
            {"driver_version": "615.71", "memory_partitions": "zfs"},
            'memory_partitions: expected "dmem", "misc" or null',
        ),
        ({"memory_partitions": "dmem"}, "memory_partitions: needs the GPU's driver_version"),
    ],
)
def test_bad_partition_keys_are_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(StateFileError, match=message):
        parse_state({"gpus": [gpu("GPU-x", 0, **extra)]})


@pytest.mark.parametrize(
    ("extra", "mode", "cause"),
    [
        ({"driver_version": "615.71", "memory_partitions": "dmem"}, PartitionMode.DMEM, None),
        ({"driver_version": "620.1", "memory_partitions": "misc"}, PartitionMode.MISC, None),
        ({"driver_version": "580.65", "memory_partitions": "dmem"}, None, PollCause.DRIVER_TOO_OLD),
        ({"driver_version": "615.71"}, None, PollCause.NO_PARTITIONS),
        ({}, None, PollCause.NO_PARTITIONS),
        (
            {"driver_version": "615.71", "memory_partitions": "dmem", "mig_enabled": True},
            None,
            PollCause.MIG,
        ),
    ],
)
def test_what_a_fake_gpu_can_enforce(
    extra: dict[str, Any], mode: PartitionMode | None, cause: PollCause | None
) -> None:
    fake: FakeGpu = parse_state({"gpus": [gpu("GPU-x", 0, **extra)]}).gpus[0]
    support = fake.partition_support
    assert support.mode == (mode or PartitionMode.POLL)
    if cause is not None:
        assert support.cause == cause
        assert support.reason


# -- the backend -----------------------------------------------------------------------------


def test_the_backend_says_per_gpu_what_it_can_enforce(backend: FakeBackend) -> None:
    modes = {uuid: s.mode for uuid, s in backend.memory_partitioning().items()}
    assert modes == {
        "GPU-dmem": PartitionMode.DMEM,
        "GPU-misc": PartitionMode.MISC,
        "GPU-old": PartitionMode.POLL,
        "GPU-none": PartitionMode.POLL,
        "GPU-mig": PartitionMode.POLL,
    }


def test_a_limit_set_is_read_back_and_kept_in_the_fake_drivers_file(
    backend: FakeBackend, state_file: Path
) -> None:
    backend.set_memory_limits("GPU-dmem", LEAF, GiB, 8 * GiB)
    assert backend.get_memory_limits("GPU-dmem", LEAF) == MemoryLimits(GiB, 8 * GiB, 0)
    written = limits_file(state_file)["gpus"]["GPU-dmem"]
    assert written["store"] == "dmem"
    assert written["limits"][LEAF] == {
        "soft_bytes": GiB,
        "hard_bytes": 8 * GiB,
        "set_at": "2026-12-04T22:23:01.123456Z",
        "set_at_s": 1796422981.123456,
    }
    # dmem: the soft limit reserved in every ancestor.
    assert written["limits"]["/kubepods"]["soft_bytes"] == GiB
    events = limits_file(state_file)["events"]
    assert [(e["action"], e["cgroup"]) for e in events] == [("set", LEAF)]


def test_clearing_zeroes_soft_first_and_leaves_nothing(
    backend: FakeBackend, state_file: Path, clock: Clock
) -> None:
    backend.set_memory_limits("GPU-dmem", LEAF, GiB, 8 * GiB)
    clock.now += 0.25
    assert backend.clear_memory_limits("GPU-dmem", LEAF)
    assert backend.get_memory_limits("GPU-dmem", LEAF) is None
    written = limits_file(state_file)
    assert written["gpus"]["GPU-dmem"]["limits"] == {}
    steps = [(e["action"], e["soft_bytes"], e["hard_bytes"]) for e in written["events"]]
    assert steps == [("set", GiB, 8 * GiB), ("set", 0, 8 * GiB), ("clear", 0, LIMIT_MAX)]
    assert written["events"][-1]["at"] == "2026-12-04T22:23:01.373456Z"
    assert not backend.clear_memory_limits("GPU-dmem", LEAF)  # nothing left to clear


def test_a_gpu_whose_memory_is_polled_refuses_with_the_drivers_code(backend: FakeBackend) -> None:
    for uuid, code in (
        ("GPU-old", NVML_ERROR_FUNCTION_NOT_FOUND),
        ("GPU-none", NVML_ERROR_NOT_SUPPORTED),
        ("GPU-mig", NVML_ERROR_NOT_SUPPORTED),
    ):
        with pytest.raises(MemoryLimitError) as raised:
            backend.set_memory_limits(uuid, LEAF, 0, GiB)
        assert raised.value.code == code
        assert uuid in str(raised.value)
        assert LEAF in str(raised.value)
    with pytest.raises(MemoryLimitError, match="no GPU GPU-gone"):
        backend.set_memory_limits("GPU-gone", LEAF, 0, GiB)
    with pytest.raises(MemoryLimitError) as raised:
        backend.set_memory_limits("GPU-dmem", "/kubepods/nowhere", 0, GiB)
    assert raised.value.code_name == "NVML_ERROR_NOT_FOUND"
    assert raised.value.code == NVML_ERROR_NOT_FOUND
    with pytest.raises(ValueError, match="soft <= hard"):
        backend.set_memory_limits("GPU-dmem", LEAF, 2, 1)


def test_a_restarted_backend_finds_the_limits_the_driver_holds(
    backend: FakeBackend, state_file: Path, cgroups: Hierarchy, clock: Clock
) -> None:
    backend.set_memory_limits("GPU-misc", LEAF, 0, 4 * GiB)
    backend.close()
    with FakeBackend(state_file, cgroup_root=cgroups.root, wall_clock=clock) as again:
        assert again.get_memory_limits("GPU-misc", LEAF) == MemoryLimits(0, 4 * GiB, 0)


def test_a_removed_cgroup_drops_its_limit_and_on_dmem_leaks_its_reservation(
    backend: FakeBackend, state_file: Path, cgroups: Hierarchy
) -> None:
    backend.set_memory_limits("GPU-dmem", LEAF, GiB, 8 * GiB)
    backend.set_memory_limits("GPU-misc", LEAF, GiB, 8 * GiB)
    cgroups.remove(LEAF)
    backend.partitions.forget_removed()
    written = limits_file(state_file)
    assert LEAF not in written["gpus"]["GPU-dmem"]["limits"]
    assert LEAF not in written["gpus"]["GPU-misc"]["limits"]
    assert written["gpus"]["GPU-dmem"]["limits"][POD]["soft_bytes"] == GiB  # the leak
    assert written["gpus"]["GPU-misc"]["limits"] == {}  # misc: nothing left
    removed = [e for e in written["events"] if e["action"] == "removed"]
    assert {(e["gpu"], e["cgroup"]) for e in removed} == {("GPU-dmem", LEAF), ("GPU-misc", LEAF)}


def test_a_state_file_change_changes_what_a_gpu_can_enforce(
    backend: FakeBackend, state_file: Path
) -> None:
    changed = json.loads(state_file.read_text())
    del changed["gpus"][0]["memory_partitions"]
    state_file.write_text(json.dumps(changed))
    support = backend.memory_partitioning()["GPU-dmem"]
    assert support.cause == PollCause.NO_PARTITIONS
    with pytest.raises(MemoryLimitError):
        backend.set_memory_limits("GPU-dmem", LEAF, 0, GiB)
