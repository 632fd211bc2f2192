"""The only code that sends signals to processes: process control, and the duty-cycle thread.

`ProcessControl` is the seam. `PsutilControl` holds the identity of a GPU process (a
psutil.Process, which remembers the creation time) from the moment `watch` is asked to acquire it,
and signals through a pidfd opened on first use and checked against that identity, so a PID that
was reused by another process is never signalled; where pidfds are unavailable it signals through
psutil, which checks the identity before each signal. Identities are acquired only by `watch`, for
PIDs freshly attributed to an allocation; `retain` keeps some of those already held and never
acquires one. Every signal reports whether it was sent, the process is gone (its identity is then
forgotten), or the signal was denied. `RecordingControl` sends nothing and records what it was
asked to send: dry runs and tests.

`DutyCycler` runs the SIGSTOP/SIGCONT duty cycles on its own thread, on a fixed grid of periods:
every throttled group runs from the start of each period and is stopped at `duty x period`. A
change of duty applies at once, within the current period. It counts how long each group spent
stopped, and resumes everything it stopped when a group is released and when it stops. A process
reported gone leaves its group at once and is never signalled again unless a later `set` names it.
A denied signal is logged once per PID and counted; a PID whose resume was denied is kept as
"unresumed" and retried, so that the enforcer can keep it in its stopped-process record.

Over 400 lines: every signal the daemon sends starts here, kept in one file for whoever checks
that none reaches a process it must not.
"""

from __future__ import annotations

import contextlib
import enum
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

# Two identities within this much of each other belong to the same process. PsutilControl's
# identities are start times in clock ticks since boot (integers); others may be seconds.
CREATE_TIME_TOLERANCE_S = 0.01
# Fields of /proc/<pid>/stat after the ")" that closes the command name: the run state is index 0,
# the start time (field 22) index 19.
_STATE_FIELD = 0
_START_TICKS_FIELD = 19


def _stat_fields(pid: int, proc_root: str) -> list[bytes] | None:
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 1 :].split()


def start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """The start time of process `pid` in clock ticks since boot (field 22 of its stat file):
    with the boot ID, an identity that no step of the wall clock changes. None when the process
    is gone or its stat cannot be read."""
    fields = _stat_fields(pid, proc_root)
    try:
        return None if fields is None else int(fields[_START_TICKS_FIELD])
    except (IndexError, ValueError):
        return None


def run_state(pid: int, proc_root: str = "/proc") -> str | None:
    """The run state letter of process `pid` (`T` when stopped), None when it cannot be read."""
    fields = _stat_fields(pid, proc_root)
    if not fields:
        return None
    return fields[_STATE_FIELD].decode("ascii", "replace")


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The kernel's ID of this boot; "" where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


_JOIN_TIMEOUT_S = 5.0
_COALESCE_RATIO = 0.01


class SignalResult(enum.Enum):
    """What became of a signal."""

    SENT = "sent"
    # Not sent: the PID is not held, its process exited, or the PID now names another process.
    GONE = "gone"
    # Not sent: the process is there, and the signal was refused (EPERM).
    DENIED = "denied"


class ProcessControl(Protocol):
    """Signals to GPU processes, by PID, only to processes whose identity is held."""

    @property
    def dry_run(self) -> bool:
        """True when nothing is really sent."""
        ...

    def watch(self, pids: Collection[int]) -> None:
        """Acquire the identity of each PID in `pids` that is not held yet (the process that has
        it now). Only for PIDs attributed to an allocation by the latest poll. Keeps every PID
        already held."""
        ...

    def retain(self, pids: Collection[int]) -> None:
        """Forget every held PID not in `pids`. Never acquires an identity."""
        ...

    def send(self, pid: int, sig: signal.Signals) -> SignalResult:
        """Send `sig` to the held process `pid`. GONE (nothing sent, and `pid` is no longer held)
        when the PID is not held, its process is gone, or the PID now belongs to another process;
        DENIED when the process refused it (it stays held)."""
        ...

    def create_time(self, pid: int) -> float | None:
        """The identity of the held process `pid` (for PsutilControl its start time in clock
        ticks since boot), None when not held."""
        ...

    def resume_recorded(self, pid: int, create_time: float) -> SignalResult:
        """SIGCONT `pid` if the process with identity `create_time` still has it (a record left
        by an earlier run of the daemon). GONE when no such process has it."""
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


def cgroup_now(pid: int, proc_root: str = "/proc") -> bytes | None:
    """Where process `pid` is now: its cgroup file's content, read afresh; None when gone."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            return f.read()
    except OSError:
        return None


# Signals that act against a process; SIGCONT only undoes one and is never held back.
_HARMFUL = frozenset((signal.SIGKILL, signal.SIGSTOP))


class PsutilControl:
    """Real signals, through pidfds checked against psutil identities (or psutil alone).

    With each identity it keeps where the process was when it was acquired (`where`, by default
    its cgroup file's content): right before a SIGKILL or SIGSTOP that is read again, and a
    process that has moved since is not signalled; it is let go (GONE) and not acquired again
    while it stays where it moved to."""

    def __init__(
        self,
        *,
        use_pidfd: bool | None = None,
        where: Callable[[int], object] = cgroup_now,
    ) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, psutil.Process] = {}
        self._ticks: dict[int, int] = {}
        self._where: dict[int, object] = {}
        self._pidfds: dict[int, int] = {}
        self._use_pidfd = _pidfd_supported() if use_pidfd is None else use_pidfd
        self._where_now = where
        # PID -> (start ticks, where it moved to) of processes let go for moving.
        self._moved: dict[int, tuple[int, object]] = {}
        self.moves_refused = 0

    @property
    def dry_run(self) -> bool:
        return False

    def watch(self, pids: Collection[int]) -> None:
        with self._lock:
            for pid in set(pids) - self._held.keys():
                if pid <= 0:
                    continue
                try:
                    process = psutil.Process(pid)
                except psutil.Error:
                    continue  # gone already, or not ours to see: never signalled
                ticks = start_ticks(pid)
                if ticks is None or not process.is_running():
                    continue
                where = self._where_now(pid)
                moved = self._moved.get(pid)
                if moved is not None:
                    if moved == (ticks, where):
                        continue  # still where it moved to since it was attributed
                    del self._moved[pid]
                self._held[pid] = process
                self._ticks[pid] = ticks
                self._where[pid] = where

    def retain(self, pids: Collection[int]) -> None:
        keep = set(pids)
        with self._lock:
            for pid in [pid for pid in self._held if pid not in keep]:
                self._forget(pid)
            for pid in [pid for pid in self._moved if pid not in keep]:
                del self._moved[pid]

    def send(self, pid: int, sig: signal.Signals) -> SignalResult:
        with self._lock:
            process = self._held.get(pid)
            if process is None:
                return SignalResult.GONE
            if sig in _HARMFUL:
                where = self._where_now(pid)
                if where != self._where.get(pid):
                    self._moved[pid] = (self._ticks[pid], where)
                    self._forget(pid)
                    self.moves_refused += 1
                    log.warning(
                        "not signalled: the process moved to another cgroup since it was "
                        "attributed pid=%d signal=%s",
                        pid,
                        sig.name,
                    )
                    return SignalResult.GONE
            try:
                fd = self._pidfd(pid, process) if self._use_pidfd else None
                if fd is None:
                    process.send_signal(sig)
                else:
                    signal.pidfd_send_signal(fd, sig)
            except (ProcessLookupError, psutil.NoSuchProcess):
                self._forget(pid)
                return SignalResult.GONE
            except (PermissionError, psutil.AccessDenied):
                return SignalResult.DENIED
            return SignalResult.SENT

    def create_time(self, pid: int) -> float | None:
        with self._lock:
            ticks = self._ticks.get(pid)
        return None if ticks is None else float(ticks)

    def resume_recorded(self, pid: int, create_time: float) -> SignalResult:
        if pid <= 0:
            return SignalResult.GONE
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return SignalResult.GONE
        except psutil.Error:
            return SignalResult.DENIED  # its identity cannot be read now: try again later
        fd: int | None = None
        if self._use_pidfd:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return SignalResult.GONE
            except OSError:
                fd = None
        try:
            # Checked after the pidfd is open: the pidfd then names the process checked.
            ticks = start_ticks(pid)
            if ticks is None:
                return SignalResult.GONE if not psutil.pid_exists(pid) else SignalResult.DENIED
            if abs(ticks - create_time) > CREATE_TIME_TOLERANCE_S:
                return SignalResult.GONE  # the PID was reused: not the recorded process
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                else:
                    process.send_signal(signal.SIGCONT)
            except (ProcessLookupError, psutil.NoSuchProcess):
                return SignalResult.GONE
            except (PermissionError, psutil.AccessDenied):
                return SignalResult.DENIED
            return SignalResult.SENT
        finally:
            if fd is not None:
                os.close(fd)

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
        self._ticks.pop(pid, None)
        self._where.pop(pid, None)
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)


@dataclass
class RecordingControl:
    """Sends nothing; records the latest signals it was asked to send (`sent`, at most
    `max_sent`), and tracks which PIDs it would have left stopped. The dry-run control, and the
    tests'.

    A PID's identity is its entry in `create_times` (1000 + pid when absent): a test that changes
    it stands for the PID's reuse by another process, which a held identity then no longer
    matches. `gone` PIDs behave as processes that exited, `denied` ones refuse every signal;
    nothing else does (a dry run's SIGKILL leaves its process running). `acquired` lists, oldest
    first, each PID whose identity `watch` acquired."""

    create_times: dict[int, float] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    denied: set[int] = field(default_factory=set)
    max_sent: int = 100_000
    sent: deque[tuple[int, signal.Signals]] = field(init=False)
    acquired: deque[int] = field(init=False)
    stopped: set[int] = field(default_factory=set)
    held: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.sent = deque(maxlen=self.max_sent)
        self.acquired = deque(maxlen=self.max_sent)

    @property
    def dry_run(self) -> bool:
        return True

    def _identity(self, pid: int) -> float:
        return self.create_times.get(pid, 1000.0 + pid)

    def watch(self, pids: Collection[int]) -> None:
        with self._lock:
            for pid in sorted(set(pids) - self.held.keys()):
                if pid > 0 and pid not in self.gone:
                    self.held[pid] = self._identity(pid)
                    self.acquired.append(pid)

    def retain(self, pids: Collection[int]) -> None:
        keep = set(pids)
        with self._lock:
            self.held = {pid: c for pid, c in self.held.items() if pid in keep}

    def send(self, pid: int, sig: signal.Signals) -> SignalResult:
        with self._lock:
            held = self.held.get(pid)
            if held is None:
                return SignalResult.GONE
            if pid in self.gone or abs(self._identity(pid) - held) > CREATE_TIME_TOLERANCE_S:
                del self.held[pid]
                return SignalResult.GONE
            if pid in self.denied:
                return SignalResult.DENIED
            self.sent.append((pid, sig))
            if sig == signal.SIGSTOP:
                self.stopped.add(pid)
            else:
                self.stopped.discard(pid)
            return SignalResult.SENT

    def create_time(self, pid: int) -> float | None:
        with self._lock:
            return self.held.get(pid)

    def resume_recorded(self, pid: int, create_time: float) -> SignalResult:
        with self._lock:
            if pid in self.gone or abs(self._identity(pid) - create_time) > CREATE_TIME_TOLERANCE_S:
                return SignalResult.GONE
            if pid in self.denied:
                return SignalResult.DENIED
            self.sent.append((pid, signal.SIGCONT))
            self.stopped.discard(pid)
            return SignalResult.SENT

    def close(self) -> None:
        with self._lock:
            self.held = {}


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
