"""The driver model's GPU memory partitions (R615): nvmlDeviceSetMemoryLimits_v1 and
nvmlDeviceGetMemoryLimits_v1 as the driver answers them; what a CUDA process in a cgroup would
see is the rules' `mem_get_info` (cuMemGetInfo) and `charge` (cuMemAlloc).

The rules are the product's own model of the driver (deviceplugin.gpu.fake.partitionrules, whose
docstring gives them), applied to a directory laid out like the unified hierarchy: `cgroup_root`
stands for `/sys/fs/cgroup`, a cgroup exists where its directory does, and it has dmem files
where its parent's `cgroup.subtree_control` names `dmem`. A call is refused, as the driver would:
- FUNCTION_NOT_FOUND on a driver older than 615 (the library lacks the symbol);
- NOT_SUPPORTED on a MIG device handle, a GPU in MIG mode, or one whose `memory_partitions` is
  None (no store);
- NO_PERMISSION for a Set when the model does not run as root (`root_user=False`);
- the rules' codes: NOT_FOUND for a cgroup outside `cgroup_root` or missing, or (dmem) without
  dmem files; NOT_SUPPORTED for the root; INVALID_ARGUMENT for soft above hard.
A removed directory is noticed at the next call: its entry is dropped (on dmem its ancestors keep
their share).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import pynvml

from deviceplugin.gpu.cgrouptree import DirectoryTree
from deviceplugin.gpu.fake.partitionrules import PartitionCodeError, PartitionRules, Store
from deviceplugin.partitions import driver_major


class PartitionedGpu(Protocol):
    """What the partition model reads of a model GPU."""

    memory_partitions: str | None
    mig_enabled: bool
    memory_total_bytes: int


class ModelPartitions:
    """The partitions of a driver model's GPUs. NvmlModel's two calls check the driver, the
    handle and the GPU (`check`), then hand over the cgroup."""

    def __init__(self, cgroup_root: Path | None, root_user: bool) -> None:
        self.cgroup_root = cgroup_root
        self.root_user = root_user
        self._lock = threading.Lock()
        self._rules: dict[int, PartitionRules] = {}
        self._gpus: dict[int, PartitionedGpu] = {}

    def check(self, driver_version: str, gpu: PartitionedGpu, mig_handle: bool) -> None:
        major = driver_major(driver_version)
        if major is None or major < 615:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if mig_handle or gpu.mig_enabled:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gpu.memory_partitions is None or self.cgroup_root is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def rules(self, index: int, gpu: PartitionedGpu) -> PartitionRules:
        """GPU `index`'s partitions (for tests to look into); removed cgroups forgotten."""
        self._gpus[index] = gpu
        rules = self._rules.get(index)
        if rules is None or rules.store != gpu.memory_partitions:
            assert self.cgroup_root is not None, "the model has no cgroup_root"
            assert gpu.memory_partitions in ("dmem", "misc"), "the GPU has no store"
            tree = DirectoryTree(self.cgroup_root, "subtree_control")
            store: Store = "dmem" if gpu.memory_partitions == "dmem" else "misc"
            rules = PartitionRules(store, tree, gpu.memory_total_bytes, time.time)
            self._rules[index] = rules
        rules.forget_removed()
        return rules

    def cgroup(self, name_space: bytes | None) -> str:
        """The cgroup a sysfs path names, from the hierarchy's root; NOT_FOUND outside it."""
        assert self.cgroup_root is not None
        path = os.fsdecode(name_space or b"")
        root = str(self.cgroup_root)
        if path == root:
            return "/"
        if not path.startswith(root + "/"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return path[len(root) :]

    def set(self, index: int, gpu: PartitionedGpu, limits: Any) -> None:
        with self._lock:
            rules = self.rules(index, gpu)
            cgroup = self.cgroup(limits.nameSpace)
            if not self.root_user:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
            try:
                rules.set(cgroup, int(limits.softLimit), int(limits.hardLimit))
            except PartitionCodeError as e:
                raise pynvml.NVMLError(e.code) from None

    def get(self, index: int, gpu: PartitionedGpu, limits: Any) -> None:
        with self._lock:
            rules = self.rules(index, gpu)
            try:
                soft, hard, used = rules.get(self.cgroup(limits.nameSpace))
            except PartitionCodeError as e:
                raise pynvml.NVMLError(e.code) from None
            limits.softLimit = soft
            limits.hardLimit = hard
            limits.currentUsed = used
