"""The process control that sends nothing: dry runs and tests."""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from deviceplugin.enforcer.control import CREATE_TIME_TOLERANCE_S, SignalResult


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
