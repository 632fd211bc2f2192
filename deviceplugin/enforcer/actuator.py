"""The only code that sends signals to processes: process control, and the duty-cycle thread.

`ProcessControl` is the seam. `PsutilControl` holds the identity of every GPU process from the
moment it is first seen (a psutil.Process, which remembers the creation time) and signals through a
pidfd opened on first use and checked against that identity, so a PID that was reused by another
process is never signalled; where pidfds are unavailable it signals through psutil, which checks
the identity before each signal. `RecordingControl` sends nothing and records what it was asked
to send: dry runs and tests.

`DutyCycler` runs the SIGSTOP/SIGCONT duty cycles on its own thread, on a fixed grid of periods:
every throttled group runs from the start of each period and is stopped at `duty x period`. A
change of duty applies at once, within the current period. It counts how long each group spent
stopped, and resumes everything it stopped when a group is released and when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

log = logging.getLogger(__name__)

# Two creation times within this many seconds belong to the same process (procfs counts in ticks).
CREATE_TIME_TOLERANCE_S = 0.01
_JOIN_TIMEOUT_S = 5.0
_COALESCE_RATIO = 0.01


class ProcessControl(Protocol):
    """Signals to GPU processes, by PID, only to processes whose identity is held."""

    @property
    def dry_run(self) -> bool:
        """True when nothing is really sent."""
        ...

    def watch(self, pids: Collection[int]) -> None:
        """Hold the identity of each PID in `pids` not yet held (the process that has it now),
        and forget every held PID not in `pids`."""
        ...

    def send(self, pid: int, sig: signal.Signals) -> bool:
        """Send `sig` to the held process `pid`. False (nothing sent) when the PID is not held, the
        process is gone, or the PID now belongs to another process."""
        ...

    def create_time(self, pid: int) -> float | None:
        """The creation time of the held process `pid` (its identity), None when not held."""
        ...

    def resume_recorded(self, pid: int, create_time: float) -> bool:
        """SIGCONT `pid` if a process created at `create_time` still has it (a record left by an
        earlier run of the daemon). Whether it was resumed."""
        ...

    def close(self) -> None:
        """Release held resources (pidfds). Idempotent."""
        ...


def _pidfd_supported() -> bool:
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


class PsutilControl:
    """Real signals, through pidfds checked against psutil identities (or psutil alone)."""

    def __init__(self, *, use_pidfd: bool | None = None) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, psutil.Process] = {}
        self._pidfds: dict[int, int] = {}
        self._use_pidfd = _pidfd_supported() if use_pidfd is None else use_pidfd

    @property
    def dry_run(self) -> bool:
        return False

    def watch(self, pids: Collection[int]) -> None:
        wanted = set(pids)
        with self._lock:
            for pid in wanted - self._held.keys():
                if pid <= 0:
                    continue
                try:
                    self._held[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue  # gone already, or not ours to see: never signalled
            for pid in [pid for pid in self._held if pid not in wanted]:
                self._forget(pid)

    def send(self, pid: int, sig: signal.Signals) -> bool:
        with self._lock:
            process = self._held.get(pid)
            if process is None:
                return False
            try:
                fd = self._pidfd(pid, process) if self._use_pidfd else None
                if fd is None:
                    process.send_signal(sig)
                else:
                    signal.pidfd_send_signal(fd, sig)
            except (ProcessLookupError, psutil.NoSuchProcess):
                self._forget(pid)
                return False
            except (PermissionError, psutil.AccessDenied):
                log.warning("cannot signal pid=%d signal=%s: permission denied", pid, sig.name)
                return False
            return True

    def create_time(self, pid: int) -> float | None:
        with self._lock:
            process = self._held.get(pid)
        if process is None:
            return None
        try:
            return process.create_time()
        except psutil.Error:
            return None

    def resume_recorded(self, pid: int, create_time: float) -> bool:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - create_time) > CREATE_TIME_TOLERANCE_S:
                return False
            process.send_signal(signal.SIGCONT)
        except psutil.Error:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            for pid in list(self._held):
                self._forget(pid)

    def _pidfd(self, pid: int, process: psutil.Process) -> int | None:
        """The pidfd of a held process, opened on first use. Raises ProcessLookupError when the
        process is gone or its PID was reused; None when pidfds cannot be used for it."""
        fd = self._pidfds.get(pid)
        if fd is not None:
            return fd
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except OSError:
            return None
        # The pidfd names whatever process had the PID when it was opened; that process is the
        # held one if the held one still has the PID now.
        if not process.is_running():
            os.close(fd)
            raise ProcessLookupError(pid)
        self._pidfds[pid] = fd
        return fd

    def _forget(self, pid: int) -> None:
        self._held.pop(pid, None)
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)


@dataclass
class RecordingControl:
    """Sends nothing; records the latest signals it was asked to send (`sent`, at most
    `max_sent`), and tracks which PIDs it would have left stopped. `gone` PIDs behave as
    processes that exited; nothing else does (a dry run's SIGKILL leaves its process running).
    The dry-run control, and the tests'."""

    create_times: dict[int, float] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    max_sent: int = 100_000
    sent: deque[tuple[int, signal.Signals]] = field(init=False)
    stopped: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sent = deque(maxlen=self.max_sent)

    @property
    def dry_run(self) -> bool:
        return True

    def watch(self, pids: Collection[int]) -> None:
        self.held = {pid for pid in pids if pid not in self.gone}

    def send(self, pid: int, sig: signal.Signals) -> bool:
        if pid not in self.held or pid in self.gone:
            return False
        self.sent.append((pid, sig))
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        else:
            self.stopped.discard(pid)
        return True

    def create_time(self, pid: int) -> float | None:
        if pid not in self.held:
            return None
        return self.create_times.get(pid, 1000.0 + pid)

    def resume_recorded(self, pid: int, create_time: float) -> bool:
        known = self.create_times.get(pid, 1000.0 + pid)
        if pid in self.gone or abs(known - create_time) > CREATE_TIME_TOLERANCE_S:
            return False
        self.sent.append((pid, signal.SIGCONT))
        self.stopped.discard(pid)
        return True

    def close(self) -> None:
        self.held = set()


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
    thread, if it fails; everything it stopped has been resumed by then, as far as possible."""

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
            self._ensure_thread()
            self._cond.notify_all()

    def release(self, key: Hashable) -> None:
        """End the group's duty cycle; its processes run freely from now on."""
        with self._cond:
            group = self._groups.pop(key, None)
            if group is not None:
                self._release_group(key, group, self._clock())
            self._cond.notify_all()

    def release_all(self) -> None:
        with self._cond:
            now = self._clock()
            for key in list(self._groups):
                self._release_group(key, self._groups.pop(key), now)
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

    def pids(self) -> frozenset[int]:
        """Every PID in a group: those that may be stopped at any moment."""
        with self._cond:
            return frozenset(pid for g in self._groups.values() for pid in g.pids)

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
                        self._cond.wait()
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
                self._account(key, group, now)
        for key, group in wanted_stopped:
            for pid in group.pids - group.stopped:
                holders = self._holders.setdefault(pid, set())
                if not holders and not self._control.send(pid, signal.SIGSTOP):
                    del self._holders[pid]
                    continue
                holders.add(key)
                group.stopped.add(pid)
            self._account(key, group, now)

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
            self._control.send(pid, signal.SIGCONT)

    def _release_group(self, key: Hashable, group: _Group, now: float) -> None:
        for pid in list(group.stopped):
            self._resume(key, group, pid)
        self._account(key, group, now)
        self._totals.setdefault(key, 0.0)
