"""The memory-limit half of NvmlBackend (docs/design.md §15): what each GPU's driver can enforce
of its memory, detected on the GPU's worker once its inventory is read, and a cgroup's limits
set, read and cleared there, each call bounded by the backend's `limit_timeout_s`.

`MemoryLimitCalls` is a part of `NvmlBackend` (see `backend`), as `health.HealthChecks` is: the
backend derives from it and owns the state it reads (declared below), guarded by the backend's
lock. A GPU whose memory is polled is refused before any NVML call, with the reason detection
gave; an NVML error becomes a MemoryLimitError naming the GPU, the cgroup and the code.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.nvml.library import NvmlLibrary
from deviceplugin.gpu.nvml.partitions import CgroupHost, LimitCalls, NodeFacts, detect, node_facts
from deviceplugin.gpu.nvml.sampling import Gpu
from deviceplugin.partitions import (
    NVML_CODE_MEANINGS,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimits,
    PartitionSupport,
    PollCause,
    check_limit_values,
    clear_on,
    nvml_code_name,
    polled,
    read_back,
)

logger = logging.getLogger(__name__)


class MemoryLimitCalls:
    """Memory partitions of the backend's GPUs. Reads the backend's state: `_gpus`, `_lock`,
    `_closed`, `_lib`, `_nvml`, `nvml_error`, `driver_version`, `_cgroups`, `_node_facts`,
    `_partitioning`, `_limit_timeout_s`."""

    _gpus: list[Gpu]
    _lock: threading.Lock
    _closed: bool
    _lib: NvmlLibrary
    _nvml: Any
    nvml_error: type[Exception]
    driver_version: str | None
    _cgroups: CgroupHost
    _node_facts: NodeFacts
    _partitioning: dict[str, PartitionSupport]
    _limit_timeout_s: float

    def describe_error(self, error: Exception) -> str:
        raise NotImplementedError

    def _detect_partitions(self, gpu: Gpu) -> None:
        """On the GPU's worker: what its driver can enforce of its memory, logged."""
        info = gpu.info
        assert info is not None
        support = detect(self._lib, gpu.handle, info, self._cgroups, self._node_facts)
        with self._lock:
            before = self._partitioning.get(info.uuid)
            self._partitioning[info.uuid] = support
        if support != before:
            logger.info(
                "gpu memory enforcement index=%d uuid=%s mode=%s cause=%s reason=%r",
                info.index,
                info.uuid,
                support.mode.value,
                support.cause.value or "-",
                support.reason,
            )

    def redetect_memory_partitioning(self) -> None:
        """Detect again what each GPU can enforce (after a GPU or driver change), node facts
        included; waits at most the call timeout per GPU."""
        self._node_facts = node_facts(self._nvml, self._cgroups, self.driver_version)
        for gpu in self._gpus:
            if gpu.info is not None:
                self._on_worker(gpu, "detection", functools.partial(self._detect_partitions, gpu))

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        with self._lock:
            return dict(self._partitioning)

    def _limit_gpu(self, gpu_uuid: str, cgroup: str) -> Gpu:
        """The GPU to set a limit on; MemoryLimitError when it has none to take."""
        with self._lock:
            found = next((g for g in self._gpus if g.info and g.info.uuid == gpu_uuid), None)
            support = self._partitioning.get(gpu_uuid) or polled(
                PollCause.NO_PARTITIONS, "not a GPU whose memory partitions are known"
            )
        if found is None or self._closed:
            raise MemoryLimitError(f"no GPU {gpu_uuid} on this node; cgroup {cgroup}")
        if not support.enforced:
            code = (
                NVML_ERROR_FUNCTION_NOT_FOUND
                if support.cause in (PollCause.DRIVER_TOO_OLD, PollCause.FUNCTION_NOT_FOUND)
                else NVML_ERROR_NOT_SUPPORTED
            )
            raise MemoryLimitError(
                f"GPU {gpu_uuid}, cgroup {cgroup}: its memory is polled ({support.reason})",
                code,
                nvml_code_name(code),
            )
        return found

    def _on_worker(self, gpu: Gpu, what: str, call: Callable[[], Any]) -> Any:
        """Run `call` on the GPU's worker and return what it returns; its NVML error is raised
        here. MemoryLimitError when it does not answer within the limit timeout."""
        box: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                box.append((True, call()))
            except self.nvml_error as e:
                box.append((False, e))

        future = gpu.submit(job)
        try:
            future.result(timeout=self._limit_timeout_s)
        except TimeoutError:
            raise MemoryLimitError(
                f"GPU {gpu.uuid}: {what} did not answer within {self._limit_timeout_s:g}s "
                f"(the GPU's worker is busy in {gpu.call_name or 'a call'})"
            ) from None
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _limit_call(self, gpu_uuid: str, cgroup: str, what: str, call: Callable[..., Any]) -> Any:
        gpu = self._limit_gpu(gpu_uuid, cgroup)
        path = self._cgroups.path(cgroup)
        try:
            return self._on_worker(gpu, what, lambda: call(gpu.handle, path))
        except self.nvml_error as e:
            code = self._lib.code(e)
            meaning = NVML_CODE_MEANINGS.get(code, "")
            raise MemoryLimitError(
                f"GPU {gpu_uuid}, cgroup {cgroup}: {what} failed with "
                f"{self.describe_error(e)}{'; ' + meaning if meaning else ''}",
                code,
                self._lib.error_name(e),
            ) from e

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None:
        check_limit_values(soft_bytes, hard_bytes)
        calls = LimitCalls(self._lib)
        self._limit_call(
            gpu_uuid,
            cgroup,
            "nvmlDeviceSetMemoryLimits_v1",
            lambda handle, path: calls.set(handle, path, soft_bytes, hard_bytes),
        )

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        calls = LimitCalls(self._lib)
        try:
            soft, hard, used = self._limit_call(
                gpu_uuid, cgroup, "nvmlDeviceGetMemoryLimits_v1", calls.get
            )
        except MemoryLimitError as e:
            # No limit at that cgroup: dmem reads NOT_FOUND, misc NOT_SUPPORTED (no nearest).
            if (
                e.code in (NVML_ERROR_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED)
                and (self._cgroups.mount / cgroup.lstrip("/")).is_dir()
            ):
                return None
            raise
        return read_back(soft, hard, used)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        return clear_on(self, gpu_uuid, cgroup)
