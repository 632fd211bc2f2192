"""What the fake GPUs' driver lets each process allocate (docs/design.md §8, §15): a listed
process's `used_memory_bytes` is what it *asks* for; on a GPU whose driver partitions memory it
gets only what the hard limits of its cgroup (and the GPU's memory) leave, as a real process's
allocation past its limit fails with out-of-memory. The backend reports what it got; each ask cut
short is a `refused` event in the fake driver's file (`partitionstate`). A process's cgroup is the
unified line of its /proc/<pid>/cgroup (none readable: the root, which no limit bounds).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from deviceplugin.gpu.fake.partitionstate import FakePartitions
from deviceplugin.gpu.fake.state import FakeGpu

_MAX_CGROUP_FILE_BYTES = 64 << 10


def unified_cgroup(proc_root: Path, pid: int) -> str:
    """The process's cgroup on the unified hierarchy, "/" when it cannot be read."""
    try:
        with open(proc_root / str(pid) / "cgroup", "rb") as f:
            content = f.read(_MAX_CGROUP_FILE_BYTES).decode("ascii", "replace")
    except OSError:
        return "/"
    for line in content.splitlines():
        if line.startswith("0::/"):
            return line[3:]
    return "/"


class ProcessCharges:
    """Each fake GPU's processes as its driver charges them; the same capped GPU again while
    neither its processes nor the limits changed."""

    def __init__(self, partitions: FakePartitions, proc_root: Path) -> None:
        self._partitions = partitions
        self._proc_root = proc_root
        self._memo: dict[str, tuple[FakeGpu, int, FakeGpu]] = {}

    def apply(self, gpu: FakeGpu) -> FakeGpu:
        """`gpu` with each process's memory what the driver let it allocate."""
        if gpu.memory_partitions is None or gpu.mig_enabled or not gpu.processes:
            return gpu
        memo = self._memo.get(gpu.uuid)
        if memo is not None and memo[0] is gpu and memo[1] == self._partitions.generation:
            return memo[2]
        asked = [(p.pid, unified_cgroup(self._proc_root, p.pid), p.used_memory_bytes)
                 for p in gpu.processes]  # fmt: skip
        granted = self._partitions.allocate(gpu.uuid, asked)
        capped = gpu
        if granted is not None and any(
            granted[p.pid] != p.used_memory_bytes for p in gpu.processes
        ):
            capped = replace(
                gpu,
                processes=tuple(
                    replace(p, used_memory_bytes=granted[p.pid]) for p in gpu.processes
                ),
            )
        self._memo[gpu.uuid] = (gpu, self._partitions.generation, capped)
        return capped
