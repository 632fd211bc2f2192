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

Over 400 lines: the stopped-process record and the enforcer that writes, recovers and clears it
keep one promise (nothing stays stopped), read together.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from deviceplugin.config import EnforcementConfig
from deviceplugin.enforcer.actuator import (
    DutyCycler,
    ProcessControl,
    PsutilControl,
    SignalResult,
    boot_id,
    run_state,
)
from deviceplugin.enforcer.policy import (
    COMPUTE,
    KILL,
    MEMORY,
    THROTTLE,
    ContainerKey,
    ControllerTuning,
    Decision,
    EnforcementPolicy,
    Kill,
    Record,
    Release,
    SetDuty,
)
from deviceplugin.errors import DevicePluginError
from deviceplugin.model import ContainerUsage, EnforcementCount, NodeSnapshot

log = logging.getLogger(__name__)

STOPPED_RECORD_NAME = "stopped-processes.json"
# How long after a start with a lost record the snapshots are scanned for stopped processes.
STRAY_SCAN_S = 120.0
_RECORD_VERSION = 2
_CLOSE_LOCK_TIMEOUT_S = 5.0
_KILL_OUTCOME = {
    SignalResult.SENT: "true",
    SignalResult.GONE: "false (process gone)",
    SignalResult.DENIED: "false (permission denied)",
}

_Names = tuple[str, str, str, int]  # namespace, pod, container, GPU index


# ContainerUsage's fields in order, read at once; and where the enforcer's three go among them.
# Every container of every snapshot is copied with them filled in: a positional constructor call
# costs about half of dataclasses.replace, which looks the fields up again on every call.
_USAGE_FIELDS = tuple(f.name for f in fields(ContainerUsage))
_usage_values = attrgetter(*_USAGE_FIELDS)
_DUTY = _USAGE_FIELDS.index("duty_cycle_ratio")
_STOPPED = _USAGE_FIELDS.index("throttled_seconds_total")
_ENTITLEMENT = _USAGE_FIELDS.index("entitlement_ratio")
_NOT_THROTTLED: tuple[float | None, float] = (None, 0.0)


def _annotated(
    c: ContainerUsage, duty: float | None, stopped_s: float, entitlement: float | None
) -> ContainerUsage:
    """`c` with the enforcement fields set (dataclasses.replace, faster)."""
    values = list(_usage_values(c))
    values[_DUTY] = duty
    values[_STOPPED] = stopped_s
    values[_ENTITLEMENT] = entitlement
    return ContainerUsage(*values)


class EnforcementError(DevicePluginError):
    """The enforcer cannot go on (its duty-cycle thread failed); everything has been resumed."""


# A record larger than this is not read: the daemon writes a few dozen bytes per process.
_MAX_RECORD_BYTES = 16 << 20
# PIDs are at most 2**22 on Linux.
_MAX_PID = 1 << 22


@dataclass(frozen=True, slots=True)
class StoppedRecord:
    """What a stopped-process record holds: the valid (pid, start ticks) entries, the boot they
    belong to, the entries skipped (why, one line each), and why the whole file could not be
    read, if it could not."""

    entries: tuple[tuple[int, float], ...] = ()
    boot_id: str | None = None
    skipped: tuple[str, ...] = ()
    unreadable: str | None = None


def _entry(entry: object) -> tuple[int, float] | str:
    """One record entry, or why it is skipped."""
    if not isinstance(entry, dict):
        return f"not an object: {_short(entry)}"
    pid = entry.get("pid")
    ticks = entry.get("start_ticks")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < _MAX_PID:
        return f"bad pid: {_short(entry)}"
    if "create_time" in entry and ticks is None:
        return f"a wall-clock creation time (an older record): {_short(entry)}"
    if not isinstance(ticks, int) or isinstance(ticks, bool) or not 0 <= ticks < 1 << 63:
        return f"bad start_ticks: {_short(entry)}"
    return pid, float(ticks)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_stopped_record(path: Path) -> StoppedRecord:
    """Read a stopped-process record entry by entry; never raises. No file: an empty record."""
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return StoppedRecord()
    except OSError as e:
        return StoppedRecord(unreadable=f"{path}: {e.strerror or e}")
    if len(raw) > _MAX_RECORD_BYTES:
        return StoppedRecord(unreadable=f"{path}: larger than {_MAX_RECORD_BYTES} bytes")
    try:
        data: Any = json.loads(raw)
    except RecursionError:
        return StoppedRecord(unreadable=f"{path}: nested too deep")
    except (UnicodeDecodeError, ValueError) as e:
        return StoppedRecord(unreadable=f"{path}: {_short(str(e))}")
    entries = data.get("processes") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return StoppedRecord(unreadable=f'{path}: expected {{"version": 2, "processes": [...]}}')
    boot = data.get("boot_id")
    valid: list[tuple[int, float]] = []
    skipped: list[str] = []
    for entry in entries:
        found = _entry(entry)
        if isinstance(found, str):
            skipped.append(found)
        else:
            valid.append(found)
    return StoppedRecord(tuple(valid), boot if isinstance(boot, str) else None, tuple(skipped))


def read_stopped_record(path: Path) -> list[tuple[int, float]]:
    """The valid (pid, start ticks) pairs of a stopped-process record; [] when there is no file.
    Raises ValueError when the file cannot be read as a record."""
    record = load_stopped_record(path)
    if record.unreadable is not None:
        raise ValueError(record.unreadable)
    return list(record.entries)


def write_stopped_record(
    path: Path, entries: Iterable[tuple[int, float]], *, boot: str | None = None
) -> None:
    """Replace the record atomically (a temporary file, fsync, rename); no entries removes it.
    `boot` is the boot ID the identities belong to (default: this boot's)."""
    items = sorted(entries)
    if not items:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    content = json.dumps(
        {
            "version": _RECORD_VERSION,
            "boot_id": boot_id() if boot is None else boot,
            "processes": [{"pid": pid, "start_ticks": int(ticks)} for pid, ticks in items],
        },
        indent=1,
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _move_aside(path: Path, wall_s: float) -> Path | None:
    """Rename an unreadable record so that nothing overwrites it; its new path, None if that
    failed (logged)."""
    aside = path.with_name(f"{path.name}.unreadable-{int(wall_s)}")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.unreadable-{int(wall_s)}.{n}")
    try:
        path.rename(aside)
    except OSError as e:
        log.error(
            "cannot move the unreadable stopped-process record aside path=%s error=%s",
            path,
            e.strerror or e,
        )
        return None
    return aside


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
    ) -> None:
        self.config = config
        self.policy = EnforcementPolicy(config, tuning)
        self._control: ProcessControl = control if control is not None else PsutilControl()
        self._clock = clock
        self._wall_clock = wall_clock
        self._record_path = Path(state_dir) / STOPPED_RECORD_NAME
        self._cycler = DutyCycler(self._control, config.compute.period_s, clock=clock)
        self._lock = threading.RLock()
        self._closed = False
        self._recovered = False
        # After a lost record: until then (monotonic), stopped GPU processes of allocations are
        # resumed as they appear in snapshots (pod-resources may name them only after a while).
        self._scan_until: float | None = None
        self._scanned: set[int] = set()
        self._recorded: dict[int, float] = {}
        # Processes an earlier run left stopped whose resume was denied: kept in every record.
        self._carried: dict[int, float] = {}
        self._record_problem: str | None = None
        self._signals_denied = 0
        self._counts: dict[tuple[str, str, str, str], int] = {}
        self._names: dict[ContainerKey, _Names] = {}
        # The last poll's annotated usage per container, with what it was made from: handed out
        # again while the snapshot builder hands out the same usage and the figures are equal.
        self._annotations: dict[
            ContainerKey, tuple[ContainerUsage, float | None, float, float | None, ContainerUsage]
        ] = {}
        # The last poll's (containers, duty-cycle figures, policy revision), and the annotated
        # containers made from them.
        self._annotated: tuple[tuple[object, ...], tuple[ContainerUsage, ...]] | None = None
        self._names_from: tuple[ContainerUsage, ...] = ()
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
            self._record_path,
        )

    @property
    def record_path(self) -> Path:
        return self._record_path

    @property
    def cycler(self) -> DutyCycler:
        return self._cycler

    @property
    def signals_denied(self) -> int:
        """How many signals were denied (kills, stops, resumes), in all."""
        with self._lock:
            return self._signals_denied + self._cycler.signals_denied

    # -- start ------------------------------------------------------------------------------

    def recover(self) -> int:
        """Resume every process an earlier run recorded as possibly stopped whose creation time
        still matches; then clear the record, but for the processes whose resume was denied (the
        next start tries them again). Returns how many were resumed.

        This undoes what an earlier run did, so it acts for real even in a dry run."""
        with self._lock:
            self._recovered = True
            entries = self._read_record()
            control = PsutilControl() if self._control.dry_run else self._control
            # What this run itself recorded is not an earlier run's (carried entries are).
            own = {pid: c for pid, c in self._recorded.items() if pid not in self._carried}
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
                    self._signals_denied += 1
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
                    self._carried = denied
                    keep.update(own)
                try:
                    write_stopped_record(self._record_path, keep.items())
                except OSError as e:
                    log.error(
                        "cannot clear the stopped-process record path=%s error=%s",
                        self._record_path,
                        e.strerror or e,
                    )
                else:
                    if not self._control.dry_run:
                        self._recorded = keep
            return resumed

    def _read_record(self) -> list[tuple[int, float]]:
        """The entries of an earlier run's record that belong to this boot. A bad entry is
        skipped and logged; an unreadable file is moved aside. Either way, the first fresh
        snapshot is scanned for stopped processes of this daemon's allocations."""
        record = load_stopped_record(self._record_path)
        if record.unreadable is not None:
            aside = _move_aside(self._record_path, self._wall_clock())
            log.error(
                "stopped-process record unreadable; moved aside, and stopped GPU processes of "
                "this node's allocations will be resumed as polls find them error=%s moved_to=%s",
                record.unreadable,
                aside,
            )
            self._scan_until = self._clock() + STRAY_SCAN_S
        for problem in record.skipped[:10]:
            log.warning("stopped-process record: entry skipped problem=%s", problem)
        if record.skipped:
            log.warning(
                "stopped-process record: entries skipped count=%d; stopped GPU processes of this "
                "node's allocations will be resumed as polls find them",
                len(record.skipped),
            )
            self._scan_until = self._clock() + STRAY_SCAN_S
        if record.entries and record.boot_id != boot_id():
            log.info(
                "stopped-process record is from another boot; its processes are gone count=%d",
                len(record.entries),
            )
            return []
        return list(record.entries)

    def _resume_strays(self, attributed: set[int]) -> None:
        """Resume the stopped (state T) processes among this snapshot's attributed ones that no
        duty cycle of this run holds: after a lost record, they may be ones an earlier run
        stopped. Each PID is looked at once. Acts for real, even in a dry run, as `recover`
        does."""
        ours = self._cycler_pids()
        control = PsutilControl() if self._control.dry_run else self._control
        try:
            for pid in sorted(attributed - ours - self._scanned):
                self._scanned.add(pid)
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
                    self._write_record(self._recorded_for(self._cycler_pids()))
                raise

    def _on_snapshot(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        now = self._clock()
        self._remember_names(snapshot)
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
            if self._scan_until is not None:
                if now <= self._scan_until:
                    self._resume_strays(attributed)
                else:
                    self._scan_until = None
                    self._scanned = set()

        # The record must name every process before it is first stopped.
        planned = set(self._cycler_pids())
        for d in decisions:
            if isinstance(d, SetDuty):
                planned |= d.pids
        if not self._write_record(self._recorded_for(planned)):
            decisions = self._without_new_throttles(decisions)

        for d in decisions:
            self._apply(d)

        self._write_record(self._recorded_for(self._cycler_pids()))
        self._forget_gone(snapshot)
        return self._annotate(snapshot)

    def _cycler_pids(self) -> frozenset[int]:
        """The PIDs the duty cycles may have stopped: those in a group, and those whose resume
        was denied."""
        return self._cycler.pids() | self._cycler.unresumed()

    def _recorded_for(self, pids: Iterable[int]) -> dict[int, float]:
        """The record naming `pids` (those whose identity is known) and the carried entries."""
        result = dict(self._carried)
        for pid in pids:
            created = self._recorded.get(pid)
            if created is None:
                created = self._control.create_time(pid)
            if created is not None:
                result[pid] = created
        return result

    def _write_record(self, entries: Mapping[int, float], *, force: bool = False) -> bool:
        """Write the record if it changed; False (logged once per problem) when it cannot be."""
        if not force and dict(entries) == self._recorded:
            return True
        if self._control.dry_run:
            self._recorded = dict(entries)  # nothing is really stopped: nothing to record
            return True
        try:
            write_stopped_record(self._record_path, entries.items())
        except OSError as e:
            problem = f"{e.strerror or e}"
            if problem != self._record_problem:
                log.error(
                    "cannot write the stopped-process record; no new throttling until it can "
                    "be written path=%s error=%s",
                    self._record_path,
                    problem,
                )
            self._record_problem = problem
            return False
        if self._record_problem is not None:
            log.info("stopped-process record writable again path=%s", self._record_path)
            self._record_problem = None
        self._recorded = dict(entries)
        return True

    def _without_new_throttles(self, decisions: list[Decision]) -> list[Decision]:
        """Drop the duty cycles that would stop processes the record does not name."""
        kept: list[Decision] = []
        for d in decisions:
            if isinstance(d, SetDuty) and not d.pids <= self._recorded.keys():
                self.policy.reset((d.allocation_id, d.gpu_uuid))
                if (d.allocation_id, d.gpu_uuid) in self._cycler.group_keys():
                    kept.append(Release(d.allocation_id, d.gpu_uuid, "record not writable"))
                continue
            kept.append(d)
        return kept

    def _apply(self, d: Decision) -> None:
        dry = self._control.dry_run
        if isinstance(d, Kill):
            key = (d.allocation_id, d.gpu_uuid)
            result = self._control.send(d.pid, signal.SIGKILL)
            if result is SignalResult.DENIED:
                self._signals_denied += 1
            self._count(key, MEMORY, KILL)
            ns, pod, container, index = self._names_of(key)
            log.warning(
                "memory limit exceeded action=kill namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=%d used_bytes=%d limit_bytes=%d "
                "process_used_bytes=%d over_for_s=%.2f sent=%s dry_run=%s",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                d.pid,
                d.used_bytes,
                d.limit_bytes,
                d.process_used_bytes,
                d.over_for_s,
                _KILL_OUTCOME[result],
                dry,
            )
        elif isinstance(d, SetDuty):
            key = (d.allocation_id, d.gpu_uuid)
            self._cycler.set(key, d.pids, d.duty)
            if d.started:
                self._count(key, COMPUTE, THROTTLE)
            ns, pod, container, index = self._names_of(key)
            log.log(
                logging.WARNING if d.started else logging.DEBUG,
                "compute share %s action=throttle namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=%s used_ratio=%.3f limit_ratio=%.3f "
                "share_ratio=%.3f duty=%.3f dry_run=%s",
                "exceeded" if d.started else "throttled",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                ",".join(str(p) for p in sorted(d.pids)),
                d.used_ratio,
                d.limit_ratio,
                d.share_ratio,
                d.duty,
                dry,
            )
        elif isinstance(d, Release):
            key = (d.allocation_id, d.gpu_uuid)
            self._cycler.release(key)
            ns, pod, container, index = self._names_of(key)
            log.warning(
                "compute throttle released action=resume namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d throttled_s=%.2f reason=%r dry_run=%s",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                self._cycler.stopped_seconds(key),
                d.reason,
                dry,
            )
        else:
            self._record(d)

    def _record(self, d: Record) -> None:
        key = (d.allocation_id, d.gpu_uuid)
        self._count(key, d.kind, d.action)
        ns, pod, container, index = self._names_of(key)
        if d.kind == MEMORY:
            log.warning(
                "memory limit exceeded action=monitor namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=%s used_bytes=%d limit_bytes=%d reason=%r",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                d.pid if d.pid is not None else "-",
                int(d.used),
                int(d.limit),
                d.reason,
            )
        else:
            log.warning(
                "compute share exceeded action=monitor namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=- used_ratio=%.3f limit_ratio=%.3f "
                "reason=%r",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                d.used,
                min(d.limit, 1.0),
                d.reason,
            )

    def _count(self, key: ContainerKey, kind: str, action: str) -> None:
        index = (key[0], key[1], kind, action)
        self._counts[index] = self._counts.get(index, 0) + 1

    def _remember_names(self, snapshot: NodeSnapshot) -> None:
        if snapshot.containers == self._names_from:
            return  # the same containers as last time: nothing new to remember
        self._names_from = snapshot.containers
        for c in snapshot.containers:
            self._names[(c.allocation_id, c.gpu_uuid)] = (
                c.namespace,
                c.pod,
                c.container,
                c.gpu_index,
            )

    def _names_of(self, key: ContainerKey) -> _Names:
        return self._names.get(key, ("", "", "", -1))

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
        for index in [i for i in self._counts if i[0] not in live]:
            del self._counts[index]
        for key in [k for k in self._names if k[0] not in live]:
            del self._names[key]
            self._cycler.forget(key)

    def _annotate(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        figures = self._cycler.figures()
        # The same containers, duty cycles and policy state as last time (a steady node): the
        # same annotated containers.
        inputs = (snapshot.containers, figures, self.policy.revision)
        if self._annotated is not None and self._annotated[0] == inputs:
            return replace(snapshot, containers=self._annotated[1], enforcement=self.counts())
        entitlement = self.policy.entitlement
        previous = self._annotations
        annotations: dict[
            ContainerKey, tuple[ContainerUsage, float | None, float, float | None, ContainerUsage]
        ] = {}
        containers: list[ContainerUsage] = []
        for c in snapshot.containers:
            key = (c.allocation_id, c.gpu_uuid)
            duty, stopped_s = figures.get(key, _NOT_THROTTLED)
            entitled = entitlement(key)
            kept = previous.get(key)
            if (
                kept is not None
                and kept[0] is c
                and kept[1] == duty
                and kept[2] == stopped_s
                and kept[3] == entitled
            ):
                annotated = kept[4]
            else:
                annotated = _annotated(c, duty, stopped_s, entitled)
            annotations[key] = (c, duty, stopped_s, entitled, annotated)
            containers.append(annotated)
        self._annotations = annotations
        self._annotated = (inputs, tuple(containers))
        return replace(snapshot, containers=self._annotated[1], enforcement=self.counts())

    def counts(self) -> tuple[EnforcementCount, ...]:
        """Every enforcement count so far, for containers whose allocation still exists."""
        with self._lock:
            items = sorted(self._counts.items())
        result: list[EnforcementCount] = []
        for (allocation, gpu, kind, action), count in items:
            ns, pod, container, _ = self._names_of((allocation, gpu))
            result.append(
                EnforcementCount(allocation, gpu, kind, action, count, ns, pod, container)
            )
        return tuple(result)

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
            left = self._recorded_for(self._cycler.unresumed())
            with contextlib.suppress(OSError):
                self._write_record(left, force=True)
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
