"""Which allocation a GPU process belongs to, read from /proc; whether the daemon sees host PIDs.

Allocate gives every container `VGPU_ALLOCATION_ID` (DESIGN 3). The GPU driver lists processes by
host PID, so the daemon reads `/proc/<pid>/environ` of each GPU process for that one variable, and
falls back to the nearest ancestor that has it (a process started with a cleared environment still
belongs to the container that started it). Nothing else from a process environment is kept,
returned or logged: it may hold secrets.

Everything is read under an injected `proc_root`, so tests use a fake tree in a temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ENV_NAME = "VGPU_ALLOCATION_ID"
_ENV_PREFIX = ENV_NAME.encode() + b"="
_ALLOCATION_ID_LENGTH = 16
_HEX_DIGITS = frozenset(b"0123456789abcdef")
_READ_CHUNK = 65536
# Fields of /proc/<pid>/stat counted after the ")" that closes the command name: field 3 (the run
# state) is index 0 there, so field 4 (ppid) is index 1 and field 22 (start time) is index 19.
_PPID_FIELD = 1
_START_TIME_FIELD = 19


class _GoneError(Exception):
    """The process exited, or its /proc entry cannot be read right now: try again next call."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """A resolved process.

    `identity` is the (inode, ctime) of its stat file when that file is a procfs one (size 0):
    procfs gives every process its own inodes, so an unchanged identity proves the same process
    without reading the file again. `settled` is False after a first look found the process's own
    environment empty: that is a process started with a cleared environment, or one caught in the
    middle of exec (the kernel shows the new environment only once the new program is mapped), so
    the next call looks again before the answer is served from the cache."""

    start_time: int
    allocation_id: str | None
    identity: tuple[int, int] | None
    settled: bool = True


def _read_all(path: str) -> tuple[bytes, os.stat_result]:
    """The whole content of a file and its fstat. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        data = os.read(fd, _READ_CHUNK)
        if len(data) < _READ_CHUNK:
            # A short read is the whole file, for procfs and regular files alike.
            return data, st
        chunks = [data]
        while chunk := os.read(fd, _READ_CHUNK):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), st


def _allocation_id_in(environ: bytes) -> tuple[bool, str | None]:
    """Find VGPU_ALLOCATION_ID in a NUL-separated environment block: (present, valid value).

    A value that is not 16 lowercase hex digits was not set by Allocate: present, but None."""
    if environ.startswith(_ENV_PREFIX):
        start = len(_ENV_PREFIX)
    else:
        at = environ.find(b"\0" + _ENV_PREFIX)
        if at < 0:
            return False, None
        start = at + 1 + len(_ENV_PREFIX)
    end = environ.find(b"\0", start)
    value = environ[start:] if end < 0 else environ[start:end]
    if len(value) != _ALLOCATION_ID_LENGTH or not _HEX_DIGITS.issuperset(value):
        return True, None
    return True, value.decode("ascii")


class AllocationResolver:
    """Maps GPU process PIDs to the allocation IDs found in their (or an ancestor's) environment.

    Results are cached per (pid, start time), so a recycled PID is resolved afresh; the cache holds
    only the PIDs of the latest call. `hits` and `misses` count the PIDs served from the cache and
    those resolved afresh."""

    def __init__(self, proc_root: Path = Path("/proc"), *, max_ancestors: int = 16) -> None:
        if max_ancestors < 0:
            raise ValueError(f"max_ancestors must be >= 0, got {max_ancestors}")
        self._root = str(proc_root)
        self._max_ancestors = max_ancestors
        self._cache: dict[int, _Entry] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """How many PIDs the cache holds."""
        return len(self._cache)

    def resolve(self, pids: Iterable[int]) -> dict[int, str | None]:
        """The allocation ID of each PID, or None: not found, or not readable now (a vanished or
        unreadable process is not cached, so that the next call tries again)."""
        previous = self._cache
        fresh: dict[int, _Entry] = {}
        found: dict[int, str | None] = {}
        # Ancestors resolved during this call, shared by siblings.
        memo: dict[int, str | None] = {}
        for pid in pids:
            if pid in found:
                continue
            found[pid] = None
            if pid <= 0:
                continue
            try:
                entry, hit = self._lookup(pid, previous.get(pid), memo)
            except _GoneError:
                self.misses += 1
                continue
            if hit:
                self.hits += 1
            else:
                self.misses += 1
            fresh[pid] = entry
            found[pid] = entry.allocation_id
        self._cache = fresh
        return found

    def _lookup(
        self, pid: int, cached: _Entry | None, memo: dict[int, str | None]
    ) -> tuple[_Entry, bool]:
        """The entry for `pid`, and whether it came from the cache. Raises _GoneError."""
        stat_path = f"{self._root}/{pid}/stat"
        if cached is not None and cached.settled and cached.identity is not None:
            try:
                st = os.stat(stat_path)
            except OSError as e:
                raise _GoneError from e
            if st.st_size == 0 and (st.st_ino, st.st_ctime_ns) == cached.identity:
                return cached, True
        ppid, start_time, identity = self._stat(stat_path)
        same_process = cached is not None and cached.start_time == start_time
        if cached is not None and same_process and cached.settled:
            if cached.identity != identity:
                cached = _Entry(start_time, cached.allocation_id, identity)
            return cached, True
        allocation, own_environ_empty = self._search(pid, ppid, memo)
        settled = same_process or not own_environ_empty  # a second look is final
        return _Entry(start_time, allocation, identity, settled), False

    def _stat(self, path: str) -> tuple[int, int, tuple[int, int] | None]:
        """(ppid, start time, procfs identity) from a stat file. Raises _GoneError."""
        try:
            data, st = _read_all(path)
        except OSError as e:
            raise _GoneError from e
        fields = data[data.rfind(b")") + 1 :].split()
        try:
            ppid = int(fields[_PPID_FIELD])
            start_time = int(fields[_START_TIME_FIELD])
        except (IndexError, ValueError) as e:
            raise _GoneError from e
        identity = (st.st_ino, st.st_ctime_ns) if st.st_size == 0 else None
        return ppid, start_time, identity

    def _environ(self, pid: int) -> tuple[bool, str | None, bool]:
        """Whether the process's environment sets the variable, its valid value, and whether the
        environment is empty."""
        try:
            environ, _ = _read_all(f"{self._root}/{pid}/environ")
        except OSError as e:
            raise _GoneError from e
        present, value = _allocation_id_in(environ)
        return present, value, not environ

    def _search(self, pid: int, ppid: int, memo: dict[int, str | None]) -> tuple[str | None, bool]:
        """The variable of `pid`, else of its nearest ancestor below PID 1 that sets it, at most
        `max_ancestors` generations up; and whether the environment of `pid` itself is empty."""
        chain: list[int] = []
        current, parent = pid, ppid
        value: str | None = None
        own_environ_empty = False
        for generation in range(self._max_ancestors + 1):
            if current in memo:
                value = memo[current]
                break
            chain.append(current)
            present, value, empty = self._environ(current)
            if generation == 0:
                own_environ_empty = empty
            if present or parent <= 1 or parent == current:
                break
            if generation == self._max_ancestors:
                # Out of generations: not a definitive answer for the ancestors, so not memoised.
                return None, own_environ_empty
            current = parent
            parent = self._stat(f"{self._root}/{current}/stat")[0]
        for member in chain:
            memo[member] = value
        return value, own_environ_empty


_HOST_PID_WARNING = (
    "this daemon runs in its own PID namespace (NSpid: {ids}), but the GPU driver reports "
    "processes by their host PID: GPU processes cannot be attributed to containers and quotas "
    "cannot be enforced; run the daemon's pod with hostPID: true"
)


def pid_namespace_warning(proc_root: Path = Path("/proc")) -> str | None:
    """None when this process shares the host's PID namespace (or that cannot be told); otherwise
    a one-line warning. A nested PID namespace shows as more than one number on the `NSpid:` line
    of /proc/self/status."""
    try:
        status = (proc_root / "self" / "status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            if len(ids) > 1:
                return _HOST_PID_WARNING.format(ids=" ".join(ids))
            return None
    return None
