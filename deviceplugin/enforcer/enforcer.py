"""The enforcer: applies the policy's decisions to processes, and keeps the stopped-process record.

The poll loop hands every snapshot to `Enforcer.on_snapshot` (from a worker thread, never the event
loop) and publishes the snapshot it returns, with each container's duty cycle, stopped time and
the enforcement counts filled in. The duty cycles run on the DutyCycler's own thread.

The process control acquires an identity only for a PID attributed to an allocation in a fresh
snapshot (`watch`); the PIDs of the duty cycles keep the identities already held (`retain`) and
never acquire one, so a throttled process that exits, and whose PID is then taken by another
process, is never signalled again. A stale snapshot acquires nothing.

Every process the enforcer may stop is written, with its identity (its start time in clock ticks
since boot, and the boot ID: no step of the wall clock changes them), to
`<state dir>/stopped-processes.json` before it is first stopped, and the file is rewritten whenever
that set changes (not every period). `recover()`, at start, resumes each recorded process whose
identity still matches, so that a daemon killed outright leaves nothing stopped for longer than its
restart. Entries are read one by one: a bad one is skipped and logged, every valid one resumed. A
file that cannot be read at all (truncated, not JSON, nested too deep) is moved aside, never
overwritten, and the first fresh snapshot is scanned for stopped (state T) GPU processes of this
daemon's allocations, which are resumed. `close()` resumes everything; it is also registered with
atexit. A process whose resume was denied stays in the record (at `close()` and at `recover()`),
so that the next start tries again.

The record's file format is `enforcer.record`, what this run keeps of it (recovery, writes, the
scan after a lost record) `enforcer.stopped`; the log lines and counts of each action
`enforcer.actions`; the published snapshot's enforcement fields `enforcer.annotate`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deviceplugin.config import EnforcementConfig
from deviceplugin.enforcer.actions import ActionLog
from deviceplugin.enforcer.annotate import Annotator
from deviceplugin.enforcer.control import (
    ProcessControl,
    PsutilControl,
    SignalResult,
)
from deviceplugin.enforcer.decisions import (
    ControllerTuning,
    Decision,
    Kill,
    Release,
    SetDuty,
)
from deviceplugin.enforcer.dutycycle import DutyCycler
from deviceplugin.enforcer.policy import EnforcementPolicy
from deviceplugin.enforcer.record import (
    STOPPED_RECORD_NAME,
    StoppedRecord,
    load_stopped_record,
    read_stopped_record,
    write_stopped_record,
)
from deviceplugin.enforcer.stopped import STRAY_SCAN_S, StoppedBook
from deviceplugin.enforcer.stopping import StopProcess, plain_stop
from deviceplugin.errors import DevicePluginError
from deviceplugin.model import EnforcementCount, NodeSnapshot

__all__ = [
    "STOPPED_RECORD_NAME",
    "STRAY_SCAN_S",
    "EnforcementError",
    "Enforcer",
    "StoppedRecord",
    "load_stopped_record",
    "read_stopped_record",
    "write_stopped_record",
]

log = logging.getLogger(__name__)

_CLOSE_LOCK_TIMEOUT_S = 5.0


class EnforcementError(DevicePluginError):
    """The enforcer cannot go on (its duty-cycle thread failed); everything has been resumed."""


class Enforcer:
    """Memory and compute enforcement for one node (docs/design.md §4)."""

    def __init__(
        self,
        config: EnforcementConfig,
        state_dir: Path,
        *,
        control: ProcessControl | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tuning: ControllerTuning | None = None,
        stop_process: StopProcess = plain_stop,
    ) -> None:
        self.config = config
        self._stop_process = stop_process
        self.policy = EnforcementPolicy(config, tuning)
        self._control: ProcessControl = control if control is not None else PsutilControl()
        self._clock = clock
        self._wall_clock = wall_clock
        self._book = StoppedBook(
            Path(state_dir) / STOPPED_RECORD_NAME,
            self._control,
            clock=clock,
            wall_clock=wall_clock,
        )
        self._cycler = DutyCycler(self._control, config.compute.period_s, clock=clock)
        self._lock = threading.RLock()
        self._closed = False
        self._recovered = False
        self._signals_denied = 0
        self._signals_moved = 0
        self._actions = ActionLog()
        self._annotator = Annotator()
        self._forgot_for: tuple[object, ...] = ()
        atexit.register(self.close)
        log.info(
            "enforcer started memory_action=%s grace_period_s=%s compute_action=%s "
            "period_s=%s work_conserving=%s dry_run=%s state=%s",
            config.memory.action.value,
            config.memory.grace_period_s,
            config.compute.action.value,
            config.compute.period_s,
            config.compute.work_conserving,
            self._control.dry_run,
            self._book.path,
        )

    @property
    def record_path(self) -> Path:
        return self._book.path

    @property
    def cycler(self) -> DutyCycler:
        return self._cycler

    @property
    def signals_denied(self) -> int:
        """How many signals were denied (kills, stops, resumes), in all."""
        with self._lock:
            return self._signals_denied + self._book.signals_denied + self._cycler.signals_denied

    def signals_not_sent(self) -> tuple[tuple[str, int], ...]:
        """Kills, stops and resumes not sent, by reason: `permission_denied` (the daemon may not
        signal the process) and `moved` (it left the cgroup it was attributed from)."""
        with self._lock:
            moved = self._signals_moved + self._cycler.signals_moved
            return (("moved", moved), ("permission_denied", self.signals_denied))

    # -- start ------------------------------------------------------------------------------

    def recover(self) -> int:
        """Resume every process an earlier run recorded as possibly stopped whose identity still
        matches; then clear the record, but for the processes whose resume was denied (the next
        start tries them again). Returns how many were resumed. Acts for real even in a dry run."""
        with self._lock:
            self._recovered = True
            return self._book.recover()

    # -- every poll -------------------------------------------------------------------------

    def on_snapshot(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """Decide and act on `snapshot`; return it with the enforcement fields filled in.

        Raises EnforcementError if the duty-cycle thread has failed (it resumed what it had
        stopped). On any other exception every throttle is released before it propagates."""
        with self._lock:
            if self._closed:
                return snapshot
            if self._cycler.error is not None:
                raise EnforcementError("the duty-cycle thread failed") from self._cycler.error
            if not self._recovered:
                self.recover()  # before the first write replaces an earlier run's record
            try:
                return self._on_snapshot(snapshot)
            except BaseException:
                log.exception("enforcement failed; resuming every throttled process")
                self._cycler.release_all()
                with contextlib.suppress(OSError):
                    self._book.write(self._book.recorded_for(self._cycler_pids()))
                raise

    def _on_snapshot(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        now = self._clock()
        self._actions.remember(snapshot)
        decisions = self.policy.decide(snapshot, now, self._wall_clock())

        # Identities are acquired only for PIDs attributed by this poll. The duty cycles' PIDs
        # keep what is held: one whose process exited was dropped by the cycler, and its PID,
        # perhaps another process's by now, is never acquired again from there.
        if snapshot.stale:
            self._control.retain(self._cycler_pids())
        else:
            attributed = {p.pid for c in snapshot.containers for p in c.processes}
            self._control.retain(attributed | self._cycler_pids())
            self._control.watch(attributed)
            self._book.scan(attributed, self._cycler_pids(), now)

        # The record must name every process before it is first stopped.
        planned = set(self._cycler_pids())
        for d in decisions:
            if isinstance(d, SetDuty):
                planned |= d.pids
        if not self._book.write(self._book.recorded_for(planned)):
            decisions = self._without_new_throttles(decisions)

        for d in decisions:
            self._apply(d)

        self._book.write(self._book.recorded_for(self._cycler_pids()))
        self._forget_gone(snapshot)
        return self._annotator.annotate(
            snapshot,
            self._cycler.figures(),
            self.policy.entitlement,
            self.policy.revision,
            self.counts(),
            signals_not_sent=self.signals_not_sent(),
        )

    def _cycler_pids(self) -> frozenset[int]:
        """The PIDs the duty cycles may have stopped: those in a group, and those whose resume
        was denied."""
        return self._cycler.pids() | self._cycler.unresumed()

    def _without_new_throttles(self, decisions: list[Decision]) -> list[Decision]:
        """Drop the duty cycles that would stop processes the record does not name."""
        kept: list[Decision] = []
        for d in decisions:
            if isinstance(d, SetDuty) and not d.pids <= self._book.recorded.keys():
                self.policy.reset((d.allocation_id, d.gpu_uuid))
                if (d.allocation_id, d.gpu_uuid) in self._cycler.group_keys():
                    kept.append(Release(d.allocation_id, d.gpu_uuid, "record not writable"))
                continue
            kept.append(d)
        return kept

    def _apply(self, d: Decision) -> None:
        dry = self._control.dry_run
        if isinstance(d, Kill):
            result = self._kill(d.pid)
            if result is SignalResult.DENIED:
                self._signals_denied += 1
            elif result is SignalResult.MOVED:
                self._signals_moved += 1
            self._actions.killed(d, result, dry)
        elif isinstance(d, SetDuty):
            self._cycler.set((d.allocation_id, d.gpu_uuid), d.pids, d.duty)
            self._actions.throttled(d, dry)
        elif isinstance(d, Release):
            key = (d.allocation_id, d.gpu_uuid)
            self._cycler.release(key)
            self._actions.released(d, self._cycler.stopped_seconds(key), dry)
        else:
            self._actions.recorded(d)

    def _kill(self, pid: int) -> SignalResult:
        """SIGKILL `pid`, out of every duty cycle and resumed first if one held it stopped (a
        stopped MPS client cannot be drained), through `stop_process` (with MPS: after a drain).
        A dry run drains nothing."""
        self._cycler.withdraw(pid)

        def kill() -> SignalResult:
            return self._control.send(pid, signal.SIGKILL)

        return kill() if self._control.dry_run else self._stop_process(pid, kill)

    def _forget_gone(self, snapshot: NodeSnapshot) -> None:
        """Drop what is kept about containers whose allocation is gone."""
        # Counts and names are only ever added for the snapshot's containers: with the same
        # allocations and containers as last time, nothing new can be gone.
        seen = (snapshot.allocations, snapshot.containers)
        if seen == self._forgot_for:
            return
        self._forgot_for = seen
        live = {a.allocation_id for a in snapshot.allocations}
        live |= {c.allocation_id for c in snapshot.containers}
        for key in self._actions.forget(live):
            self._cycler.forget(key)

    def counts(self) -> tuple[EnforcementCount, ...]:
        """Every enforcement count so far, for containers whose allocation still exists."""
        with self._lock:
            return self._actions.counts()

    # -- stop ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Resume every stopped process, stop the duty-cycle thread, clear the record but for
        the processes whose resume was denied. Idempotent; safe to call from any thread."""
        acquired = self._lock.acquire(timeout=_CLOSE_LOCK_TIMEOUT_S)
        left: dict[int, float] = {}
        try:
            if self._closed:
                return
            self._closed = True
            self._cycler.stop()
            left = self._book.recorded_for(self._cycler.unresumed())
            with contextlib.suppress(OSError):
                self._book.write(left, force=True)
            self._control.close()
        finally:
            if acquired:
                self._lock.release()
        atexit.unregister(self.close)
        if left:
            log.error(
                "enforcer closed; processes whose resume was denied may still be stopped, kept "
                "in the stopped-process record for the next start pids=%s",
                ",".join(str(pid) for pid in sorted(left)),
            )
        else:
            log.info("enforcer closed; every throttled process resumed")

    def __enter__(self) -> Enforcer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
