"""The stopped-process record: every process the enforcer may stop, written to
`<state dir>/stopped-processes.json` with its identity (its start time in clock ticks since boot,
and the boot ID) before it is first stopped, so that a daemon killed outright leaves nothing
stopped for longer than its restart. Read with the shared bounded reader (`safefs.read_bounded`:
no symlink followed, no FIFO waited on), entry by entry (a bad one is skipped, every valid one
kept); an unreadable file is moved aside, never overwritten. Written atomically."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin import statefiles
from deviceplugin.safefs import RefusedFileError, read_bounded
from deviceplugin.statefiles import boot_id, write_file

log = logging.getLogger("deviceplugin.enforcer.enforcer")

STOPPED_RECORD_NAME = "stopped-processes.json"
_RECORD_VERSION = 2
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
        # The shared bounded reader: a FIFO or a device planted at the name is refused, never
        # waited on; a symlink is not followed; no more than the bound is read.
        raw = read_bounded(path, _MAX_RECORD_BYTES)
    except FileNotFoundError:
        return StoppedRecord()
    except RefusedFileError as e:
        return StoppedRecord(unreadable=str(e.strerror))
    except OSError as e:
        return StoppedRecord(unreadable=f"{path}: {e.strerror or e}")
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
    """Replace the record atomically and durably (`statefiles`); no entries removes it.
    `boot` is the boot ID the identities belong to (default: this boot's)."""
    items = sorted(entries)
    if not items:
        path.unlink(missing_ok=True)
        return
    content = json.dumps(
        {
            "version": _RECORD_VERSION,
            "boot_id": boot_id() if boot is None else boot,
            "processes": [{"pid": pid, "start_ticks": int(ticks)} for pid, ticks in items],
        },
        indent=1,
    )
    write_file(path.parent, path.name, (content + "\n").encode())


def move_aside(path: Path, wall_s: float) -> Path | None:
    """Rename an unreadable record so that nothing overwrites it (`statefiles.move_aside`); its
    new path, None if that failed (logged)."""
    try:
        aside = path.with_name(
            statefiles.move_aside(path.parent, path.name, f"unreadable-{int(wall_s)}")
        )
    except OSError as e:
        log.error(
            "cannot move the unreadable stopped-process record aside path=%s error=%s",
            path,
            e.strerror or e,
        )
        return None
    return aside
