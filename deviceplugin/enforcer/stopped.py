"""What this run keeps of the stopped-process record (`enforcer.record`): the entries written,
those an earlier run left whose resume was denied (carried), why the file cannot be written, and
the scan for stopped processes after a lost record. `recover` resumes what an earlier run left
stopped; `write` keeps the file naming every process that may be stopped."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from deviceplugin.enforcer.control import (
    ProcessControl,
    PsutilControl,
    SignalResult,
    run_state,
)
from deviceplugin.enforcer.record import load_stopped_record, move_aside, write_stopped_record
from deviceplugin.statefiles import boot_id

log = logging.getLogger("deviceplugin.enforcer.enforcer")

# How long after a start with a lost record the snapshots are scanned for stopped processes.
STRAY_SCAN_S = 120.0


class StoppedBook:
    """The record at `path`, kept by one run of the enforcer. Not locked: the enforcer holds
    its lock around every call."""

    def __init__(
        self,
        path: Path,
        control: ProcessControl,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.path = path
        self._control = control
        self._clock = clock
        self._wall_clock = wall_clock
        # After a lost record: until then (monotonic), stopped GPU processes of allocations are
        # resumed as they appear in snapshots (pod-resources may name them only after a while).
        self.scan_until: float | None = None
        self.scanned: set[int] = set()
        self.recorded: dict[int, float] = {}
        # Processes an earlier run left stopped whose resume was denied: kept in every record.
        self.carried: dict[int, float] = {}
        self._problem: str | None = None
        self.signals_denied = 0

    def recover(self) -> int:
        """Resume every process an earlier run recorded as possibly stopped whose creation time
        still matches; then clear the record, but for the processes whose resume was denied (the
        next start tries them again). Returns how many were resumed.

        This undoes what an earlier run did, so it acts for real even in a dry run."""
        entries = self._read()
        control = PsutilControl() if self._control.dry_run else self._control
        # What this run itself recorded is not an earlier run's (carried entries are).
        own = {pid: c for pid, c in self.recorded.items() if pid not in self.carried}
        resumed = 0
        denied: dict[int, float] = {}
        for pid, created in entries:
            if pid in own:
                continue
            result = control.resume_recorded(pid, created)
            if result is SignalResult.SENT:
                resumed += 1
                log.warning(
                    "resumed a process an earlier run left stopped pid=%d create_time=%.2f "
                    "dry_run=False",  # the resume is real, even in a dry run
                    pid,
                    created,
                )
            elif result is SignalResult.DENIED:
                denied[pid] = created
                self.signals_denied += 1
                log.warning(
                    "cannot resume a process an earlier run left stopped: permission denied; "
                    "kept in the record for the next start pid=%d create_time=%.2f",
                    pid,
                    created,
                )
            else:
                log.info("recorded process not resumed: gone or its pid reused pid=%d", pid)
        if entries:
            keep = dict(denied)
            if not self._control.dry_run:
                self.carried = denied
                keep.update(own)
            try:
                write_stopped_record(self.path, keep.items())
            except OSError as e:
                log.error(
                    "cannot clear the stopped-process record path=%s error=%s",
                    self.path,
                    e.strerror or e,
                )
            else:
                if not self._control.dry_run:
                    self.recorded = keep
        return resumed

    def _read(self) -> list[tuple[int, float]]:
        """The entries of an earlier run's record that belong to this boot. A bad entry is
        skipped and logged; an unreadable file is moved aside. Either way, the first fresh
        snapshot is scanned for stopped processes of this daemon's allocations."""
        record = load_stopped_record(self.path)
        if record.unreadable is not None:
            aside = move_aside(self.path, self._wall_clock())
            log.error(
                "stopped-process record unreadable; moved aside, and stopped GPU processes of "
                "this node's allocations will be resumed as polls find them error=%s moved_to=%s",
                record.unreadable,
                aside,
            )
            self.scan_until = self._clock() + STRAY_SCAN_S
        for problem in record.skipped[:10]:
            log.warning("stopped-process record: entry skipped problem=%s", problem)
        if record.skipped:
            log.warning(
                "stopped-process record: entries skipped count=%d; stopped GPU processes of this "
                "node's allocations will be resumed as polls find them",
                len(record.skipped),
            )
            self.scan_until = self._clock() + STRAY_SCAN_S
        if record.entries and record.boot_id != boot_id():
            log.info(
                "stopped-process record is from another boot; its processes are gone count=%d",
                len(record.entries),
            )
            return []
        return list(record.entries)

    def scan(self, attributed: set[int], ours: frozenset[int], now: float) -> None:
        """After a lost record, resume stray stopped processes among `attributed` (see
        `resume_strays`) until the scan's time is up."""
        if self.scan_until is None:
            return
        if now <= self.scan_until:
            self.resume_strays(attributed, ours)
        else:
            self.scan_until = None
            self.scanned = set()

    def resume_strays(self, attributed: set[int], ours: frozenset[int]) -> None:
        """Resume the stopped (state T) processes among this snapshot's attributed ones that no
        duty cycle of this run holds: after a lost record, they may be ones an earlier run
        stopped. Each PID is looked at once. Acts for real, even in a dry run, as `recover`
        does."""
        control = PsutilControl() if self._control.dry_run else self._control
        try:
            for pid in sorted(attributed - ours - self.scanned):
                self.scanned.add(pid)
                if run_state(pid) != "T":
                    continue
                control.watch([pid])
                result = control.send(pid, signal.SIGCONT)
                log.warning(
                    "resumed a stopped GPU process of an allocation after a lost record "
                    "pid=%d result=%s",
                    pid,
                    result.value,
                )
        finally:
            if control is not self._control:
                control.close()

    def recorded_for(self, pids: Iterable[int]) -> dict[int, float]:
        """The record naming `pids` (those whose identity is known) and the carried entries."""
        result = dict(self.carried)
        for pid in pids:
            created = self.recorded.get(pid)
            if created is None:
                created = self._control.create_time(pid)
            if created is not None:
                result[pid] = created
        return result

    def write(self, entries: Mapping[int, float], *, force: bool = False) -> bool:
        """Write the record if it changed; False (logged once per problem) when it cannot be."""
        if not force and dict(entries) == self.recorded:
            return True
        if self._control.dry_run:
            self.recorded = dict(entries)  # nothing is really stopped: nothing to record
            return True
        try:
            write_stopped_record(self.path, entries.items())
        except OSError as e:
            problem = f"{e.strerror or e}"
            if problem != self._problem:
                log.error(
                    "cannot write the stopped-process record; no new throttling until it can "
                    "be written path=%s error=%s",
                    self.path,
                    problem,
                )
            self._problem = problem
            return False
        if self._problem is not None:
            log.info("stopped-process record writable again path=%s", self.path)
            self._problem = None
        self.recorded = dict(entries)
        return True
