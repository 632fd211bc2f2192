"""Process control: the one place a signal leaves the daemon (the duty cycles send theirs
through it too).

`ProcessControl` is the seam. `PsutilControl` holds the identity of a GPU process (a
psutil.Process, which remembers the creation time) from the moment `watch` is asked to acquire it,
and signals through a pidfd opened on first use and checked against that identity, so a PID that
was reused by another process is never signalled; where pidfds are unavailable it signals through
psutil, which checks the identity before each signal. Identities are acquired only by `watch`, for
PIDs freshly attributed to an allocation; `retain` keeps some of those already held and never
acquires one. Every signal reports whether it was sent, the process is gone (its identity is then
forgotten), or the signal was denied. Right before a SIGKILL or SIGSTOP it reads where the
process is again (`where`): one that moved since it was acquired is not signalled.

The duty cycles that use it are `enforcer.dutycycle`; the control that sends nothing is
`enforcer.recording`.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
from collections.abc import Callable, Collection
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


class SignalResult(enum.Enum):
    """What became of a signal."""

    SENT = "sent"
    # Not sent: the PID is not held, its process exited, or the PID now names another process.
    GONE = "gone"
    # Not sent: the process is there, and the signal was refused (EPERM).
    DENIED = "denied"
    # Not sent: the process moved to another cgroup since it was attributed (SIGKILL and
    # SIGSTOP only); its identity is no longer held.
    MOVED = "moved"


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
                    log.warning(
                        "not signalled: the process moved to another cgroup since it was "
                        "attributed pid=%d signal=%s",
                        pid,
                        sig.name,
                    )
                    return SignalResult.MOVED
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
