"""Cleaning up GPU memory limits (docs/design.md §15): a container that exits has its limits
cleared, soft first, while its cgroup is still there; one whose cgroup went first has the
reservation it leaked on dmem repaired in its ancestors; a daemon killed outright finds at its
next start what to keep, clear and repair; nothing is ever set above the kubelet's pods."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.backend import PartitionBackend
from deviceplugin.memlimits.reconcile import LeafState, leaf_state
from deviceplugin.partitions import GpuLimit, MemoryLimits, PartitionSupport
from deviceplugin.usage.cgroups import CgroupLayout
from tests.support.cgroup_tree import POD_UID, GiB, Hierarchy
from tests.support.memlimits import Grant, LimitRig

ROOT = "/rootslice"  # the kubelet's --cgroup-root: a cgroup above its pods
POD = f"{ROOT}/kubepods/burstable/pod{POD_UID}"
LEAF_A = f"{POD}/{'a' * 64}"
LEAF_B = f"{POD}/{'b' * 64}"


@pytest.fixture
def cgroups(short_tmp: Path) -> Hierarchy:
    tree = Hierarchy(short_tmp / "h")
    tree.container(10, LEAF_A)
    tree.container(11, LEAF_B)
    return tree


@pytest.fixture
async def rig(short_tmp: Path, cgroups: Hierarchy) -> AsyncIterator[LimitRig]:
    r = LimitRig(
        short_tmp,
        Path("/nonexistent"),  # the hook is not run here: the applier is called directly
        cgroup_mount=cgroups.root,
        proc_root=cgroups.proc,
        layout=CgroupLayout("cgroupfs", ROOT),
    )
    r.source.grants["a"] = Grant(POD_UID, {"GPU-dmem": GpuLimit(GiB, 8 * GiB)})
    r.source.grants["b"] = Grant(
        POD_UID, {"GPU-dmem": GpuLimit(2 * GiB, 8 * GiB), "GPU-misc": GpuLimit(GiB, 4 * GiB)}
    )
    await r.applier.apply(10, "a")
    await r.applier.apply(11, "b")
    try:
        yield r
    finally:
        await r.close()


def soft(rig: LimitRig, gpu: str, cgroup: str) -> int:
    limit = rig.limit_on(gpu, cgroup)
    return 0 if limit is None else int(limit["soft_bytes"])


def actions(rig: LimitRig, cgroup: str) -> list[tuple[str, int, int]]:
    return [
        (e["action"], e["soft_bytes"], e["hard_bytes"])
        for e in rig.limits()["events"]
        if e["cgroup"] == cgroup
    ]


async def test_an_exited_container_is_cleared_soft_first_while_its_cgroup_exists(
    rig: LimitRig, cgroups: Hierarchy
) -> None:
    assert soft(rig, "GPU-dmem", POD) == 3 * GiB
    cgroups.set_populated(LEAF_A, False)
    assert leaf_state(cgroups.root, LEAF_A) is LeafState.EXITED
    await rig.reconciler.sweep()
    assert rig.limit_on("GPU-dmem", LEAF_A) is None
    assert actions(rig, LEAF_A) == [
        ("set", GiB, 8 * GiB),
        ("set", 0, 8 * GiB),
        ("clear", 0, 2**64 - 1),
    ]
    assert soft(rig, "GPU-dmem", POD) == 2 * GiB  # B's reservation stays
    assert rig.record.get(LEAF_A) is None
    assert rig.record.get(LEAF_B) is not None
    assert rig.book.counts["cleared"] == 1


async def test_a_cgroup_gone_before_its_limits_were_cleared_has_its_leak_repaired(
    rig: LimitRig, cgroups: Hierarchy
) -> None:
    cgroups.remove(LEAF_A)
    rig.backend.partitions.forget_removed()  # the driver notices (the leak)
    assert soft(rig, "GPU-dmem", POD) == 3 * GiB
    await rig.reconciler.sweep()
    for ancestor in (POD, f"{ROOT}/kubepods/burstable", f"{ROOT}/kubepods", ROOT):
        assert soft(rig, "GPU-dmem", ancestor) == 2 * GiB, ancestor
    assert rig.record.get(LEAF_A) is None
    assert rig.book.counts["repaired"] == 1
    # misc: the driver dropped the limit with the cgroup; nothing to repair.
    cgroups.remove(LEAF_B)
    await rig.reconciler.sweep()
    for ancestor in (POD, ROOT):
        assert soft(rig, "GPU-dmem", ancestor) == 0
    assert rig.limits()["gpus"]["GPU-misc"]["limits"] == {}
    assert len(rig.record) == 0


class RecordingBackend:
    """A backend that records every set and can be made to fail clears."""

    def __init__(self, inner: PartitionBackend) -> None:
        self.inner = inner
        self.sets: list[str] = []
        self.fail_clears = False

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        return self.inner.memory_partitioning()

    def set_memory_limits(self, gpu_uuid: str, cgroup: str, soft: int, hard: int) -> None:
        self.sets.append(cgroup)
        self.inner.set_memory_limits(gpu_uuid, cgroup, soft, hard)

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        return self.inner.get_memory_limits(gpu_uuid, cgroup)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        if self.fail_clears:
            raise MemoryLimitError(f"GPU {gpu_uuid}, cgroup {cgroup}: the driver hung")
        return self.inner.clear_memory_limits(gpu_uuid, cgroup)


async def test_nothing_is_set_above_the_kubelets_pods(rig: LimitRig, cgroups: Hierarchy) -> None:
    # A reservation vgpu did not make, beside the pods: it must survive every repair.
    other = f"{ROOT}/system/other"
    cgroups.mkdir(other)
    rig.backend.set_memory_limits("GPU-dmem", other, GiB, 4 * GiB)
    recording = RecordingBackend(rig.backend)
    rig.book.backend = recording
    cgroups.remove(LEAF_A)
    await rig.reconciler.sweep()
    assert recording.sets == [POD]  # the nearest ancestor; the change propagated from there
    assert soft(rig, "GPU-dmem", POD) == 2 * GiB
    assert soft(rig, "GPU-dmem", ROOT) == 3 * GiB  # B's 2 GiB and the other 1 GiB
    assert soft(rig, "GPU-dmem", other) == GiB
    # Even when the level above the pods looks leaked from vgpu's record alone.
    cgroups.remove(LEAF_B)
    await rig.reconciler.sweep()
    assert all(s.startswith(f"{ROOT}/kubepods") for s in recording.sets)
    assert soft(rig, "GPU-dmem", ROOT) == GiB


async def test_a_clear_that_fails_is_tried_again(rig: LimitRig, cgroups: Hierarchy) -> None:
    recording = RecordingBackend(rig.backend)
    rig.book.backend = recording
    recording.fail_clears = True
    cgroups.set_populated(LEAF_A, False)
    await rig.reconciler.sweep()
    assert rig.record.get(LEAF_A) is not None
    assert rig.book.counts["failed"] == 1
    recording.fail_clears = False
    await rig.reconciler.sweep()
    assert rig.record.get(LEAF_A) is None
    assert rig.limit_on("GPU-dmem", LEAF_A) is None


async def test_a_daemon_killed_outright_leaves_nothing_behind_after_its_restart(
    rig: LimitRig, cgroups: Hierarchy
) -> None:
    third = f"{POD}/{'c' * 64}"
    cgroups.container(12, third)
    rig.source.grants["c"] = Grant(POD_UID, {"GPU-dmem": GpuLimit(GiB, 4 * GiB)})
    await rig.applier.apply(12, "c")
    # The daemon dies here; meanwhile A's container goes (its cgroup with it), B's pod gives up
    # its grant, C runs on.
    cgroups.remove(LEAF_A)
    rig.source.grants["b"].held = False
    await rig.restart()  # a new daemon: the record read back from the state directory
    assert {leaf.cgroup for leaf in rig.record} == {LEAF_A, LEAF_B, third}
    await rig.reconciler.reconcile_at_start()
    assert {leaf.cgroup for leaf in rig.record} == {third}
    assert rig.limit_on("GPU-dmem", LEAF_B) is None
    assert rig.limit_on("GPU-misc", LEAF_B) is None
    assert soft(rig, "GPU-dmem", third) == GiB
    for ancestor in (POD, ROOT):
        assert soft(rig, "GPU-dmem", ancestor) == GiB  # C's alone: A's leak repaired
    assert rig.book.counts["kept"] == 1
    assert rig.book.counts["cleared"] == 2  # B, on its two GPUs
    assert rig.book.counts["repaired"] == 1
