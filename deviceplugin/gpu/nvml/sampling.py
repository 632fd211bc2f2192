"""What a GPU is doing: the reading its worker takes at every poll.

Per poll and GPU: used memory, GPU utilisation, the compute and graphics processes with their
used memory (the newest call the driver offers: `_v3`, then `_v2`, then the plain one; a pid in
both lists is listed once; memory the driver does not report is None), and per-process SM
utilisation from nvmlDeviceGetProcessUtilization: the samples newer than the last timestamp seen
on that GPU, averaged per pid, so that each sample counts once.

Process lists hold a driver-wide lock for milliseconds, so they are fetched at most once per
`process_list_interval_s` per GPU (default 0.5 s: at most 4 calls per GPU per second); polls in
between reuse the last list.

MIG: a GPU in MIG mode is read as the GPU (its used memory; NVML has no utilisation for a GPU in
MIG mode) and, at every poll, its MIG devices: the handles nvmlDeviceGetMigDeviceHandleByIndex
gives over nvmlDeviceGetMaxMigDeviceCount slots (an empty slot answers NOT_FOUND), each with its
slot (its MIG index), facts (see `inventory`), memory and processes. A re-partitioning
(mig-parted) is thus seen at the next poll. NVML gives no utilisation samples per MIG device
(nvmlDeviceGetUtilizationRates and nvmlDeviceGetProcessUtilization answer NOT_SUPPORTED on MIG
devices), so MIG devices and their processes report none: None, never a guess.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deviceplugin.gpu.nvml.inventory import GpuInventory
from deviceplugin.gpu.nvml.library import NvmlLibrary, text
from deviceplugin.gpu.nvml.workers import TransientError
from deviceplugin.gpu.samples import SampleReuse
from deviceplugin.model import GpuInfo, ProcessSample

logger = logging.getLogger(__name__)

_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for an unsigned long long
# How long the last per-process SM figures stand when no sample period has ended since: longer
# than the driver's slowest sample period (1 s), so that a poll between two samples is not read
# as an idle GPU.
_SAMPLE_HOLD_S = 1.5
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


@dataclass(frozen=True, slots=True)
class MigSample:
    """One MIG device in a reading of its GPU: no utilisation, NVML has none per MIG device."""

    info: GpuInfo
    memory_used_bytes: int | None
    processes: tuple[ProcessSample, ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """One GPU's latest reading, published by its worker by reference."""

    read_at_s: float
    ok: bool
    memory_used_bytes: int | None = None
    sm_util_percent: float | None = None
    processes: tuple[ProcessSample, ...] = ()
    mig: tuple[MigSample, ...] = ()


NO_SAMPLE = Sample(read_at_s=-math.inf, ok=False)


class Gpu(GpuInventory):
    """One GPU: its worker thread and everything only that thread touches (the handle, the
    process list cache, the last sample timestamp, the measurements turned off)."""

    def __init__(self, lib: NvmlLibrary, index: int, clock: Callable[[], float]) -> None:
        self.latest = NO_SAMPLE
        self._process_calls = {kind: list(names) for kind, names in _PROCESS_CALLS.items()}
        self._processes: dict[int, int | None] = {}
        self._processes_at_s = -math.inf
        self._last_seen_ts = 0
        self._last_util: dict[int, float] | None = None
        self._last_util_at_s = 0.0
        self._samples = SampleReuse()
        super().__init__(lib, index, clock)

    def read(self, process_list_interval_s: float) -> Sample:
        """One reading. Raises GpuFaultError (the GPU is unhealthy) or TransientError (the next
        poll retries)."""
        try:
            return self._read(process_list_interval_s)
        finally:
            self._samples.next_poll()

    def _read(self, process_list_interval_s: float) -> Sample:
        now = self._clock()
        memory = self._optional("memory", "nvmlDeviceGetMemoryInfo", self.handle)
        if self.info is not None and self.info.mig_enabled:
            # Processes, memory and their use are read per MIG device; the GPU itself has no
            # utilisation in MIG mode.
            return Sample(
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
        return Sample(
            read_at_s=now,
            ok=True,
            memory_used_bytes=None if memory is None else int(memory.used),
            sm_util_percent=None if rates is None else float(rates.gpu),
            processes=tuple(
                self._samples.sample(pid, pid, used, (sm_by_pid or {}).get(pid, idle))
                for pid, used in self._processes.items()
            ),
        )

    def _read_mig_devices(self) -> tuple[MigSample, ...]:
        """Every MIG device of this GPU, as it is partitioned now."""
        count = self._optional("MIG devices", "nvmlDeviceGetMaxMigDeviceCount", self.handle)
        if count is None:
            return ()
        gone = (self._nvml.NVML_ERROR_NOT_FOUND, self._nvml.NVML_ERROR_INVALID_ARGUMENT)
        devices: list[MigSample] = []
        seen: set[str] = set()
        for slot in range(int(count)):
            try:
                handle = self.call("nvmlDeviceGetMigDeviceHandleByIndex", self.handle, slot)
                device = self._read_mig_device(handle, slot)
            except self._lib.nvml_error as e:
                if self._lib.code(e) in gone:
                    continue  # an empty slot, or a device destroyed while it was read
                raise self._fault("reading a MIG device", e) from e
            devices.append(device)
            seen.add(device.info.uuid)
        self._forget_mig_devices_but(seen)
        return tuple(devices)

    def _read_mig_device(self, handle: object, slot: int) -> MigSample:
        parent = self.info
        assert parent is not None
        uuid = text(self.call("nvmlDeviceGetUUID", handle))
        gi, ci, profile = self._mig_device_facts(handle, uuid)
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
            mig_index=slot,
        )
        processes = tuple(
            self._samples.sample((uuid, pid), pid, used, None)
            for pid, used in self._merged_processes(handle).items()
        )
        return MigSample(info, int(memory.used), processes)

    def _process_list(self, kind: str, handle: object = None) -> list[Any] | None:
        """One kind of process list through the newest call offered; None when turned off.
        `handle`: a MIG device's, else the GPU's."""
        if kind in self._disabled:
            return None
        candidates = self._process_calls[kind]
        lib = self._lib
        while candidates:
            name = candidates[0]
            if not hasattr(self._nvml, name):
                candidates.pop(0)
                continue
            try:
                result: list[Any] = self.call(name, self.handle if handle is None else handle)
            except lib.mismatch_errors as e:
                logger.debug(
                    "process list call not offered %s call=%s error=%r", self.label(), name, e
                )
                candidates.pop(0)
                continue
            except lib.nvml_error as e:
                code = lib.code(e)
                if code == self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    logger.debug("process list call not offered %s call=%s", self.label(), name)
                    candidates.pop(0)
                    continue
                if code == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                    self._disable(kind, f"{name}: {lib.describe_error(e)}")
                    return None
                if code == self._nvml.NVML_ERROR_INSUFFICIENT_SIZE:
                    raise TransientError(f"{name}: {lib.describe_error(e)}") from e
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
        lib = self._lib
        name = "nvmlDeviceGetProcessUtilization"
        try:
            samples = self.call(name, self.handle, self._last_seen_ts)
        except lib.nvml_error as e:
            code = lib.code(e)
            # NOT_FOUND: no sample since the timestamp. pynvml raises NVMLError(SUCCESS) when the
            # driver answers the size query with no samples at all.
            if code in (self._nvml.NVML_ERROR_NOT_FOUND, self._nvml.NVML_SUCCESS):
                samples = []
            elif lib.is_unsupported(e):
                self._disable(measurement, f"{name}: {lib.describe_error(e)}")
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
