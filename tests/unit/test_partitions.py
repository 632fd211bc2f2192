"""The values of GPU memory partitions (deviceplugin/partitions.py) and the one rule both
backends clear a limit by."""

from __future__ import annotations

import pytest

from deviceplugin.partitions import (
    LIMIT_MAX,
    GpuLimit,
    MemoryLimits,
    PartitionMode,
    PartitionSupport,
    PollCause,
    cgroup_ancestors,
    clear_limits,
    driver_major,
    polled,
    rfc3339,
)


def test_clearing_zeroes_the_soft_limit_before_the_hard_limit_is_lifted() -> None:
    calls: list[tuple[int, int]] = []
    current = MemoryLimits(1 << 30, 8 << 30)
    assert clear_limits(lambda: current, lambda s, h: calls.append((s, h)))
    assert calls == [(0, 8 << 30), (0, LIMIT_MAX)]


def test_clearing_a_hard_limit_alone_is_one_call_and_nothing_set_is_none() -> None:
    calls: list[tuple[int, int]] = []
    assert clear_limits(lambda: MemoryLimits(0, 8 << 30), lambda s, h: calls.append((s, h)))
    assert calls == [(0, LIMIT_MAX)]
    calls.clear()
    assert not clear_limits(lambda: None, lambda s, h: calls.append((s, h)))
    assert not clear_limits(lambda: MemoryLimits(0, LIMIT_MAX), lambda s, h: calls.append((s, h)))
    assert calls == []


def test_a_failed_second_step_leaves_the_soft_limit_zeroed() -> None:
    calls: list[tuple[int, int]] = []

    def set_limits(soft: int, hard: int) -> None:
        calls.append((soft, hard))
        if hard == LIMIT_MAX:
            raise RuntimeError("the driver failed")

    with pytest.raises(RuntimeError):
        clear_limits(lambda: MemoryLimits(1, 2), set_limits)
    assert calls[0] == (0, 2)


def test_a_containers_limits_on_a_gpu_add_up_and_never_pass_max() -> None:
    assert GpuLimit(1, 4) + GpuLimit(2, 8) == GpuLimit(3, 12)
    assert GpuLimit(0, LIMIT_MAX) + GpuLimit(5, 8) == GpuLimit(5, LIMIT_MAX)
    with pytest.raises(ValueError, match="soft <= hard"):
        GpuLimit(9, 8)
    with pytest.raises(ValueError, match="soft <= hard"):
        GpuLimit(-1, 8)


@pytest.mark.parametrize(
    ("version", "major"),
    [("615.71.09", 615), ("615.71", 615), ("560", 560), ("", None), (None, None), ("x.1", None)],
)
def test_driver_major(version: str | None, major: int | None) -> None:
    assert driver_major(version) == major


def test_set_times_are_rfc3339_with_microseconds() -> None:
    assert rfc3339(1796422981.123456) == "2026-12-04T22:23:01.123456Z"
    assert rfc3339(0) == "1970-01-01T00:00:00.000000Z"


def test_ancestors_nearest_first_without_the_root() -> None:
    assert cgroup_ancestors("/a/b/c") == ["/a/b", "/a"]
    assert cgroup_ancestors("/a") == []


def test_support_says_whether_the_driver_enforces() -> None:
    assert PartitionSupport(PartitionMode.DMEM).enforced
    polled_gpu = polled(PollCause.MIG, "MIG mode is on")
    assert not polled_gpu.enforced
    assert polled_gpu.describe() == "poll (MIG mode is on)"
    assert PartitionSupport(PartitionMode.MISC).describe() == "driver-misc"
