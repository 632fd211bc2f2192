"""Directories and files under paths that a config names, opened without following a symlink;
and state files read back bounded, never through a symlink.

The daemon runs as root, and a config (a ConfigMap that people other than the node's owner may
edit) names some of the paths it writes. Every such path is walked one component at a time from
`/` with `openat(O_DIRECTORY | O_NOFOLLOW)`: a symbolic link anywhere on the way is refused, not
followed. A component that is missing is created (`mkdirat`), and only a directory created here
is given the mode its caller asks for (`fchmod` on the open directory, never chmod by name): a
directory that was there before keeps its owner and mode, whatever the config says.

Files the daemon reads that others could plant something at (the kubelet's checkpoint, the DRA
checkpoint, a node feature file) are read through one bounded reader, `read_bounded`: opened
without following a symbolic link and without blocking (a FIFO or a device planted at the name
is refused, never read), a regular file only, of at most the caller's bound, and no more than
that is ever read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path that passes through a symbolic link or something that is not a directory."""


@dataclass(frozen=True, slots=True)
class OpenDirectory:
    """An open directory: `fd` (the caller closes it) and whether this call created it."""

    fd: int
    created: bool


def open_directory(path: str, *, create: bool, mode: int = 0o755) -> OpenDirectory:
    """Open the absolute `path` one component at a time, never through a symbolic link.

    With `create`, missing components are made; the last one, when made here, is given `mode`
    exactly (through its descriptor, whatever the umask); the parents made on the way get 0755.
    Raises UnsafePathError naming the component that is a symbolic link or not a directory, and
    OSError for the rest (FileNotFoundError without `create`)."""
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts:
        raise UnsafePathError(errno.EINVAL, f"{path} is not an absolute path without ..")
    fd = os.open("/", DIRECTORY_FLAGS)
    created = False
    walked = PurePosixPath("/")
    try:
        for name in pure.parts[1:]:
            walked = walked / name
            created = False
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                    created = True
                child = _open_child(name, fd, walked)
                if created:
                    os.fchmod(child, mode if walked == pure else 0o755)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(
                        e.errno, f"{walked} is a symbolic link or not a directory"
                    ) from e
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return OpenDirectory(fd=fd, created=created)


def _open_child(name: str, parent: int, walked: PurePosixPath) -> int:
    try:
        return os.open(name, DIRECTORY_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(e.errno, f"{walked} is a symbolic link or not a directory") from e
        raise


class RefusedFileError(OSError):
    """A file that is there but is not read: a symbolic link, not a regular file, or larger
    than its bound. `strerror` says which, naming the file."""


def open_regular(
    name: str | os.PathLike[str], *, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """Open the regular file `name` (relative to `dir_fd` when given) for reading, without
    following a symbolic link at its last component and without blocking; its descriptor (the
    caller closes it) and its stat. FileNotFoundError when it is missing; RefusedFileError for a
    symbolic link or anything but a regular file (a FIFO, a device, a socket, a directory)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RefusedFileError(errno.ELOOP, f"{name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFileError(
                errno.EINVAL, f"{name} is not a regular file (mode {stat.filemode(st.st_mode)})"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_at_most(fd: int, limit: int) -> bytearray:
    """Up to `limit` bytes from `fd`, in one buffer of at most that size."""
    buffer = bytearray()
    while len(buffer) < limit:
        chunk = os.read(fd, min(1 << 20, limit - len(buffer)))
        if not chunk:
            break
        buffer += chunk
    return buffer


def read_open(fd: int, st: os.stat_result, name: object, max_bytes: int) -> bytes:
    """The content of the regular file open at `fd` (`st` its stat), of at most `max_bytes`;
    RefusedFileError naming `name` when it is larger, or grows larger while it is read."""
    too_large = f"{name} is more than {max_bytes} bytes"
    if st.st_size > max_bytes:
        raise RefusedFileError(errno.EFBIG, f"{too_large} ({st.st_size})")
    blob = read_at_most(fd, max_bytes + 1)
    if len(blob) > max_bytes:
        raise RefusedFileError(errno.EFBIG, too_large)
    return bytes(blob)


def read_bounded(
    name: str | os.PathLike[str], max_bytes: int, *, dir_fd: int | None = None
) -> bytes:
    """The content of the regular file `name` (see `open_regular`), of at most `max_bytes`.
    FileNotFoundError when it is missing, RefusedFileError when it is not read (why, naming
    it), another OSError when reading failed."""
    fd, st = open_regular(name, dir_fd=dir_fd)
    try:
        return read_open(fd, st, name, max_bytes)
    finally:
        os.close(fd)
