"""The daemon's state directory: owner-only, and held by one daemon at a time.

Whoever can write the state directory can name the processes the root daemon resumes, so a
directory that other users can write is refused. The daemon holds an exclusive lock on
`<state dir>/vgpu.lock` (with its PID written in it) for as long as it runs: a second daemon
pointed at the same directory would delete the first one's sockets in the device-plugin
directory, so it exits at once naming the first one's PID instead. The lock is the kernel's
(flock), so it goes with the process however it ends; the file itself stays."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from deviceplugin.errors import StartupError

LOCK_NAME = "vgpu.lock"


def writable_by_others(st: os.stat_result) -> str | None:
    """Why a file or directory with this status can be written by users other than this
    process's, or None."""
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets the group or others write it"
    return None


class StateDirLock:
    """The lock on a state directory; `release` (or exit) lets the next daemon take it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def make_state_dir(state_dir: Path) -> Path:
    """`state_dir`, made if missing; StartupError saying what to do when it cannot be."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(
            f"cannot create the state directory {state_dir}: {e.strerror or e}; "
            "set --state-dir to a writable directory"
        ) from e
    return state_dir


def claim_state_dir(state_dir: Path) -> StateDirLock:
    """Create the state directory (owner-only) if needed, check that no other user can write
    it, and lock it for this daemon. Raises StartupError saying what to do."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(state_dir)
    except OSError as e:
        raise StartupError(
            f"cannot create the state directory {state_dir}: {e.strerror or e}; "
            "set --state-dir to a writable directory"
        ) from e
    why = writable_by_others(st)
    if why is not None:
        raise StartupError(
            f"the state directory {state_dir} can be written by other users ({why}): whoever "
            f"writes it can have this daemon signal processes; chmod 700 {state_dir} and chown "
            "it to the daemon's user, or set --state-dir to a directory only it can write"
        )
    path = state_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise StartupError(f"cannot open the lock file {path}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = b""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 32, 0).strip()
        os.close(fd)
        pid = holder.decode("ascii", "replace") if holder.isdigit() else "unknown"
        raise StartupError(
            f"another vgpu daemon (pid {pid}) is running with the state directory {state_dir} "
            f"(it holds {path}); run one daemon per node, or give each its own --state-dir and "
            "--device-plugin-dir"
        ) from None
    except OSError as e:
        os.close(fd)
        raise StartupError(f"cannot lock {path}: {e.strerror or e}") from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateDirLock(path, fd)


def check_state_file(path: Path) -> None:
    """Refuse a fake GPU state file that other users can write: it names the processes the
    daemon signals. Raises StartupError; a missing file is left to the backend to report."""
    try:
        st = os.stat(path)
    except OSError:
        return
    why = writable_by_others(st)
    if why is not None:
        raise StartupError(
            f"the fake GPU state file {path} can be written by other users ({why}): whoever "
            f"writes it can have this daemon signal processes; chmod go-w {path} and chown it "
            "to the daemon's user"
        )
