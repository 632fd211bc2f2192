"""A model of the NVIDIA driver as pynvml shows it, so that the nvml backend runs in CI.

`NvmlModel` stands in for the `pynvml` module: pass it as `NvmlBackend(..., nvml=model)`. It has
the pynvml functions the backend calls, the NVML constants (copied from pynvml), and raises the
real `pynvml.NVMLError` subclasses (NVMLError_NotSupported, ...). It returns pynvml's own ctypes
structs where pynvml does (memory, utilisation, PCI info, process utilisation samples), and
objects with the same attributes elsewhere (process info, event data).

Faults are injected per function and GPU: `fail(name, code)` makes calls raise, `block(name)`
makes them wait until released, `hide(name)` removes a function as an older pynvml lacks it.
`calls` counts every call by (function, GPU index), for rate checks.

Memory partitions (R615): a ModelGpu's `memory_partitions` ("dmem", "misc" or None) and the
model's `cgroup_root` (a directory standing for /sys/fs/cgroup) drive nvmlDeviceSetMemoryLimits_v1
and nvmlDeviceGetMemoryLimits_v1, with the rules and error codes tests/support/nvml_partitions.py
describes.

MIG: a ModelGpu with `mig_enabled` has `mig_devices`, one per slot (None: an empty slot), reached
through nvmlDeviceGetMaxMigDeviceCount and nvmlDeviceGetMigDeviceHandleByIndex as in NVML. A MIG
device answers for its UUID, name, memory, processes, instance IDs and attributes; utilisation
calls answer NOT_SUPPORTED on a MIG device and on a GPU in MIG mode, as the driver does. Changing
`mig_devices` re-partitions the GPU (handles of removed devices then answer NOT_FOUND).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from deviceplugin.gpu.fake.partitionrules import PartitionRules
from tests.support.nvml_partitions import ModelPartitions

GiB = 1024**3
NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as the plain (v1) call reports it

_ERROR_CODES: dict[str, int] = {
    name: getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVML_ERROR_")
}


def nvml_error(code: int) -> pynvml.NVMLError:
    """The exception pynvml raises for `code`: pynvml.NVMLError(code) returns its subclass."""
    return pynvml.NVMLError(code)


@dataclass
class ModelProcess:
    """A process on a model GPU. `used_memory_bytes` None is memory the driver does not report:
    the versioned calls give None, the plain one NVML_VALUE_NOT_AVAILABLE (as pynvml does)."""

    pid: int
    used_memory_bytes: int | None = GiB
    compute: bool = True
    graphics: bool = False
    # An MPS client: the driver lists it only in the MPS process list (and the MPS server, a
    # process of its own, in the compute list).
    mps: bool = False


@dataclass
class ModelMigDevice:
    """A MIG device: a GPU instance with one compute instance. `memory_size_mb` is what
    nvmlDeviceGetAttributes reports (MiB), from which the profile name is derived."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    gpu_slices: int = 1
    compute_slices: int = 1
    memory_size_mb: int = 9728  # an A100-80GB 1g.10gb instance
    memory_used_bytes: int = 0
    name: str = "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    processes: list[ModelProcess] = field(default_factory=list)

    @property
    def memory_total_bytes(self) -> int:
        return self.memory_size_mb << 20


MIG_SLOTS = 7


@dataclass
class ModelGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total_bytes: int = 80 * GiB
    memory_used_bytes: int = 0
    gpu_util_percent: int = 0
    minor: int = 0
    pci_bus_id: str = "00000000:00:00.0"
    mig_enabled: bool = False
    mig_devices: list[ModelMigDevice | None] = field(default_factory=list)
    processes: list[ModelProcess] = field(default_factory=list)
    # (pid, timestamp in microseconds, smUtil, memUtil), in the driver's buffer.
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    supported_events: int = (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeSingleBitEccError
    )
    # The store of the driver's memory partitions on this GPU: "dmem", "misc", or None.
    memory_partitions: str | None = None


def model_gpus(count: int, *, processes: int = 0, first_pid: int = 1000) -> list[ModelGpu]:
    """`count` H100-like GPUs on distinct buses and NUMA-less slots, each with `processes`
    processes of 1 GiB."""
    return [
        ModelGpu(
            uuid=f"GPU-{index:08x}-0000-4000-8000-000000000000",
            minor=index,
            pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
            processes=[ModelProcess(first_pid + p) for p in range(processes)],
        )
        for index in range(count)
    ]


@dataclass(frozen=True, eq=False)
class ModelHandle:
    """A device handle, as nvmlDeviceGetHandleByIndex returns it: one object per GPU, compared
    by identity, as NVML hands out one pointer per device."""

    index: int


@dataclass(frozen=True, eq=False)
class ModelMigHandle:
    """A MIG device handle: its GPU's index and its slot there."""

    index: int
    slot: int


@dataclass(frozen=True)
class ModelEventData:
    """Shaped like pynvml's c_nvmlEventData_t."""

    device: object
    eventType: int  # noqa: N815 (pynvml's field names)
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


class Blocker:
    """Holds the calls it matches until `release()`; `entered` is set when one is held."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        self._released.wait()

    def release(self) -> None:
        self._released.set()


@dataclass
class _Failure:
    error: BaseException | int
    gpu: int | None
    times: int | None


class _EventSet:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[ModelEventData] = queue.SimpleQueue()
        self.masks: dict[int, int] = {}
        self.freed = False


class NvmlModel:
    """The driver model. Thread-safe: the backend calls it from several threads."""

    def __init__(
        self,
        gpus: Sequence[ModelGpu] = (),
        *,
        driver_version: str = "560.35.03",
        cuda_version: int = 12060,
        filter_samples: bool = True,
        bytes_strings: bool = False,
        cgroup_root: Path | None = None,
        root_user: bool = True,
    ) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "NVMLLibraryMismatch")):
                setattr(self, name, getattr(pynvml, name))
        self.c_nvmlSetMemoryLimits_v1_t = pynvml.c_nvmlSetMemoryLimits_v1_t
        self.c_nvmlGetMemoryLimits_v1_t = pynvml.c_nvmlGetMemoryLimits_v1_t
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        # False: the driver returns every buffered sample, however old (to test de-duplication).
        self.filter_samples = filter_samples
        # True: names, UUIDs and versions come back as bytes, as older pynvml releases return them.
        self.bytes_strings = bytes_strings
        self.initialised = 0
        self.init_count = 0
        self.shutdown_count = 0
        self.event_sets: list[_EventSet] = []
        self.calls: Counter[tuple[str, int | None]] = Counter()
        self._lock = threading.Lock()
        self._failures: dict[str, list[_Failure]] = {}
        self._blockers: dict[str, list[tuple[int | None, Blocker]]] = {}
        self._hidden: set[str] = set()
        self.handles = [ModelHandle(index) for index in range(len(self.gpus))]
        self.partition_model = ModelPartitions(cgroup_root, root_user)

    # -- faults ----------------------------------------------------------------------------------

    def fail(
        self,
        name: str,
        error: BaseException | int,
        *,
        gpu: int | None = None,
        times: int | None = None,
    ) -> None:
        """Make calls of `name` (on GPU `gpu`, or any) raise `error`: an NVML error code (raised as
        pynvml's NVMLError subclass) or an exception. `times`: only that many calls."""
        with self._lock:
            self._failures.setdefault(name, []).append(_Failure(error, gpu, times))

    def heal(self, name: str | None = None) -> None:
        """Remove the injected failures of `name`, or all of them."""
        with self._lock:
            if name is None:
                self._failures.clear()
            else:
                self._failures.pop(name, None)

    def block(self, name: str, *, gpu: int | None = None) -> Blocker:
        """Hold calls of `name` (on GPU `gpu`, or any) until the returned Blocker is released."""
        blocker = Blocker()
        with self._lock:
            self._blockers.setdefault(name, []).append((gpu, blocker))
        return blocker

    def unblock(self, blocker: Blocker) -> None:
        """Release `blocker` and let later calls through."""
        with self._lock:
            for entries in self._blockers.values():
                entries[:] = [entry for entry in entries if entry[1] is not blocker]
        blocker.release()

    def release_all(self) -> None:
        """Release every blocker (for a test's teardown, so that no thread stays held)."""
        with self._lock:
            blockers = [b for entries in self._blockers.values() for _, b in entries]
            self._blockers.clear()
        for blocker in blockers:
            blocker.release()

    @contextmanager
    def blocked(self, name: str, *, gpu: int | None = None) -> Iterator[Blocker]:
        """block() for a `with` block; the calls are released when it ends, however it ends."""
        blocker = self.block(name, gpu=gpu)
        try:
            yield blocker
        finally:
            self.unblock(blocker)

    def hide(self, name: str) -> None:
        """Remove function `name`, as an older pynvml does not have it."""
        self._hidden.add(name)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "_hidden"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _enter(self, name: str, handle: object = None, *, needs_init: bool = True) -> int | None:
        """Record a call; raise an injected or an UNINITIALIZED error; hold a blocked call."""
        gpu = self._index(handle) if handle is not None else None
        with self._lock:
            self.calls[(name, gpu)] += 1
            raised: BaseException | int | None = None
            for failure in self._failures.get(name, []):
                if failure.gpu is not None and failure.gpu != gpu:
                    continue
                if failure.times is not None:
                    if failure.times <= 0:
                        continue
                    failure.times -= 1
                raised = failure.error
                break
            blockers = [b for g, b in self._blockers.get(name, []) if g is None or g == gpu]
        if raised is not None:
            raise nvml_error(raised) if isinstance(raised, int) else raised
        for blocker in blockers:
            blocker.hold()
        if needs_init and not self.initialised:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        return gpu

    def _index(self, handle: object) -> int:
        if not isinstance(handle, ModelHandle | ModelMigHandle) or not 0 <= handle.index < len(
            self.gpus
        ):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.index

    def _gpu(self, name: str, handle: object) -> ModelGpu:
        """The GPU of a GPU handle; INVALID_ARGUMENT for a MIG device's handle."""
        index = self._enter(name, handle)
        assert index is not None
        if isinstance(handle, ModelMigHandle):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def _mig(self, name: str, handle: object) -> ModelMigDevice:
        """The MIG device of a MIG handle; NOT_FOUND once it is gone, NOT_SUPPORTED for a GPU."""
        index = self._enter(name, handle)
        assert index is not None
        if not isinstance(handle, ModelMigHandle):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        devices = self.gpus[index].mig_devices
        device = devices[handle.slot] if handle.slot < len(devices) else None
        if device is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return device

    def _device(self, name: str, handle: object) -> ModelGpu | ModelMigDevice:
        """A GPU or a MIG device, for the calls that both answer."""
        if isinstance(handle, ModelMigHandle):
            return self._mig(name, handle)
        return self._gpu(name, handle)

    def _no_mig_utilisation(self, name: str, handle: object) -> ModelGpu:
        """The GPU for a utilisation call: NOT_SUPPORTED on MIG devices and GPUs in MIG mode."""
        device = self._device(name, handle)
        if isinstance(device, ModelMigDevice) or device.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device

    # -- events ----------------------------------------------------------------------------------

    def emit(
        self,
        index: int,
        event_type: int,
        data: int = 0,
        *,
        device: object = None,
        gpu_instance_id: int = 0xFFFFFFFF,
    ) -> None:
        """Deliver an event from GPU `index` to every event set it is registered on for that type.
        `device` replaces the GPU's handle in the event data; `gpu_instance_id` names the GPU
        instance of a GPU in MIG mode that the event concerns."""
        event = ModelEventData(
            device=self.handles[index] if device is None else device,
            eventType=event_type,
            eventData=data,
            gpuInstanceId=gpu_instance_id,
            computeInstanceId=0 if gpu_instance_id != 0xFFFFFFFF else 0xFFFFFFFF,
        )
        for event_set in self.event_sets:
            if not event_set.freed and event_set.masks.get(index, 0) & event_type:
                event_set.queue.put(event)

    def emit_xid(self, index: int, xid: int, *, gpu_instance_id: int = 0xFFFFFFFF) -> None:
        self.emit(index, pynvml.nvmlEventTypeXidCriticalError, xid, gpu_instance_id=gpu_instance_id)

    def registered_events(self, index: int) -> int:
        """The event mask GPU `index` is registered for on the live event sets."""
        mask = 0
        for event_set in self.event_sets:
            if not event_set.freed:
                mask |= event_set.masks.get(index, 0)
        return mask

    # -- library ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        self._enter("nvmlInit", needs_init=False)
        with self._lock:
            self.initialised += 1
            self.init_count += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._enter("nvmlShutdown")
        with self._lock:
            self.initialised -= 1
            self.shutdown_count += 1

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.bytes_strings else value

    def nvmlSystemGetDriverVersion(self) -> str | bytes:  # noqa: N802
        self._enter("nvmlSystemGetDriverVersion")
        return self._string(self.driver_version)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:  # noqa: N802
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ModelHandle:  # noqa: N802
        if not 0 <= index < len(self.handles):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = self.handles[index]
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    # -- inventory -------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes:  # noqa: N802
        return self._string(self._device("nvmlDeviceGetUUID", handle).uuid)

    def nvmlDeviceGetName(self, handle: object) -> str | bytes:  # noqa: N802
        return self._string(self._device("nvmlDeviceGetName", handle).name)

    def nvmlDeviceGetMinorNumber(self, handle: object) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetMinorNumber", handle).minor

    def nvmlDeviceGetPciInfo(self, handle: object) -> pynvml.nvmlPciInfo_t:  # noqa: N802
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        domain, bus, rest = gpu.pci_bus_id.split(":")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id.encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:  # noqa: N802
        gpu = self._gpu("nvmlDeviceGetMigMode", handle)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    # -- memory partitions (R615) ---------------------------------------------------------------

    def _partitioned(self, name: str, handle: object) -> tuple[int, ModelGpu]:
        index = self._enter(name, handle)
        assert index is not None
        gpu = self.gpus[index]
        self.partition_model.check(
            self.driver_version, gpu, mig_handle=isinstance(handle, ModelMigHandle)
        )
        return index, gpu

    def nvmlDeviceSetMemoryLimits_v1(self, handle: object, limits: Any) -> None:  # noqa: N802
        index, gpu = self._partitioned("nvmlDeviceSetMemoryLimits_v1", handle)
        self.partition_model.set(index, gpu, limits)

    def nvmlDeviceGetMemoryLimits_v1(self, handle: object, limits: Any) -> None:  # noqa: N802
        index, gpu = self._partitioned("nvmlDeviceGetMemoryLimits_v1", handle)
        self.partition_model.get(index, gpu, limits)

    def partitions(self, index: int) -> PartitionRules:
        """GPU `index`'s partitions, as the driver holds them; what a CUDA process in a cgroup
        sees is their `mem_get_info` (cuMemGetInfo) and `charge` (cuMemAlloc)."""
        return self.partition_model.rules(index, self.gpus[index])

    # -- MIG -------------------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: object) -> int:  # noqa: N802
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", handle)
        return MIG_SLOTS if gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: object, slot: int) -> ModelMigHandle:  # noqa: N802
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not gpu.mig_enabled or not 0 <= slot < MIG_SLOTS:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if slot >= len(gpu.mig_devices) or gpu.mig_devices[slot] is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        assert isinstance(handle, ModelHandle)
        return ModelMigHandle(handle.index, slot)

    def nvmlDeviceGetGpuInstanceId(self, handle: object) -> int:  # noqa: N802
        return self._mig("nvmlDeviceGetGpuInstanceId", handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: object) -> int:  # noqa: N802
        return self._mig("nvmlDeviceGetComputeInstanceId", handle).compute_instance_id

    def nvmlDeviceGetAttributes(self, handle: object) -> pynvml.c_nvmlDeviceAttributes:  # noqa: N802
        device = self._mig("nvmlDeviceGetAttributes", handle)
        return pynvml.c_nvmlDeviceAttributes(
            gpuInstanceSliceCount=device.gpu_slices,
            computeInstanceSliceCount=device.compute_slices,
            memorySizeMB=device.memory_size_mb,
        )

    # -- usage -----------------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> pynvml.c_nvmlMemory_t:  # noqa: N802
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        return pynvml.c_nvmlMemory_t(
            total=gpu.memory_total_bytes,
            free=gpu.memory_total_bytes - gpu.memory_used_bytes,
            used=gpu.memory_used_bytes,
        )

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> pynvml.c_nvmlUtilization_t:  # noqa: N802
        gpu = self._no_mig_utilisation("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.gpu_util_percent, memory=0)

    def _processes(
        self, name: str, handle: object, *, graphics: bool, raw: bool, mps: bool = False
    ) -> list[Any]:
        gpu = self._device(name, handle)
        found: list[Any] = []
        for p in gpu.processes:
            if mps:
                if not p.mps:
                    continue
            elif p.mps or (p.graphics if graphics else p.compute) is False:
                continue
            used: int | None = p.used_memory_bytes
            if used is None and raw:
                used = NOT_AVAILABLE
            found.append(
                pynvml.nvmlFriendlyObject(
                    {
                        "pid": p.pid,
                        "usedGpuMemory": used,
                        "gpuInstanceId": 0xFFFFFFFF,
                        "computeInstanceId": 0xFFFFFFFF,
                    }
                )
            )
        return found

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetComputeRunningProcesses_v3"
        return self._processes(name, handle, graphics=False, raw=False)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetComputeRunningProcesses_v2"
        return self._processes(name, handle, graphics=False, raw=False)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetComputeRunningProcesses"
        return self._processes(name, handle, graphics=False, raw=True)

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetMPSComputeRunningProcesses_v3"
        return self._processes(name, handle, graphics=False, raw=False, mps=True)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetMPSComputeRunningProcesses_v2"
        return self._processes(name, handle, graphics=False, raw=False, mps=True)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetGraphicsRunningProcesses_v3"
        return self._processes(name, handle, graphics=True, raw=False)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetGraphicsRunningProcesses_v2"
        return self._processes(name, handle, graphics=True, raw=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: object) -> list[Any]:  # noqa: N802
        name = "nvmlDeviceGetGraphicsRunningProcesses"
        return self._processes(name, handle, graphics=True, raw=True)

    def nvmlDeviceGetProcessUtilization(  # noqa: N802
        self, handle: object, time_stamp: int
    ) -> list[pynvml.c_nvmlProcessUtilizationSample_t]:
        """The buffered samples newer than `time_stamp`; NOT_FOUND when there are none."""
        gpu = self._no_mig_utilisation("nvmlDeviceGetProcessUtilization", handle)
        with self._lock:
            samples = [s for s in gpu.samples if s[1] > time_stamp or not self.filter_samples]
        if not samples:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=pid, timeStamp=stamp, smUtil=sm, memUtil=mem, encUtil=0, decUtil=0
            )
            for pid, stamp, sm, mem in samples
        ]

    def add_samples(self, index: int, samples: Sequence[tuple[int, int, int, int]]) -> None:
        """Append (pid, timestamp_us, smUtil, memUtil) samples to GPU `index`'s buffer."""
        with self._lock:
            self.gpus[index].samples.extend(samples)

    # -- events ----------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:  # noqa: N802
        self._enter("nvmlEventSetCreate")
        event_set = _EventSet()
        with self._lock:
            self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlDeviceRegisterEvents(  # noqa: N802
        self, handle: object, event_types: int, event_set: _EventSet
    ) -> None:
        index = self._enter("nvmlDeviceRegisterEvents", handle)
        assert index is not None
        if event_types & ~self.gpus[index].supported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.masks[index] = event_set.masks.get(index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> ModelEventData:  # noqa: N802
        self._enter("nvmlEventSetWait_v2")
        try:
            return event_set.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int) -> ModelEventData:  # noqa: N802
        self._enter("nvmlEventSetWait")
        try:
            return event_set.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:  # noqa: N802
        self._enter("nvmlEventSetFree")
        event_set.freed = True
