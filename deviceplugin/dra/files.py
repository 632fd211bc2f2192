"""Owner-only files in a directory the daemon was given, written whole or not at all.

A file is written to a fresh temporary name (O_EXCL: never an existing file, never through a
symlink) in the same directory, synced, then renamed over the target; the directory itself is
opened without following a symlink at its last component, and every name is resolved relative
to it. A reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import os
from pathlib import Path

from deviceplugin.safefs import replace_file


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


def read_file(directory: Path, name: str) -> bytes | None:
    """`directory/name`'s content, None when it does not exist; never through a symlink."""
    _check_name(name)
    try:
        dir_fd = open_dir(directory, create=False)
    except FileNotFoundError:
        return None
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()
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
