"""The MPS directories: `<mps.root>`, its `pipe`, `log` and `shm`, and the control daemon's PID
file and output file in them.

They are opened component by component without following a symbolic link (deviceplugin.safefs).
Only a directory created here is given its mode (0755; `shm` 1777 like /dev/shm); one that was
there before keeps its mode, except `shm` when it is this daemon's own /dev/shm (a mount the
DaemonSet made, not a path the config chose).

Shared memory: an MPS client and its server exchange data through files in `/dev/shm`, so a
client must see the server's `/dev/shm`. The server inherits it from the control daemon, which
inherits it from this daemon; the DaemonSet's MPS component mounts `<mps.root>/shm` there, and
Allocate mounts the same directory at each container's `/dev/shm`. `prepare` checks that this
daemon's own `/dev/shm` is that directory, and says so in the log (once) when it is not.

The PID file the control daemon writes (`<pipe>/nvidia-cuda-mps-control.pid`) sits in a
directory that MPS clients see: it is read without following a symbolic link or blocking on a
FIFO, and never taken on its word (deviceplugin.gpu.mps.process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from deviceplugin.allocation import mps_log_directory, mps_pipe_directory, mps_shm_directory
from deviceplugin.gpu.mps.runner import MpsPathError
from deviceplugin.safefs import open_directory

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
OUTPUT_FILE = "control-output.log"
DEFAULT_SHM_PATH = Path("/dev/shm")  # noqa: S108 (where MPS shares memory, not a temp file)


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _fd_is(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class MpsDirectories:
    """`<root>`, `<root>/pipe`, `<root>/log`, `<root>/shm`, and this daemon's /dev/shm."""

    def __init__(self, root: str, shm_path: Path = DEFAULT_SHM_PATH) -> None:
        self.root = Path(root)
        self.pipe = Path(mps_pipe_directory(root))
        self.log = Path(mps_log_directory(root))
        self.shm = Path(mps_shm_directory(root))
        self.shm_path = shm_path
        self._shm_warned = False

    def prepare(self) -> None:
        """Open (creating where missing) the four directories without following a link.
        Raises MpsPathError."""
        opened: list[int] = []
        try:
            for directory, mode in (
                (self.root, 0o755),
                (self.pipe, 0o755),
                (self.log, 0o755),
                (self.shm, 0o1777),
            ):
                # Not owner-only, unlike the daemon's own files: clients of any user enter the
                # pipe directory, and MPS servers run as their clients' users and create files
                # in shm, like /dev/shm.
                handle = open_directory(str(directory), create=True, mode=mode)
                opened.append(handle.fd)
                if not handle.created:
                    self._check_existing(directory, handle.fd, mode)
        except OSError as e:
            raise MpsPathError(
                f"cannot create the MPS directories under {self.root}: {e.strerror or e}; "
                "set mps.root to a directory without symbolic links in its path (the "
                "DaemonSet's MPS component mounts it)"
            ) from e
        finally:
            for fd in opened:
                close_quietly(fd)
        try:
            same = os.path.samefile(self.shm_path, self.shm)
        except OSError:
            same = False
        if not same and not self._shm_warned:
            self._shm_warned = True
            log.warning(
                "MPS clients get %s at /dev/shm, but this daemon's %s is another directory: "
                "the MPS server will not share memory with them; mount %s at %s (the "
                "DaemonSet's MPS component does)",
                self.shm,
                self.shm_path,
                self.shm,
                self.shm_path,
            )

    def _check_existing(self, directory: Path, fd: int, mode: int) -> None:
        """A directory that was there before keeps its mode: only the daemon's own /dev/shm
        (the DaemonSet's mount) is opened up like /dev/shm. Anything narrower is logged."""
        now = stat.S_IMODE(os.fstat(fd).st_mode)
        if now & mode == mode:
            return
        if directory == self.shm and _fd_is(fd, self.shm_path):
            os.fchmod(fd, now | mode)
            return
        log.warning(
            "an MPS directory that this daemon did not create is left as it is: its mode is "
            "%04o, MPS clients and servers of other users need %04o; change it by hand if they "
            "must reach it path=%s",
            now,
            mode,
            directory,
        )

    def output_file(self) -> int:
        """`<log>/control-output.log`, opened for appending (created 0644), never through a
        link: the control daemon's stdout and stderr."""
        handle = open_directory(str(self.log), create=True)
        try:
            return os.open(
                OUTPUT_FILE,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=handle.fd,
            )
        finally:
            os.close(handle.fd)

    def read_pid_file(self) -> int | None:
        """The PID in the PID file: a regular file, read without following a symlink or
        blocking on a FIFO, at most 64 bytes."""
        try:
            fd = os.open(
                self.pipe / PID_FILE,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            )
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return int(os.read(fd, 64).strip())
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def remove_pid_file(self) -> None:
        """Remove the PID file (the link itself, never what a link points to)."""
        handle = open_directory(str(self.pipe), create=False)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(PID_FILE, dir_fd=handle.fd)
        finally:
            os.close(handle.fd)
