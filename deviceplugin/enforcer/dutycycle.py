"""`DutyCycler` runs the SIGSTOP/SIGCONT duty cycles on its own thread, on a fixed grid of periods:
every throttled group runs from the start of each period and is stopped at `duty x period`. A
change of duty applies at once, within the current period. It counts how long each group spent
stopped, and resumes everything it stopped when a group is released and when it stops. A process
reported gone leaves its group at once and is never signalled again unless a later `set` names it.
A denied signal is logged once per PID and counted; a PID whose resume was denied is kept as
"unresumed" and retried, so that the enforcer can keep it in its stopped-process record.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from deviceplugin.enforcer.control import ProcessControl, SignalResult

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
_COALESCE_RATIO = 0.01


@dataclass(slots=True)
class _Group:
    pids: frozenset[int]
    duty: float
    stopped: set[int] = field(default_factory=set)
    stopped_since_s: float | None = None


class DutyCycler:
    """SIGSTOP/SIGCONT duty cycles for groups of processes, on a thread of its own.

    A group is a container's processes on one GPU, known by a key. The thread starts with the first
    group and sleeps, using no CPU, while there is none. `on_error` is called once, from the
    thread, if it fails; everything it stopped has been resumed by then, as far as possible.

    A PID whose signal reports GONE leaves every group at once: it is signalled again only if a
    later `set` names it. A denied SIGSTOP leaves the process running, and is tried again every
    period; a denied SIGCONT makes the PID "unresumed" (see `unresumed`), tried again every
    period and when the cycler stops. Each PID's first denial is logged; `signals_denied` counts
    them all."""

    def __init__(
        self,
        control: ProcessControl,
        period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self._control = control
        self._period_s = period_s
        # Stops due within this of each other are made together, to wake the thread less.
        self._coalesce_s = period_s * _COALESCE_RATIO
        self._clock = clock
        self._on_error = on_error
        self._cond = threading.Condition()
        self._groups: dict[Hashable, _Group] = {}
        self._totals: dict[Hashable, float] = {}
        # Which groups hold each PID stopped; a PID is resumed when none does.
        self._holders: dict[int, set[Hashable]] = {}
        # PIDs stopped by this cycler whose SIGCONT was denied: they may still be stopped.
        self._unresumed: set[int] = set()
        # PIDs whose denial has been logged, while they are in a group or unresumed.
        self._denied_logged: set[int] = set()
        self._signals_denied = 0
        self._signals_moved = 0
        self._period_start_s = clock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    # -- the enforcer's side --------------------------------------------------------------

    def set(self, key: Hashable, pids: Iterable[int], duty: float) -> None:
        """Run the group's processes for `duty` (0 < duty <= 1) of every period from now on."""
        pids = frozenset(pids)
        duty = min(max(duty, 0.0), 1.0)
        with self._cond:
            if self._stopping or self.error is not None:
                return  # nothing may be stopped that the thread would not resume
            now = self._clock()
            group = self._groups.get(key)
            if group is None:
                if not self._groups:
                    self._period_start_s = now
                group = self._groups[key] = _Group(pids, duty)
            else:
                for pid in group.stopped - pids:
                    self._resume(key, group, pid)
                group.stopped &= pids
                group.pids = pids
                group.duty = duty
            self._account(key, group, now)
            self._reconcile(now)
            self._prune_denied()
            self._ensure_thread()
            self._cond.notify_all()

    def release(self, key: Hashable) -> None:
        """End the group's duty cycle; its processes run freely from now on."""
        with self._cond:
            group = self._groups.pop(key, None)
            if group is not None:
                self._release_group(key, group, self._clock())
            self._prune_denied()
            self._cond.notify_all()

    def withdraw(self, pid: int) -> None:
        """Take `pid` out of every group, resuming it if a group held it stopped: it is about
        to be stopped for good. A later `set` that names it takes it in again."""
        with self._cond:
            for key, group in self._groups.items():
                if pid in group.pids:
                    self._resume(key, group, pid)
                    group.pids = group.pids - {pid}
                    self._account(key, group, self._clock())
            self._cond.notify_all()

    def release_all(self) -> None:
        """End every duty cycle, and try once more to resume the unresumed PIDs."""
        with self._cond:
            now = self._clock()
            for key in list(self._groups):
                self._release_group(key, self._groups.pop(key), now)
            self._retry_unresumed()
            self._prune_denied()
            self._cond.notify_all()

    def forget(self, key: Hashable) -> None:
        """Drop the stopped-time total of a released group (its container is gone)."""
        with self._cond:
            if key not in self._groups:
                self._totals.pop(key, None)

    def stop(self) -> None:
        """Resume everything and end the thread. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.error("duty-cycle thread did not stop timeout_s=%s", _JOIN_TIMEOUT_S)
        self.release_all()

    # -- readings -------------------------------------------------------------------------

    def duty(self, key: Hashable) -> float | None:
        with self._cond:
            group = self._groups.get(key)
            return group.duty if group is not None else None

    def stopped_seconds(self, key: Hashable) -> float:
        """How long the group's processes have spent stopped, in total, up to now."""
        with self._cond:
            total = self._totals.get(key, 0.0)
            group = self._groups.get(key)
            if group is not None and group.stopped_since_s is not None:
                total += self._clock() - group.stopped_since_s
            return total

    def figures(self) -> dict[Hashable, tuple[float | None, float]]:
        """`(duty(key), stopped_seconds(key))` of every key that has a group or a stopped-time
        total, read at one instant; any other key's are (None, 0.0)."""
        with self._cond:
            now = self._clock()
            result: dict[Hashable, tuple[float | None, float]] = {
                key: (None, total) for key, total in self._totals.items()
            }
            for key, group in self._groups.items():
                total = self._totals.get(key, 0.0)
                if group.stopped_since_s is not None:
                    total += now - group.stopped_since_s
                result[key] = (group.duty, total)
            return result

    def pids(self) -> frozenset[int]:
        """Every PID in a group: those that may be stopped at any moment."""
        with self._cond:
            return frozenset(pid for g in self._groups.values() for pid in g.pids)

    def unresumed(self) -> frozenset[int]:
        """PIDs this cycler stopped whose SIGCONT was denied: they may still be stopped."""
        with self._cond:
            return frozenset(self._unresumed)

    @property
    def signals_denied(self) -> int:
        """How many signals were denied, in all."""
        with self._cond:
            return self._signals_denied

    @property
    def signals_moved(self) -> int:
        """How many SIGSTOPs were not sent because the process had moved to another cgroup."""
        with self._cond:
            return self._signals_moved

    def group_keys(self) -> frozenset[Hashable]:
        with self._cond:
            return frozenset(self._groups)

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    # -- the thread (callers hold the lock) ------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None and self.error is None:
            self._thread = threading.Thread(target=self._run, name="vgpu-duty-cycle", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            with self._cond:
                while not self._stopping:
                    if not self._groups:
                        self._retry_unresumed()
                        self._cond.wait(self._period_s if self._unresumed else None)
                        continue
                    now = self._clock()
                    self._reconcile(now)
                    self._cond.wait(max(self._next_event_s(now) - now, 0.0))
        except BaseException as e:
            self.error = e
            log.exception("duty-cycle thread failed; resuming every process it stopped")
            with contextlib.suppress(BaseException), self._cond:
                now = self._clock()
                for key in list(self._groups):
                    self._release_group(key, self._groups.pop(key), now)
            if self._on_error is not None:
                self._on_error(e)

    def _next_event_s(self, now: float) -> float:
        """The next moment a group must stop: a stop time inside this period, or its end."""
        start = self._period_start_s - self._coalesce_s
        times = [
            start + g.duty * self._period_s
            for g in self._groups.values()
            if 0 < g.duty < 1 and start + g.duty * self._period_s > now
        ]
        return min(times, default=self._period_start_s + self._period_s)

    def _reconcile(self, now: float) -> None:
        """Bring every group to the run state the current phase of the period asks for."""
        elapsed = now - self._period_start_s
        if elapsed >= self._period_s:
            self._period_start_s += self._period_s * int(elapsed // self._period_s)
            self._retry_unresumed()
        phase_s = now - self._period_start_s + self._coalesce_s
        wanted_stopped = [
            (key, g)
            for key, g in self._groups.items()
            if g.duty < 1 and phase_s >= g.duty * self._period_s
        ]
        stopping = {key for key, _ in wanted_stopped}
        for key, group in self._groups.items():
            if key not in stopping and group.stopped:
                for pid in list(group.stopped):
                    self._resume(key, group, pid)
        for key, group in wanted_stopped:
            for pid in group.pids - group.stopped:
                holders = self._holders.get(pid)
                if not holders:
                    if self._signal(pid, signal.SIGSTOP) is not SignalResult.SENT:
                        continue  # gone (and dropped from every group), or denied
                    holders = self._holders[pid] = set()
                holders.add(key)
                group.stopped.add(pid)
        for key, group in self._groups.items():
            self._account(key, group, now)

    def _signal(self, pid: int, sig: signal.Signals) -> SignalResult:
        """Send `sig` to `pid` through the control, and act on what became of it."""
        result = self._control.send(pid, sig)
        if result is SignalResult.GONE:
            self._drop(pid)
        elif result is SignalResult.MOVED:
            self._signals_moved += 1
            self._drop(pid)
        elif result is SignalResult.DENIED:
            self._signals_denied += 1
            if sig == signal.SIGCONT:
                self._unresumed.add(pid)
            if pid not in self._denied_logged:
                self._denied_logged.add(pid)
                log.warning(
                    "cannot %s a throttled process: permission denied; tried again every "
                    "period, not logged again for this pid pid=%d signal=%s",
                    "resume" if sig == signal.SIGCONT else "stop",
                    pid,
                    sig.name,
                )
        elif sig == signal.SIGCONT:
            self._unresumed.discard(pid)
        return result

    def _drop(self, pid: int) -> None:
        """`pid`'s process is gone (or its identity is no longer held): out of every group."""
        for group in self._groups.values():
            if pid in group.pids:
                group.pids = group.pids - {pid}
            group.stopped.discard(pid)
        self._holders.pop(pid, None)
        self._unresumed.discard(pid)
        self._denied_logged.discard(pid)

    def _retry_unresumed(self) -> None:
        for pid in sorted(self._unresumed):
            if pid not in self._holders:  # held stopped by a group: resumed with it
                self._signal(pid, signal.SIGCONT)

    def _prune_denied(self) -> None:
        live = {pid for g in self._groups.values() for pid in g.pids} | self._unresumed
        self._denied_logged &= live

    def _account(self, key: Hashable, group: _Group, now: float) -> None:
        """Start or end the group's stopped interval to match whether any of its PIDs is stopped."""
        if group.stopped and group.stopped_since_s is None:
            group.stopped_since_s = now
        elif not group.stopped and group.stopped_since_s is not None:
            self._totals[key] = self._totals.get(key, 0.0) + (now - group.stopped_since_s)
            group.stopped_since_s = None

    def _resume(self, key: Hashable, group: _Group, pid: int) -> None:
        group.stopped.discard(pid)
        holders = self._holders.get(pid)
        if holders is None:
            return
        holders.discard(key)
        if not holders:
            del self._holders[pid]
            self._signal(pid, signal.SIGCONT)

    def _release_group(self, key: Hashable, group: _Group, now: float) -> None:
        for pid in list(group.stopped):
            self._resume(key, group, pid)
        self._account(key, group, now)
        self._totals.setdefault(key, 0.0)
