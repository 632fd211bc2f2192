"""GPU health: the Xid and ECC event watcher, hung calls, and the way back.

One watcher thread waits on an NVML event set (Xid and double-bit ECC events, where the GPU
supports them) with a timeout, so that it can stop, and marks GPUs unhealthy on critical Xids. An
Xid event that names a GPU instance takes only that MIG device out of service; one that names
none (or a fault of the GPU itself) takes the GPU and all its MIG devices. A worker whose current
call has not returned for `HealthConfig.hang_timeout_s` (default 10 s) gets its GPU marked
unhealthy, with the call named in the reason.

Health and the way back follow deviceplugin.config.HealthConfig and RecoveryPolicy: `manual`
keeps a GPU out of service until the daemon restarts, `auto` returns it once it has answered
correctly, with no new fault, for `recoveryDelay`. Per-GPU counters of Xids, health transitions,
errors and hangs are in `health_stats`, for the metrics.

`HealthChecks` is the part of `NvmlBackend` (see `backend`) that judges health; the backend
derives from it and owns the state it reads (declared below), guarded by the backend's lock.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deviceplugin.config import HealthConfig, RecoveryPolicy
from deviceplugin.gpu.nvml.library import NvmlLibrary, handle_key, text
from deviceplugin.gpu.nvml.sampling import Gpu, Sample

logger = logging.getLogger(__name__)

# The GPU/compute instance ID of an event that names none (NVML's 0xFFFFFFFF).
NO_INSTANCE = 0xFFFFFFFF
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


def xid_meaning(xid: int) -> str:
    """What an Xid means, for a log line; unknown ones point at NVIDIA's catalog."""
    return XID_MEANINGS.get(xid, "see NVIDIA's Xid catalog")


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


@dataclass(slots=True)
class Health:
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


class HealthChecks:
    """Health judgement and the event watcher, on the state `NvmlBackend` owns."""

    _lib: NvmlLibrary
    _nvml: Any
    _health_config: HealthConfig
    _event_wait_timeout_s: float
    _clock: Callable[[], float]
    _lock: threading.Lock
    _stop: threading.Event
    _wake: Callable[[], None]
    _health: dict[int, Health]
    _gpus: list[Gpu]
    _by_handle: dict[object, Gpu]
    _event_set: object
    event_wait_errors: int

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

    # -- health ----------------------------------------------------------------------------------

    def _mark_unhealthy(
        self, gpu: Gpu, reason: str, now: float, *, error: bool = False, hang: bool = False
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
        # The poll that follows logs the one line an operator reads (index, UUID, reason).
        logger.debug(
            "gpu marked unhealthy %s reason=%r recovery=%s; %s",
            gpu.label(),
            reason,
            recovery.value,
            then,
        )
        self._wake()  # reported by a poll now, not after an idle interval

    def _mig_faults(self, health: Health, now: float) -> dict[int, str]:
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

    def _check_hang(self, gpu: Gpu, now: float) -> None:
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

    def _check_recovery(self, gpu: Gpu, sample: Sample, now: float) -> None:
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
            except self._lib.nvml_error as e:
                if self._lib.code(e) == nvml.NVML_ERROR_TIMEOUT:
                    continue
                self._event_wait_failed(self._lib.describe_error(e))
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

    def _gpu_of_event(self, device: object) -> Gpu | None:
        with self._lock:
            gpu = self._by_handle.get(handle_key(device))
        if gpu is not None:
            return gpu
        try:
            uuid = text(self._nvml.nvmlDeviceGetUUID(device))
        except self._lib.nvml_error as e:
            logger.warning(
                "NVML event for a device of unknown UUID error=%s", self._lib.describe_error(e)
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
        gpu: Gpu,
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
            self._wake()  # reported by a poll now, not after an idle interval
            return
        logger.warning(
            "critical Xid %s xid=%d meaning=%r source=%s", gpu.label(), xid, meaning, source
        )
        self._mark_unhealthy(gpu, f"Xid {xid} ({meaning})", now)
