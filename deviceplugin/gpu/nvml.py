"""The nvml GPU backend: the node's real GPUs, read through NVML (`import pynvml`, from the
nvidia-ml-py distribution). This is the only module that imports pynvml.

What it reads
- Inventory, once per GPU: UUID, index, name, total memory, minor number, PCI bus ID, MIG mode,
  and the NUMA node from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`; NVML's own
  nvmlDeviceGetNumaNodeId names the NUMA node a coherent GPU's memory forms, not the CPUs the GPU
  sits next to, which is what the kubelet's topology hint needs). Driver and CUDA versions are
  logged at start and kept in `driver_version` and `cuda_version`.
- Per poll and GPU: used memory, GPU utilisation, the compute and graphics processes with their
  used memory (the newest call the driver offers: `_v3`, then `_v2`, then the plain one; a pid in
  both lists is listed once; memory the driver does not report is None), and per-process SM
  utilisation from nvmlDeviceGetProcessUtilization: the samples newer than the last timestamp
  seen on that GPU, averaged per pid, so that each sample counts once.
- Process lists hold a driver-wide lock for milliseconds, so they are fetched at most once per
  `process_list_interval_s` per GPU (default 0.5 s: at most 4 calls per GPU per second); polls in
  between reuse the last list.

Threads
- One worker thread per GPU makes every NVML call on that GPU. `poll` asks each idle worker for a
  read and waits at most `call_timeout_s` for all of them together, then reports what it has: a
  worker that is late keeps its last reading, which is reported again, so one slow or hung GPU
  delays the others by at most one timeout, once. A worker whose current call has not returned for
  `HealthConfig.hang_timeout_s` (default 10 s) gets its GPU marked unhealthy, with the call named
  in the reason. Threads stuck in the driver cannot be interrupted; they are daemon threads.
- One watcher thread waits on an NVML event set (Xid and double-bit ECC events, where the GPU
  supports them) with a timeout, so that it can stop, and marks GPUs unhealthy on critical Xids.

Errors: every NVML error gets a log line and a decision.
- At start, a missing library or driver, or no permission, raises BackendError with one line that
  says what to check and that `--backend fake:PATH` runs without a GPU.
- NOT_SUPPORTED (or FUNCTION_NOT_FOUND) from a measurement turns that measurement off for that GPU,
  with one log line; it is reported as unknown (None) from then on.
- NOT_FOUND from nvmlDeviceGetProcessUtilization means "no new samples".
- INSUFFICIENT_SIZE from a process list (processes started between NVML's two calls) keeps the last
  list until the next poll.
- GPU_IS_LOST and any other error mark that GPU unhealthy; its last good reading is reported
  with healthy=False and the error in health_reason.

MIG: a GPU in MIG mode (read once, at start: switching MIG mode needs a GPU reset and a restart of
the daemon) is read as the GPU (its used memory; NVML has no utilisation for a GPU in MIG mode)
and, at every poll, its MIG devices: the handles nvmlDeviceGetMigDeviceHandleByIndex gives over
nvmlDeviceGetMaxMigDeviceCount slots (an empty slot answers NOT_FOUND), each with its UUID, GPU and
compute instance IDs, profile name (`mig_profile_name` of nvmlDeviceGetAttributes), memory and
processes. A re-partitioning (mig-parted) is thus seen at the next poll. NVML gives no utilisation
samples per MIG device (nvmlDeviceGetUtilizationRates and nvmlDeviceGetProcessUtilization answer
NOT_SUPPORTED on MIG devices), so MIG devices and their processes report none: None, never a
guess. An Xid event that names a GPU instance takes only that MIG device out of service; one that
names none (or a fault of the GPU itself) takes the GPU and all its MIG devices.

Health and the way back follow deviceplugin.config.HealthConfig and RecoveryPolicy: `manual`
keeps a GPU out of service until the daemon restarts, `auto` returns it once it has answered
correctly, with no new fault, for `recoveryDelay`. Per-GPU counters of Xids, health transitions,
errors and hangs are in `health_stats`, for the metrics.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from deviceplugin.config import Config, HealthConfig, RecoveryPolicy
from deviceplugin.errors import BackendError
from deviceplugin.model import GpuInfo, GpuReading, NodeReading, ProcessSample, mig_profile_name

logger = logging.getLogger(__name__)

DEFAULT_PROCESS_LIST_INTERVAL_S = 0.5
# The GPU/compute instance ID of an event that names none (NVML's 0xFFFFFFFF).
NO_INSTANCE = 0xFFFFFFFF
DEFAULT_CALL_TIMEOUT_S = 0.5
DEFAULT_EVENT_WAIT_TIMEOUT_S = 1.0
# After a failed event wait (other than a timeout), the watcher waits this long before the next.
EVENT_RETRY_S = 1.0

# The common Xids, from NVIDIA's Xid catalog, for log lines and health reasons.
XID_MEANINGS: Mapping[int, str] = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    69: "Graphics Engine class error",
    74: "NVLink Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# A double-bit ECC event is judged as the Xid the driver reports for it.
DOUBLE_BIT_ECC_XID = 48

_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for an unsigned long long
# How long the last per-process SM figures stand when no sample period has ended since: longer
# than the driver's slowest sample period (1 s), so that a poll between two samples is not read
# as an idle GPU.
_SAMPLE_HOLD_S = 1.5
_INIT_HINT = "use --backend fake:PATH to try vgpu without a GPU"
# What a failed nvmlInit means, by error name, for the one-line start-up error.
_INIT_PROBLEMS: Mapping[str, str] = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "the NVML library libnvidia-ml.so.1 was not found; is the NVIDIA driver installed on this"
        " node and mounted into this container?"
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the NVIDIA kernel driver is not loaded; is this a GPU node, and does nvidia-smi work?"
    ),
    "NVML_ERROR_NO_PERMISSION": (
        "no permission to open the GPUs' device nodes (/dev/nvidia*); give the container access"
        " to them"
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVML library and the loaded kernel driver are different versions; reload the driver"
        " or reboot the node"
    ),
}
_PROCESS_CALLS: Mapping[str, tuple[str, ...]] = {
    "compute processes": (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ),
    "graphics processes": (
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ),
    # Under MPS the clients, the containers' processes, are listed only here; the compute list
    # has the MPS server instead (a host process: unattributed).
    "mps client processes": (
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    ),
}
# In nvidia-ml-py 12 and later the unversioned list calls wrap _v3; they stay last in the chains
# above for older bindings, where they reach the driver's first version.


def xid_meaning(xid: int) -> str:
    """What an Xid means, for a log line; unknown ones point at NVIDIA's catalog."""
    return XID_MEANINGS.get(xid, "see NVIDIA's Xid catalog")


def numa_node_from_sysfs(sysfs_root: Path, pci_bus_id: str) -> int | None:
    """The NUMA node of a PCI device from sysfs, or None when the kernel does not know it.

    NVML writes bus IDs with an 8-digit domain (`00000000:17:00.0`); sysfs uses 4 digits, in lower
    case (`0000:17:00.0`). The kernel writes -1 when the device has no NUMA affinity."""
    bus_id = pci_bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and len(domain) == 8:
        # sysfs drops the leading zeros down to 4 digits: 00000000 -> 0000, 00010000 -> 10000.
        bus_id = f"{int(domain, 16):04x}:{rest}"
    path = sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        logger.debug("no NUMA node in sysfs path=%s", path)
        return None
    return node if node >= 0 else None


def _text(value: object) -> str:
    """pynvml returns str from most calls, bytes from ctypes fields and old bindings."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _handle_key(handle: object) -> object:
    """A hashable key for a device handle. NVML hands out one pointer per device, so a handle in
    an event compares equal to the one nvmlDeviceGetHandleByIndex gave, by address."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
    except (TypeError, ctypes.ArgumentError):
        return handle


def _cuda_version_text(version: int) -> str:
    """NVML's CUDA driver version number (12040) as text (12.4)."""
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True, slots=True)
class GpuHealthStats:
    """One GPU's health and its counters since start, for metrics and `vgpu status`.
    `xids` counts every Xid seen on the GPU, critical or ignored, by number."""

    uuid: str
    index: int
    healthy: bool
    reason: str
    xids: Mapping[int, int]
    critical_xids: int
    ignored_xids: int
    unhealthy_transitions: int
    recoveries: int
    nvml_errors: int
    hangs: int


@dataclass(frozen=True, slots=True)
class _MigSample:
    """One MIG device in a reading of its GPU: no utilisation, NVML has none per MIG device."""

    info: GpuInfo
    memory_used_bytes: int | None
    processes: tuple[ProcessSample, ...]


@dataclass(frozen=True, slots=True)
class _Sample:
    """One GPU's latest reading, published by its worker by reference."""

    read_at_s: float
    ok: bool
    memory_used_bytes: int | None = None
    sm_util_percent: float | None = None
    processes: tuple[ProcessSample, ...] = ()
    mig: tuple[_MigSample, ...] = ()


_NO_SAMPLE = _Sample(read_at_s=-math.inf, ok=False)


@dataclass(slots=True)
class _Health:
    """One GPU's health state and counters; guarded by the backend's lock."""

    healthy: bool = True
    reason: str = ""
    last_bad_s: float = -math.inf
    xids: Counter[int] = field(default_factory=Counter)
    critical_xids: int = 0
    ignored_xids: int = 0
    unhealthy_transitions: int = 0
    recoveries: int = 0
    nvml_errors: int = 0
    hangs: int = 0
    # The start time of the call whose hang was last reported, so that a hang is counted once.
    hang_reported_for: float | None = None
    # MIG devices out of service by a critical Xid naming their GPU instance: GPU instance ID ->
    # (reason, when).
    mig_faults: dict[int, tuple[str, float]] = field(default_factory=dict)


class _GpuFaultError(Exception):
    """An NVML call failed in a way that makes its GPU unhealthy."""


class _TransientError(Exception):
    """An NVML call failed in a way that the next poll retries (the last values are kept)."""


class _Gpu:
    """One GPU: its worker thread and everything only that thread touches (the handle, the
    process list cache, the last sample timestamp, the measurements turned off)."""

    def __init__(
        self, backend: NvmlBackend, index: int, nvml: Any, clock: Callable[[], float]
    ) -> None:
        self.index = index
        # Set by the backend once the inventory is complete; until then the GPU is not reported.
        self.info: GpuInfo | None = None
        self.uuid: str | None = None
        self.handle: Any = None
        self.latest = _NO_SAMPLE
        # The NVML call in progress on the worker, and when it began (for hang detection).
        self.call_name: str | None = None
        self.call_started_s = 0.0
        self._backend = backend
        self._nvml = nvml
        self._clock = clock
        self._disabled: set[str] = set()
        self._process_calls = {kind: list(names) for kind, names in _PROCESS_CALLS.items()}
        self._processes: dict[int, int | None] = {}
        self._processes_at_s = -math.inf
        self._last_seen_ts = 0
        self._last_util: dict[int, float] | None = None
        self._last_util_at_s = 0.0
        # MIG device facts that do not change while it exists, by UUID: (GI, CI, profile).
        self._mig_facts: dict[str, tuple[int, int, str]] = {}
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], None], concurrent.futures.Future[None]] | None
        ] = queue.SimpleQueue()
        self._future: concurrent.futures.Future[None] | None = None
        self.thread = threading.Thread(target=self._run, name=f"nvml-gpu{index}", daemon=True)
        self.thread.start()

    # -- the worker ---------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self._future is None or self._future.done()

    def submit(self, job: Callable[[], None]) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._future = future
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            future.set_running_or_notify_cancel()
            try:
                job()
            except Exception as e:
                logger.exception("nvml worker job failed index=%d", self.index)
                future.set_exception(e)
            else:
                future.set_result(None)

    # -- NVML calls (worker thread only) ------------------------------------------------------

    def call(self, name: str, *args: object) -> Any:
        function = getattr(self._nvml, name)
        self.call_started_s = self._clock()
        self.call_name = name
        try:
            return function(*args)
        finally:
            self.call_name = None

    def label(self) -> str:
        return f"index={self.index} uuid={self.uuid or '?'}"

    def _disable(self, measurement: str, why: str) -> None:
        """Turn a measurement off (callers check that it is on), with its one log line."""
        self._disabled.add(measurement)
        logger.warning(
            "gpu measurement turned off %s measurement=%r reason=%r; reported as unknown",
            self.label(),
            measurement,
            why,
        )

    def _fault(self, call: str, error: Exception) -> _GpuFaultError:
        return _GpuFaultError(f"{call} failed with {self._backend.describe_error(error)}")

    def _optional(self, measurement: str, name: str, *args: object) -> Any:
        """An NVML call whose NOT_SUPPORTED turns the measurement off: None then and after."""
        if measurement in self._disabled:
            return None
        try:
            return self.call(name, *args)
        except self._backend.nvml_error as e:
            if self._backend.is_unsupported(e):
                self._disable(measurement, f"{name}: {self._backend.describe_error(e)}")
                return None
            raise self._fault(name, e) from e

    def _required(self, name: str, *args: object) -> Any:
        try:
            return self.call(name, *args)
        except self._backend.nvml_error as e:
            raise self._fault(name, e) from e

    def read_inventory(self, sysfs_root: Path) -> GpuInfo:
        """The GPU's static facts. Raises _GpuFaultError when its identity cannot be read."""
        self.handle = self._required("nvmlDeviceGetHandleByIndex", self.index)
        uuid = _text(self._required("nvmlDeviceGetUUID", self.handle))
        self.uuid = uuid
        name = _text(self._required("nvmlDeviceGetName", self.handle))
        memory_total = int(self._required("nvmlDeviceGetMemoryInfo", self.handle).total)
        minor = self._optional("minor number", "nvmlDeviceGetMinorNumber", self.handle)
        if minor is None:
            logger.warning("gpu minor number unknown %s; using the index instead", self.label())
            minor = self.index
        pci = self._optional("PCI info", "nvmlDeviceGetPciInfo", self.handle)
        bus_id = _text(pci.busId) if pci is not None else None
        mig = self._optional("MIG mode", "nvmlDeviceGetMigMode", self.handle)
        mig_enabled = mig is not None and int(mig[0]) == self._nvml.NVML_DEVICE_MIG_ENABLE
        numa = numa_node_from_sysfs(sysfs_root, bus_id) if bus_id else None
        return GpuInfo(
            uuid=uuid,
            index=self.index,
            name=name,
            memory_total_bytes=memory_total,
            minor=int(minor),
            numa_node=numa,
            pci_bus_id=bus_id,
            mig_enabled=mig_enabled,
        )

    def register_events(self, event_set: object, mask: int) -> None:
        """Register this GPU's Xid and ECC events on the set, where it supports them."""
        supported = self._optional("events", "nvmlDeviceGetSupportedEventTypes", self.handle)
        wanted = mask & int(supported or 0)
        if not wanted:
            logger.warning(
                "gpu reports no Xid or ECC events %s; its health comes from polling alone",
                self.label(),
            )
            return
        try:
            self.call("nvmlDeviceRegisterEvents", self.handle, wanted, event_set)
        except self._backend.nvml_error as e:
            if self._backend.is_unsupported(e):
                self._disable("events", f"nvmlDeviceRegisterEvents: {e}")
                return
            raise self._fault("nvmlDeviceRegisterEvents", e) from e
        logger.debug("gpu events registered %s mask=%#x", self.label(), wanted)

    def read(self, process_list_interval_s: float) -> _Sample:
        """One reading. Raises _GpuFaultError (the GPU is unhealthy) or _TransientError (the next
        poll retries)."""
        now = self._clock()
        memory = self._optional("memory", "nvmlDeviceGetMemoryInfo", self.handle)
        if self.info is not None and self.info.mig_enabled:
            # Processes, memory and their use are read per MIG device; the GPU itself has no
            # utilisation in MIG mode.
            return _Sample(
                read_at_s=now,
                ok=True,
                memory_used_bytes=None if memory is None else int(memory.used),
                mig=self._read_mig_devices(),
            )
        rates = self._optional("utilisation", "nvmlDeviceGetUtilizationRates", self.handle)
        if now - self._processes_at_s >= process_list_interval_s:
            self._refresh_processes(now)
        sm_by_pid = self._process_sm_util(now)
        # With samples: a listed process that had none in their periods used nothing. Without
        # (none measured yet, or the measurement is off): unknown.
        idle = None if sm_by_pid is None else 0.0
        return _Sample(
            read_at_s=now,
            ok=True,
            memory_used_bytes=None if memory is None else int(memory.used),
            sm_util_percent=None if rates is None else float(rates.gpu),
            processes=tuple(
                ProcessSample(
                    pid=pid,
                    used_memory_bytes=used,
                    sm_util_percent=(sm_by_pid or {}).get(pid, idle),
                )
                for pid, used in self._processes.items()
            ),
        )

    def _read_mig_devices(self) -> tuple[_MigSample, ...]:
        """Every MIG device of this GPU, as it is partitioned now."""
        count = self._optional("MIG devices", "nvmlDeviceGetMaxMigDeviceCount", self.handle)
        if count is None:
            return ()
        gone = (self._nvml.NVML_ERROR_NOT_FOUND, self._nvml.NVML_ERROR_INVALID_ARGUMENT)
        devices: list[_MigSample] = []
        seen: set[str] = set()
        for slot in range(int(count)):
            try:
                handle = self.call("nvmlDeviceGetMigDeviceHandleByIndex", self.handle, slot)
                device = self._read_mig_device(handle)
            except self._backend.nvml_error as e:
                if self._backend.code(e) in gone:
                    continue  # an empty slot, or a device destroyed while it was read
                raise self._fault("reading a MIG device", e) from e
            devices.append(device)
            seen.add(device.info.uuid)
        self._mig_facts = {u: f for u, f in self._mig_facts.items() if u in seen}
        return tuple(devices)

    def _read_mig_device(self, handle: object) -> _MigSample:
        parent = self.info
        assert parent is not None
        uuid = _text(self.call("nvmlDeviceGetUUID", handle))
        facts = self._mig_facts.get(uuid)
        if facts is None:
            attributes = self.call("nvmlDeviceGetAttributes", handle)
            facts = (
                int(self.call("nvmlDeviceGetGpuInstanceId", handle)),
                int(self.call("nvmlDeviceGetComputeInstanceId", handle)),
                mig_profile_name(
                    int(attributes.gpuInstanceSliceCount),
                    int(attributes.computeInstanceSliceCount),
                    int(attributes.memorySizeMB),
                ),
            )
            self._mig_facts[uuid] = facts
            logger.info(
                "MIG device found %s mig_uuid=%s gpu_instance_id=%d compute_instance_id=%d "
                "profile=%s; NVML has no utilisation per MIG device: memory and processes only",
                self.label(),
                uuid,
                *facts,
            )
        gi, ci, profile = facts
        memory = self.call("nvmlDeviceGetMemoryInfo", handle)
        info = GpuInfo(
            uuid=uuid,
            index=parent.index,
            name=f"{parent.name} MIG {profile}",
            memory_total_bytes=int(memory.total),
            minor=parent.minor,
            numa_node=parent.numa_node,
            pci_bus_id=parent.pci_bus_id,
            parent_uuid=parent.uuid,
            mig_profile=profile,
            gpu_instance_id=gi,
            compute_instance_id=ci,
        )
        processes = tuple(
            ProcessSample(pid=pid, used_memory_bytes=used, sm_util_percent=None)
            for pid, used in self._merged_processes(handle).items()
        )
        return _MigSample(info, int(memory.used), processes)

    def _process_list(self, kind: str, handle: object = None) -> list[Any] | None:
        """One kind of process list through the newest call offered; None when turned off.
        `handle`: a MIG device's, else the GPU's."""
        if kind in self._disabled:
            return None
        candidates = self._process_calls[kind]
        backend = self._backend
        while candidates:
            name = candidates[0]
            if not hasattr(self._nvml, name):
                candidates.pop(0)
                continue
            try:
                result: list[Any] = self.call(name, self.handle if handle is None else handle)
            except backend.mismatch_errors as e:
                logger.debug(
                    "process list call not offered %s call=%s error=%r", self.label(), name, e
                )
                candidates.pop(0)
                continue
            except backend.nvml_error as e:
                code = backend.code(e)
                if code == self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    logger.debug("process list call not offered %s call=%s", self.label(), name)
                    candidates.pop(0)
                    continue
                if code == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                    self._disable(kind, f"{name}: {backend.describe_error(e)}")
                    return None
                if code == self._nvml.NVML_ERROR_INSUFFICIENT_SIZE:
                    raise _TransientError(f"{name}: {backend.describe_error(e)}") from e
                raise self._fault(name, e) from e
            return result
        self._disable(kind, "the driver offers none of " + ", ".join(_PROCESS_CALLS[kind]))
        return None

    def _refresh_processes(self, now: float) -> None:
        self._processes = self._merged_processes(self.handle)
        self._processes_at_s = now

    def _merged_processes(self, handle: object) -> dict[int, int | None]:
        """Every kind of process list of a GPU or MIG device, each pid once."""
        merged: dict[int, int | None] = {}
        for kind in _PROCESS_CALLS:
            for process in self._process_list(kind, handle) or ():
                pid = int(process.pid)
                if pid <= 0:
                    continue
                used = self._used_memory(process)
                before = merged.get(pid)
                if pid not in merged or before is None:
                    merged[pid] = used
                elif used is not None:
                    merged[pid] = max(before, used)
        return merged

    def _used_memory(self, process: Any) -> int | None:
        """usedGpuMemory, or None where the driver does not report it (None, or
        NVML_VALUE_NOT_AVAILABLE from old bindings) or reports more than the GPU holds, which is
        a binding that does not match the driver's struct layout."""
        raw = getattr(process, "usedGpuMemory", None)
        if raw is None or int(raw) >= _NOT_AVAILABLE:
            return None
        used = int(raw)
        total = self.info.memory_total_bytes if self.info is not None else 0
        if used < 0 or (total and used > total):
            logger.debug(
                "implausible process memory %s pid=%s used=%d", self.label(), process.pid, used
            )
            return None
        return used

    def _process_sm_util(self, now: float) -> dict[int, float] | None:
        """SM utilisation per pid, averaged over the driver's sample periods since the last call;
        None when nothing has been measured (yet).

        The driver returns a sample only for a process that used the GPU in a sample period, so
        a process's total is divided by the number of periods in the batch (the distinct
        timestamps on this GPU): a period it sat out, stopped or idle, counts as 0. The driver
        samples every 1/6 to 1 s, which can be longer than a poll: when no period has ended since
        the last call, the last figures stand for up to `_SAMPLE_HOLD_S`, rather than reading as
        an idle GPU."""
        measurement = "process utilisation"
        if measurement in self._disabled:
            return None
        backend = self._backend
        name = "nvmlDeviceGetProcessUtilization"
        try:
            samples = self.call(name, self.handle, self._last_seen_ts)
        except backend.nvml_error as e:
            code = backend.code(e)
            # NOT_FOUND: no sample since the timestamp. pynvml raises NVMLError(SUCCESS) when the
            # driver answers the size query with no samples at all.
            if code in (self._nvml.NVML_ERROR_NOT_FOUND, self._nvml.NVML_SUCCESS):
                samples = []
            elif backend.is_unsupported(e):
                self._disable(measurement, f"{name}: {backend.describe_error(e)}")
                return None
            else:
                raise self._fault(name, e) from e
        totals: dict[int, float] = {}
        periods: set[int] = set()
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp <= self._last_seen_ts:
                continue
            periods.add(stamp)
            pid = int(sample.pid)
            totals[pid] = totals.get(pid, 0.0) + min(100.0, max(0.0, float(sample.smUtil)))
        if not periods:
            if self._last_util is not None and now - self._last_util_at_s <= _SAMPLE_HOLD_S:
                return self._last_util
            return None if self._last_util is None else {}
        self._last_seen_ts = max(periods)
        self._last_util = {pid: total / len(periods) for pid, total in totals.items()}
        self._last_util_at_s = now
        return self._last_util


class NvmlBackend:
    """The GpuBackend of the node's real GPUs. See the module docstring for threads and errors.

    `nvml` is the pynvml module; tests pass a driver model with the same functions. Every
    duration is in seconds; `clock` (monotonic) times hangs, process-list intervals and recovery.
    Raises BackendError when NVML cannot start."""

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
    ) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be positive, got {call_timeout_s}")
        if not event_wait_timeout_s > 0:
            raise ValueError(f"event_wait_timeout_s must be positive, got {event_wait_timeout_s}")
        self._nvml = nvml
        self._health_config = health
        self._process_list_interval_s = process_list_interval_s
        self._call_timeout_s = call_timeout_s
        self._event_wait_timeout_s = event_wait_timeout_s
        self._sysfs_root = Path(sysfs_root)
        self._clock = clock
        self.nvml_error: type[Exception] = nvml.NVMLError
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self.mismatch_errors: tuple[type[Exception], ...] = (mismatch,) if mismatch else ()
        self._error_names = {getattr(nvml, n): n for n in dir(nvml) if n.startswith("NVML_ERROR_")}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._health: dict[int, _Health] = {}
        self._gpus: list[_Gpu] = []
        self._by_handle: dict[object, _Gpu] = {}
        self._event_set: object = None
        self._watcher: threading.Thread | None = None
        self.event_wait_errors = 0
        self.driver_version: str | None = None
        self.cuda_version: str | None = None

        self._init()
        try:
            self._start()
        except BaseException:
            self._stop.set()
            for gpu in self._gpus:
                gpu.stop()
            self._free_event_set()
            self._shutdown()
            raise

    # -- start -----------------------------------------------------------------------------------

    def _init(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self.nvml_error as e:
            name = self.error_name(e)
            problem = _INIT_PROBLEMS.get(name, f"NVML could not start ({e})")
            raise BackendError(
                f"cannot start the nvml backend: {problem} [{name}]; {_INIT_HINT}"
            ) from e

    def _start(self) -> None:
        nvml = self._nvml
        try:
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except self.nvml_error as e:
            logger.warning("NVIDIA driver version unknown error=%s", self.describe_error(e))
        try:
            self.cuda_version = _cuda_version_text(int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        except self.nvml_error as e:
            logger.warning("CUDA driver version unknown error=%s", self.describe_error(e))
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except self.nvml_error as e:
            raise BackendError(
                f"cannot start the nvml backend: nvmlDeviceGetCount failed with "
                f"{self.describe_error(e)}; {_INIT_HINT}"
            ) from e
        for index in range(count):
            self._health[index] = _Health()
            self._gpus.append(_Gpu(self, index, nvml, self._clock))
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

    def _inventory(self, gpu: _Gpu, event_mask: int) -> None:
        """The worker's first job: the GPU's facts, then its event registration."""
        try:
            info = gpu.read_inventory(self._sysfs_root)
        except _GpuFaultError as fault:
            logger.error(
                "gpu left out: its inventory cannot be read index=%d error=%s; "
                "restart the daemon once the GPU is fixed",
                gpu.index,
                fault,
            )
            return
        with self._lock:
            gpu.info = info
            self._by_handle[_handle_key(gpu.handle)] = gpu
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
            except _GpuFaultError as fault:
                self._mark_unhealthy(gpu, str(fault), self._clock(), error=True)

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
        self._shutdown()
        logger.info("nvml backend closed")

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def health_stats(self) -> tuple[GpuHealthStats, ...]:
        """Every known GPU's health and counters, in index order."""
        stats: list[GpuHealthStats] = []
        with self._lock:
            for gpu in self._gpus:
                if gpu.info is None:
                    continue
                h = self._health[gpu.index]
                stats.append(
                    GpuHealthStats(
                        uuid=gpu.info.uuid,
                        index=gpu.index,
                        healthy=h.healthy,
                        reason=h.reason,
                        xids=dict(h.xids),
                        critical_xids=h.critical_xids,
                        ignored_xids=h.ignored_xids,
                        unhealthy_transitions=h.unhealthy_transitions,
                        recoveries=h.recoveries,
                        nvml_errors=h.nvml_errors,
                        hangs=h.hangs,
                    )
                )
        return tuple(stats)

    # -- NVML errors -----------------------------------------------------------------------------

    def code(self, error: Exception) -> int:
        value = getattr(error, "value", None)
        return value if isinstance(value, int) else -1

    def error_name(self, error: Exception) -> str:
        return self._error_names.get(self.code(error), f"NVML error {self.code(error)}")

    def describe_error(self, error: Exception) -> str:
        """`NVML_ERROR_GPU_IS_LOST (GPU is lost)`."""
        return f"{self.error_name(error)} ({error})"

    def is_unsupported(self, error: Exception) -> bool:
        return self.code(error) in (
            self._nvml.NVML_ERROR_NOT_SUPPORTED,
            self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        )

    # -- reading and health ----------------------------------------------------------------------

    def _read(self, gpu: _Gpu) -> None:
        """A poll's job on a GPU's worker: read it, and judge the GPU by how the read went."""
        try:
            gpu.latest = gpu.read(self._process_list_interval_s)
        except _TransientError as e:
            logger.debug("gpu read incomplete %s error=%s; retried next poll", gpu.label(), e)
        except _GpuFaultError as fault:
            self._fail_read(gpu, str(fault))
        except Exception as e:
            # Not an NVML error: a binding that does not match the driver, or a bug. The GPU
            # cannot be measured either way.
            logger.exception("gpu read failed unexpectedly %s", gpu.label())
            self._fail_read(gpu, f"unexpected error while reading the GPU: {e!r}")

    def _fail_read(self, gpu: _Gpu, reason: str) -> None:
        """Keep the last good values, marked as a failed read, and take the GPU out of service."""
        previous = gpu.latest
        now = self._clock()
        gpu.latest = _Sample(
            read_at_s=now,
            ok=False,
            memory_used_bytes=previous.memory_used_bytes,
            sm_util_percent=previous.sm_util_percent,
            processes=previous.processes,
        )
        self._mark_unhealthy(gpu, reason, now, error=True)

    def _mark_unhealthy(
        self, gpu: _Gpu, reason: str, now: float, *, error: bool = False, hang: bool = False
    ) -> None:
        with self._lock:
            health = self._health[gpu.index]
            health.last_bad_s = max(health.last_bad_s, now)
            health.nvml_errors += error
            health.hangs += hang
            if not health.healthy:
                if error or hang:
                    logger.debug("gpu still failing %s reason=%r", gpu.label(), reason)
                return
            health.healthy = False
            health.reason = reason
            health.unhealthy_transitions += 1
        recovery = self._health_config.recovery
        then = (
            "it stays out of service until the daemon restarts"
            if recovery is RecoveryPolicy.MANUAL
            else "it returns once it has answered correctly, with no new fault, for "
            f"{self._health_config.recovery_delay_s:g}s"
        )
        logger.warning(
            "gpu unhealthy %s reason=%r recovery=%s; %s",
            gpu.label(),
            reason,
            recovery.value,
            then,
        )

    def _mig_faults(self, health: _Health, now: float) -> dict[int, str]:
        """The MIG devices a critical Xid took out of service, by GPU instance ID (caller holds
        the lock). With `auto` recovery, one whose last fault is `recoveryDelay` old returns."""
        config = self._health_config
        if config.recovery is RecoveryPolicy.AUTO:
            for gi, (reason, at_s) in list(health.mig_faults.items()):
                if now - at_s >= config.recovery_delay_s:
                    del health.mig_faults[gi]
                    logger.info(
                        "MIG device returned to service gpu_instance_id=%d after=%r", gi, reason
                    )
        return {gi: reason for gi, (reason, _) in health.mig_faults.items()}

    def _check_hang(self, gpu: _Gpu, now: float) -> None:
        name, started = gpu.call_name, gpu.call_started_s
        if name is None:
            return
        stuck_s = now - started
        if stuck_s < self._health_config.hang_timeout_s:
            return
        with self._lock:
            health = self._health[gpu.index]
            first = health.hang_reported_for != started
            health.hang_reported_for = started
        reason = f"NVML call {name} has not returned for {stuck_s:.1f}s (hung)"
        if first:
            logger.warning(
                "nvml call hung %s call=%s stuck_s=%.1f; the last reading is reported",
                gpu.label(),
                name,
                stuck_s,
            )
        self._mark_unhealthy(gpu, reason, now, hang=first)

    def _check_recovery(self, gpu: _Gpu, sample: _Sample, now: float) -> None:
        config = self._health_config
        if config.recovery is not RecoveryPolicy.AUTO:
            return
        with self._lock:
            health = self._health[gpu.index]
            if health.healthy or not sample.ok or gpu.call_name is not None:
                return
            if sample.read_at_s <= health.last_bad_s:
                return
            if now - health.last_bad_s < config.recovery_delay_s:
                return
            reason = health.reason
            health.healthy = True
            health.reason = ""
            health.recoveries += 1
        logger.info(
            "gpu returned to service %s after=%r quiet_s=%.1f",
            gpu.label(),
            reason,
            now - health.last_bad_s,
        )

    # -- events ----------------------------------------------------------------------------------

    def _watch_events(self) -> None:
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        timeout_ms = max(1, round(self._event_wait_timeout_s * 1000))
        while not self._stop.is_set():
            try:
                self._on_event(wait(self._event_set, timeout_ms))
            except self.nvml_error as e:
                if self.code(e) == nvml.NVML_ERROR_TIMEOUT:
                    continue
                self._event_wait_failed(self.describe_error(e))
            except Exception as e:
                logger.exception("NVML event handling failed")
                self._event_wait_failed(repr(e))

    def _event_wait_failed(self, error: str) -> None:
        self.event_wait_errors += 1
        if self.event_wait_errors == 1 or self.event_wait_errors % 100 == 0:
            logger.warning(
                "waiting for NVML events failed error=%s count=%d; Xids are missed until it works "
                "again, lost GPUs are still found by polling",
                error,
                self.event_wait_errors,
            )
        self._stop.wait(EVENT_RETRY_S)

    def _gpu_of_event(self, device: object) -> _Gpu | None:
        with self._lock:
            gpu = self._by_handle.get(_handle_key(device))
        if gpu is not None:
            return gpu
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(device))
        except self.nvml_error as e:
            logger.warning(
                "NVML event for a device of unknown UUID error=%s", self.describe_error(e)
            )
            return None
        for candidate in self._gpus:
            if candidate.info is not None and candidate.info.uuid == uuid:
                return candidate
        logger.info("NVML event for a GPU this daemon does not serve uuid=%s", uuid)
        return None

    def _on_event(self, data: Any) -> None:
        gpu = self._gpu_of_event(data.device)
        if gpu is None:
            return
        event_type = int(data.eventType)
        instance = int(getattr(data, "gpuInstanceId", NO_INSTANCE))
        if gpu.info is None or not gpu.info.mig_enabled:
            instance = NO_INSTANCE
        if event_type & self._nvml.nvmlEventTypeXidCriticalError:
            self._on_xid(gpu, int(data.eventData), "Xid", gpu_instance=instance)
        elif event_type & self._nvml.nvmlEventTypeDoubleBitEccError:
            # The driver reports the same fault as Xid 48 too: act on it, count it once.
            self._on_xid(gpu, DOUBLE_BIT_ECC_XID, "double-bit ECC event", count=False)
        else:
            logger.debug("NVML event ignored %s type=%#x", gpu.label(), event_type)

    def _on_xid(
        self,
        gpu: _Gpu,
        xid: int,
        source: str,
        *,
        count: bool = True,
        gpu_instance: int = NO_INSTANCE,
    ) -> None:
        now = self._clock()
        meaning = xid_meaning(xid)
        critical = self._health_config.is_critical(xid)
        with self._lock:
            health = self._health[gpu.index]
            if count:
                health.xids[xid] += 1
                if critical:
                    health.critical_xids += 1
                else:
                    health.ignored_xids += 1
        if not critical:
            logger.info(
                "Xid ignored %s xid=%d meaning=%r source=%s; an application error, the GPU stays "
                "in service",
                gpu.label(),
                xid,
                meaning,
                source,
            )
            return
        if gpu_instance != NO_INSTANCE:
            # The fault is in one GPU instance: only its MIG device goes out of service.
            reason = f"Xid {xid} ({meaning}) in GPU instance {gpu_instance}"
            with self._lock:
                self._health[gpu.index].mig_faults[gpu_instance] = (reason, now)
            logger.warning(
                "critical Xid on a MIG device %s gpu_instance_id=%d xid=%d meaning=%r source=%s",
                gpu.label(),
                gpu_instance,
                xid,
                meaning,
                source,
            )
            return
        logger.warning(
            "critical Xid %s xid=%d meaning=%r source=%s", gpu.label(), xid, meaning, source
        )
        self._mark_unhealthy(gpu, f"Xid {xid} ({meaning})", now)

    # -- shutdown --------------------------------------------------------------------------------

    def _free_event_set(self) -> None:
        if self._event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except self.nvml_error as e:
            logger.warning("nvmlEventSetFree failed error=%s", self.describe_error(e))
        self._event_set = None

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self.nvml_error as e:
            logger.warning("nvmlShutdown failed error=%s", self.describe_error(e))


def open_nvml_backend(config: Config) -> NvmlBackend:
    """The nvml backend for a daemon with this config: its health section, and a call timeout of
    one poll interval, so that a hung GPU delays the others by at most one poll."""
    return NvmlBackend(config.health, call_timeout_s=config.enforcement.poll_interval_s)
