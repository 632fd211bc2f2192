"""Files written whole or not at all: the one atomic writer of the daemon's state directory
(the DRA claims' checkpoint and CDI specs, the allocations' grants, the memory-limit record,
the stopped-process record) and of the other files it replaces (a node feature file, the fake
GPUs' state).

A file is written to a fresh hidden temporary name (O_EXCL | O_NOFOLLOW: never an existing
file, never through a symlink) in the same directory, optionally synced, then renamed over the
target: a reader sees the old file or the new one, never half of either, and a failure leaves
no temporary behind. The directory is opened without following a symlink at its last
component, and every name is resolved relative to it.

What a writer chooses: the file's `mode` (exact, whatever the umask), whether the directory is
made when missing (`create`, owner-only), and `sync`: the data and the directory on disk before
the call returns (a checkpoint that must outlive the machine), or neither (a file that need not:
the reader still sees the old file or the new one; `sync_file` later, off the hot path, when the
disk can be waited for).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from deviceplugin.safefs import DIRECTORY_FLAGS, read_bounded


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The kernel's ID of this boot, which the records of processes and cgroups carry (a PID or
    a cgroup of another boot is not this one's); "" where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def replace_file(
    dir_fd: int, name: str, data: bytes, mode: int, *, sync: bool = True
) -> os.stat_result:
    """Replace the file `name` in the open directory `dir_fd` with `data`, mode `mode` exactly;
    the new file's stat. With `sync` the data is on disk before the rename (the caller syncs
    the directory); without, a reader still sees the old file or the new one.

    Whatever was at `name` (a symlink included) is replaced, never written through."""
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(
        temporary,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        mode,
        dir_fd=dir_fd,
    )
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    return written


def open_dir(directory: Path, *, create: bool = True) -> int:
    """A descriptor of `directory` (made owner-only, with its parents, when missing and
    `create`); OSError if it is a symlink, FileNotFoundError when missing without `create`."""
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(directory, DIRECTORY_FLAGS)


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")


def write_file(
    directory: Path,
    name: str,
    data: bytes,
    *,
    mode: int = 0o600,
    sync: bool = True,
    create: bool = True,
) -> None:
    """Replace `directory/name` with `data` (see the module's docstring for the options)."""
    _check_name(name)
    dir_fd = open_dir(directory, create=create)
    try:
        replace_file(dir_fd, name, data, mode, sync=sync)
        if sync:
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sync_file(directory: Path, name: str) -> None:
    """`directory/name` and the directory to disk (a file written with `sync=False`, once the
    disk can be waited for). OSError when either cannot be opened or synced."""
    _check_name(name)
    dir_fd = open_dir(directory, create=False)
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
        )
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_file(directory: Path, name: str, max_bytes: int) -> bytes | None:
    """`directory/name`'s content, None when it does not exist. Read by `safefs.read_bounded`:
    never through a symlink, never blocking on a FIFO, a regular file of at most `max_bytes`;
    RefusedFileError (an OSError) saying why it is not read."""
    _check_name(name)
    try:
        dir_fd = open_dir(directory, create=False)
    except FileNotFoundError:
        return None
    try:
        return read_bounded(name, max_bytes, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)


def move_aside(directory: Path, name: str, suffix: str) -> str:
    """Move `directory/name` (whatever it is: a symlink or a FIFO is moved, not followed or
    opened) to a new name `<name>.<suffix>` (`.1`, `.2`... appended when taken), never over an
    existing file; that name. OSError when it cannot be moved."""
    _check_name(name)
    dir_fd = open_dir(directory, create=False)
    try:
        for n in range(1000):
            aside = f"{name}.{suffix}" + (f".{n}" if n else "")
            try:
                # A new link, then the old name removed: unlike a rename, never over a file.
                os.link(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                continue
            os.unlink(name, dir_fd=dir_fd)
            os.fsync(dir_fd)
            return aside
        raise FileExistsError(f"{directory}: no free name for {name}.{suffix}")
    finally:
        os.close(dir_fd)


def remove_file(directory: Path, name: str) -> bool:
    """Remove `directory/name` (a symlink there is removed, not followed); whether it was there."""
    _check_name(name)
    try:
        dir_fd = open_dir(directory, create=False)
    except FileNotFoundError:
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)


def list_files(directory: Path, prefix: str) -> list[str]:
    try:
        dir_fd = open_dir(directory, create=False)
    except FileNotFoundError:
        return []
    try:
        return sorted(n for n in os.listdir(dir_fd) if n.startswith(prefix))
    finally:
        os.close(dir_fd)
