"""The fake backend's memory-limit calls: the `PartitionBackend` half of the GpuBackend
protocol, answered from the state file's GPUs and the fake driver's partitions
(`partitionstate`), with the error codes a real driver gives (docs/design.md §15).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.fake.partitionrules import PartitionCodeError, Store
from deviceplugin.gpu.fake.partitionstate import FakePartitions
from deviceplugin.gpu.fake.state import FakeGpu, FakeState
from deviceplugin.partitions import (
    NVML_CODE_MEANINGS,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimits,
    PartitionMode,
    PartitionSupport,
    PollCause,
    check_limit_values,
    clear_on,
    nvml_code_name,
    read_back,
)

logger = logging.getLogger(__name__)


def stores(state: FakeState) -> list[tuple[str, Store | None, int]]:
    """(UUID, store or None, memory) of every GPU of the state: None where its driver does not
    partition its memory."""
    found: list[tuple[str, Store | None, int]] = []
    for gpu in state.gpus:
        mode = gpu.partition_support.mode
        store: Store | None = None
        if mode is PartitionMode.DMEM:
            store = "dmem"
        elif mode is PartitionMode.MISC:
            store = "misc"
        found.append((gpu.uuid, store, gpu.memory_total_bytes))
    return found


class FakeMemoryLimits:
    """Memory limits on the fake GPUs of `state()` (the backend's current state file)."""

    def __init__(self, partitions: FakePartitions, state: Callable[[], FakeState]) -> None:
        self._partitions = partitions
        self._state = state

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        return {gpu.uuid: gpu.partition_support for gpu in self._state().gpus}

    def _gpu(self, gpu_uuid: str, cgroup: str) -> FakeGpu:
        for gpu in self._state().gpus:
            if gpu.uuid == gpu_uuid:
                support = gpu.partition_support
                if support.enforced:
                    return gpu
                code = (
                    NVML_ERROR_FUNCTION_NOT_FOUND
                    if support.cause is PollCause.DRIVER_TOO_OLD
                    else NVML_ERROR_NOT_SUPPORTED
                )
                raise _error(gpu_uuid, cgroup, code, support.reason)
        raise MemoryLimitError(f"no GPU {gpu_uuid} on this node (fake state file); cgroup {cgroup}")

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None:
        check_limit_values(soft_bytes, hard_bytes)
        self._gpu(gpu_uuid, cgroup)
        try:
            self._partitions.set(gpu_uuid, cgroup, soft_bytes, hard_bytes)
        except PartitionCodeError as e:
            raise _error(gpu_uuid, cgroup, e.code, str(e)) from e
        logger.debug(
            "fake memory limits set gpu=%s cgroup=%s soft_bytes=%d hard_bytes=%d",
            gpu_uuid,
            cgroup,
            soft_bytes,
            hard_bytes,
        )

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        gpu = self._gpu(gpu_uuid, cgroup)
        try:
            soft, hard, used = self._partitions.get(gpu_uuid, cgroup)
        except PartitionCodeError as e:
            dmem = gpu.memory_partitions == "dmem"
            unset = NVML_ERROR_NOT_FOUND if dmem else NVML_ERROR_NOT_SUPPORTED
            if e.code == unset and self._partitions.tree.exists(cgroup):
                return None
            raise _error(gpu_uuid, cgroup, e.code, str(e)) from e
        return read_back(soft, hard, used)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        return clear_on(self, gpu_uuid, cgroup)


def _error(gpu_uuid: str, cgroup: str, code: int, why: str) -> MemoryLimitError:
    name = nvml_code_name(code)
    meaning = NVML_CODE_MEANINGS.get(code, "")
    return MemoryLimitError(
        f"GPU {gpu_uuid}, cgroup {cgroup}: {name} ({why}{'; ' + meaning if meaning else ''})",
        code,
        name,
    )
