"""Directories and files under paths that a config names, opened without following a symlink;
and state files read back bounded, never through a symlink.

The daemon runs as root, and a config (a ConfigMap that people other than the node's owner may
edit) names some of the paths it writes. Every such path is walked one component at a time from
`/` with `openat(O_DIRECTORY | O_NOFOLLOW)`: a symbolic link anywhere on the way is refused, not
followed. A component that is missing is created (`mkdirat`), and only a directory created here
is given the mode its caller asks for (`fchmod` on the open directory, never chmod by name): a
directory that was there before keeps its owner and mode, whatever the config says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def replace_file(
    dir_fd: int, name: str, data: bytes, mode: int, *, sync: bool = True
) -> os.stat_result:
    """Replace the file `name` in the open directory `dir_fd` with `data`, mode `mode` exactly
    (whatever the umask); the new file's stat.

    The data goes to a new hidden file of a random name, created with O_EXCL | O_NOFOLLOW in
    that directory, which is then renamed over `name`: whatever was at `name` (a symlink
    included) is replaced, never written through, and a failure leaves no temporary behind.
    With `sync` (the default) the data is on disk before the rename; without, the caller syncs
    the file and the directory itself when it can wait for the disk."""
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


def read_at_most(fd: int, limit: int) -> bytearray:
    """Up to `limit` bytes from `fd`, in one buffer of at most that size."""
    buffer = bytearray()
    while len(buffer) < limit:
        chunk = os.read(fd, min(1 << 20, limit - len(buffer)))
        if not chunk:
            break
        buffer += chunk
    return buffer


def read_regular_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The content of the regular file at `path`, of at most `max_bytes`, opened without
    following a symbolic link (at its last component) and without blocking: a FIFO or a device
    planted there is refused, never read, and no more than `max_bytes` is ever read.

    Raises FileNotFoundError when there is no file, UnsafePathError (naming the path) for a
    symbolic link, something that is not a regular file, or a file larger than `max_bytes`, and
    OSError for the rest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(e.errno, f"{path} is a symbolic link") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                errno.EINVAL,
                f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})",
            )
        data = read_at_most(fd, max_bytes + 1) if st.st_size <= max_bytes else b""
        if st.st_size > max_bytes or len(data) > max_bytes:
            raise UnsafePathError(errno.EFBIG, f"{path} is more than {max_bytes} bytes")
        return bytes(data)
    finally:
        os.close(fd)
