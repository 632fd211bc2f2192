"""Owner-only files in a directory the daemon was given, written whole or not at all.

A file is written to a fresh temporary name (O_EXCL: never an existing file, never through a
symlink) in the same directory, synced, then renamed over the target; the directory itself is
opened without following a symlink at its last component, and every name is resolved relative
to it. A reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import os
from pathlib import Path

from deviceplugin.safefs import read_bounded, replace_file


def open_dir(directory: Path, *, create: bool = True) -> int:
    """A descriptor of `directory` (made owner-only when missing); OSError if it is a symlink."""
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")


def write_file(directory: Path, name: str, data: bytes) -> None:
    """Replace `directory/name` with `data`, owner-only (0600)."""
    _check_name(name)
    dir_fd = open_dir(directory)
    try:
        replace_file(dir_fd, name, data, 0o600)
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
