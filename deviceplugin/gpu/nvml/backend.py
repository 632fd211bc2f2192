"""NvmlBackend: the GpuBackend of the node's real GPUs, composed of one worker per GPU
(`workers`, `inventory`, `sampling`) and the health checks (`health`). The only module of the
package that imports pynvml, as the default of its `nvml` argument.

Driver and CUDA versions are logged at start and kept in `driver_version` and `cuda_version`.
What each GPU's driver can enforce of its memory is detected once its inventory is read
(`partitions`), and memory-limit calls run on the GPU's worker, bounded by `limit_timeout_s`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from deviceplugin.config import Config, HealthConfig
from deviceplugin.errors import BackendError
from deviceplugin.gpu.backend import no_wake
from deviceplugin.gpu.nvml.health import Health, HealthChecks
from deviceplugin.gpu.nvml.library import (
    INIT_HINT,
    NvmlLibrary,
    cuda_version_text,
    handle_key,
    text,
)
from deviceplugin.gpu.nvml.limits import MemoryLimitCalls
from deviceplugin.gpu.nvml.partitions import CgroupHost, NodeFacts, node_facts
from deviceplugin.gpu.nvml.sampling import Gpu, Sample
from deviceplugin.gpu.nvml.workers import GpuFaultError, TransientError
from deviceplugin.model import GpuReading, NodeReading
from deviceplugin.partitions import PartitionSupport

logger = logging.getLogger(__name__)

DEFAULT_PROCESS_LIST_INTERVAL_S = 0.5
DEFAULT_CALL_TIMEOUT_S = 0.5
DEFAULT_EVENT_WAIT_TIMEOUT_S = 1.0
DEFAULT_LIMIT_TIMEOUT_S = 5.0


class NvmlBackend(HealthChecks, MemoryLimitCalls):
    """The GpuBackend of the node's real GPUs. See the package docstring for threads and errors.

    `nvml` is the pynvml module; tests pass a driver model with the same functions. Every
    duration is in seconds; `clock` (monotonic) times hangs, process-list intervals and recovery.
    `cgroups` says where the unified hierarchy is and where the memory-partition probe may run
    (default: /sys/fs/cgroup, no probe: every GPU polled). Raises BackendError when NVML cannot
    start."""

    def __init__(
        self,
        health: HealthConfig,
        *,
        nvml: Any = pynvml,
        process_list_interval_s: float = DEFAULT_PROCESS_LIST_INTERVAL_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        event_wait_timeout_s: float = DEFAULT_EVENT_WAIT_TIMEOUT_S,
        sysfs_root: Path = Path("/sys"),
        clock: Callable[[], float] = time.monotonic,
        cgroups: CgroupHost | None = None,
        limit_timeout_s: float = DEFAULT_LIMIT_TIMEOUT_S,
    ) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be positive, got {call_timeout_s}")
        if not event_wait_timeout_s > 0:
            raise ValueError(f"event_wait_timeout_s must be positive, got {event_wait_timeout_s}")
        self._nvml = nvml
        self._lib = NvmlLibrary(nvml)
        self._health_config = health
        self._process_list_interval_s = process_list_interval_s
        self._call_timeout_s = call_timeout_s
        self._event_wait_timeout_s = event_wait_timeout_s
        self._sysfs_root = Path(sysfs_root)
        self._clock = clock
        self.nvml_error: type[Exception] = self._lib.nvml_error
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._health: dict[int, Health] = {}
        self._gpus: list[Gpu] = []
        self._by_handle: dict[object, Gpu] = {}
        self._event_set: object = None
        self._watcher: threading.Thread | None = None
        self._wake: Callable[[], None] = no_wake
        self.event_wait_errors = 0
        self.driver_version: str | None = None
        self.cuda_version: str | None = None
        self._cgroups = cgroups or CgroupHost()
        self._limit_timeout_s = limit_timeout_s
        self._node_facts = NodeFacts(None)
        self._partitioning: dict[str, PartitionSupport] = {}

        self._lib.init()
        try:
            self._start()
        except BaseException:
            self._stop.set()
            for gpu in self._gpus:
                gpu.stop()
            self._free_event_set()
            self._lib.shutdown()
            raise

    # -- start -----------------------------------------------------------------------------------

    def _start(self) -> None:
        nvml = self._nvml
        try:
            self.driver_version = text(nvml.nvmlSystemGetDriverVersion())
        except self.nvml_error as e:
            logger.warning("NVIDIA driver version unknown error=%s", self.describe_error(e))
        try:
            self.cuda_version = cuda_version_text(int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        except self.nvml_error as e:
            logger.warning("CUDA driver version unknown error=%s", self.describe_error(e))
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except self.nvml_error as e:
            raise BackendError(
                f"cannot start the nvml backend: nvmlDeviceGetCount failed with "
                f"{self.describe_error(e)}; {INIT_HINT}"
            ) from e
        self._node_facts = node_facts(nvml, self._cgroups, self.driver_version)
        for index in range(count):
            self._health[index] = Health()
            self._gpus.append(Gpu(self._lib, index, self._clock))
        if self._health_config.enabled:
            self._create_event_set()
        mask = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        futures = [gpu.submit(functools.partial(self._inventory, gpu, mask)) for gpu in self._gpus]
        concurrent.futures.wait(futures, timeout=self._health_config.hang_timeout_s)
        for gpu in self._gpus:
            if gpu.info is None and not gpu.idle:
                logger.warning(
                    "gpu inventory still running index=%d call=%s; the GPU joins when it answers",
                    gpu.index,
                    gpu.call_name,
                )
        if self._event_set is not None:
            self._watcher = threading.Thread(
                target=self._watch_events, name="nvml-events", daemon=True
            )
            self._watcher.start()
        config = self._health_config
        logger.info(
            "nvml backend started driver_version=%s cuda_version=%s gpus=%d ready=%d "
            "health_checks=%s ignored_xids=%s critical_xids=%s recovery=%s",
            self.driver_version,
            self.cuda_version,
            count,
            sum(1 for gpu in self._gpus if gpu.info is not None),
            "on" if config.enabled and self._event_set is not None else "off",
            ",".join(str(x) for x in (*config.ignored_xids, *config.additional_ignored_xids)),
            ",".join(str(x) for x in config.critical_xids) or "-",
            config.recovery.value,
        )
        if count == 0:
            logger.warning("NVML reports no GPUs on this node")

    def _create_event_set(self) -> None:
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except self.nvml_error as e:
            logger.warning(
                "Xid health checks unavailable: nvmlEventSetCreate failed with %s; GPU health "
                "comes from polling alone",
                self.describe_error(e),
            )

    def _inventory(self, gpu: Gpu, event_mask: int) -> None:
        """The worker's first job: the GPU's facts, then its event registration."""
        try:
            info = gpu.read_inventory(self._sysfs_root)
        except GpuFaultError as fault:
            logger.error(
                "gpu left out: its inventory cannot be read index=%d error=%s; "
                "restart the daemon once the GPU is fixed",
                gpu.index,
                fault,
            )
            return
        with self._lock:
            gpu.info = info
            self._by_handle[handle_key(gpu.handle)] = gpu
        logger.info(
            "gpu found index=%d uuid=%s name=%r memory_total_bytes=%d minor=%d pci_bus_id=%s "
            "numa_node=%s mig=%s",
            info.index,
            info.uuid,
            info.name,
            info.memory_total_bytes,
            info.minor,
            info.pci_bus_id,
            info.numa_node,
            "enabled" if info.mig_enabled else "disabled",
        )
        if self._event_set is not None:
            try:
                gpu.register_events(self._event_set, event_mask)
            except GpuFaultError as fault:
                self._mark_unhealthy(gpu, str(fault), self._clock(), error=True)
        self._detect_partitions(gpu)

    # -- the GpuBackend protocol -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return "nvml"

    def poll(self) -> NodeReading:
        if self._closed:
            raise BackendError("nvml backend: poll after close")
        futures = [
            gpu.submit(functools.partial(self._read, gpu))
            for gpu in self._gpus
            if gpu.info is not None and gpu.idle
        ]
        if futures:
            concurrent.futures.wait(futures, timeout=self._call_timeout_s)
        now = self._clock()
        readings: list[GpuReading] = []
        for gpu in self._gpus:
            info = gpu.info
            if info is None:
                continue
            sample = gpu.latest
            self._check_hang(gpu, now)
            self._check_recovery(gpu, sample, now)
            with self._lock:
                health = self._health[gpu.index]
                healthy, reason = health.healthy, health.reason
                transitions = health.unhealthy_transitions
                xids = tuple(sorted(health.xids.items()))
                mig_faults = self._mig_faults(health, now)
            readings.append(
                GpuReading(
                    info=info,
                    healthy=healthy,
                    health_reason=reason,
                    memory_used_bytes=sample.memory_used_bytes,
                    sm_util_percent=sample.sm_util_percent,
                    processes=sample.processes,
                    unhealthy_transitions=transitions,
                    xid_errors=xids,
                )
            )
            for device in sample.mig:
                fault = mig_faults.get(device.info.gpu_instance_id or 0, "")
                readings.append(
                    GpuReading(
                        info=device.info,
                        healthy=healthy and not fault,
                        health_reason=reason or fault,
                        memory_used_bytes=device.memory_used_bytes,
                        sm_util_percent=None,
                        processes=device.processes,
                    )
                )
        readings.sort(key=lambda r: r.info.index)
        return NodeReading(timestamp_s=now, gpus=tuple(readings))

    def set_wake(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        for gpu in self._gpus:
            gpu.stop()
        deadline = time.monotonic() + self._event_wait_timeout_s + 1.0
        stuck: list[str] = []
        if self._watcher is not None:
            self._watcher.join(timeout=max(0.0, deadline - time.monotonic()))
            if self._watcher.is_alive():
                stuck.append("nvmlEventSetWait")
            else:
                self._free_event_set()
        for gpu in self._gpus:
            gpu.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if gpu.thread.is_alive():
                stuck.append(f"{gpu.call_name or 'a call'} on GPU {gpu.index}")
        if stuck:
            logger.warning(
                "nvml backend closed without nvmlShutdown: NVML calls still running: %s; the "
                "process exit releases NVML",
                ", ".join(stuck),
            )
            return
        self._lib.shutdown()
        logger.info("nvml backend closed")

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- NVML errors -----------------------------------------------------------------------------

    def describe_error(self, error: Exception) -> str:
        """`NVML_ERROR_GPU_IS_LOST (GPU is lost)`."""
        return self._lib.describe_error(error)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, gpu: Gpu) -> None:
        """A poll's job on a GPU's worker: read it, and judge the GPU by how the read went."""
        try:
            gpu.latest = gpu.read(self._process_list_interval_s)
        except TransientError as e:
            logger.debug("gpu read incomplete %s error=%s; retried next poll", gpu.label(), e)
        except GpuFaultError as fault:
            self._fail_read(gpu, str(fault))
        except Exception as e:
            # Not an NVML error: a binding that does not match the driver, or a bug. The GPU
            # cannot be measured either way.
            logger.exception("gpu read failed unexpectedly %s", gpu.label())
            self._fail_read(gpu, f"unexpected error while reading the GPU: {e!r}")

    def _fail_read(self, gpu: Gpu, reason: str) -> None:
        """Keep the last good values, marked as a failed read, and take the GPU out of service."""
        previous = gpu.latest
        now = self._clock()
        gpu.latest = Sample(
            read_at_s=now,
            ok=False,
            memory_used_bytes=previous.memory_used_bytes,
            sm_util_percent=previous.sm_util_percent,
            processes=previous.processes,
        )
        self._mark_unhealthy(gpu, reason, now, error=True)

    # -- shutdown --------------------------------------------------------------------------------

    def _free_event_set(self) -> None:
        if self._event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except self.nvml_error as e:
            logger.warning("nvmlEventSetFree failed error=%s", self.describe_error(e))
        self._event_set = None


def open_nvml_backend(config: Config, cgroups: CgroupHost | None = None) -> NvmlBackend:
    """The nvml backend for a daemon with this config: its health section, and a call timeout of
    one poll interval, so that a hung GPU delays the others by at most one poll; `cgroups`: where
    memory partitions are probed (none: every GPU polled)."""
    return NvmlBackend(
        config.health, call_timeout_s=config.enforcement.poll_interval_s, cgroups=cgroups
    )
