"""Reading /proc for the resolver (`usage.procs`): whole files, the allocation IDs in an
environment block, pidfds held over resolved processes, and whether this daemon sees host PIDs.
Nothing of a process environment but `VGPU_ALLOCATION_ID` and the per-device
`VGPU_ALLOCATION_ID_<suffix>` (their valid values, at most `MAX_DEVICE_TAGS` of the latter) is
kept or returned."""

from __future__ import annotations

import errno
import os
import resource
import select
from pathlib import Path

from deviceplugin.usage.tags import DeviceTags, Tag

ENV_NAME = "VGPU_ALLOCATION_ID"
_ENV_PREFIX = ENV_NAME.encode() + b"="
_DEVICE_PREFIX = ENV_NAME.encode() + b"_"
# A device's suffix (`allocation.device_env_suffix`): a GPU or MIG UUID is 40 characters, the
# older MIG form ("MIG-GPU-<uuid>/<gi>/<ci>") about 50. Longer ones, or any other characters,
# name no device of any node and are skipped.
_MAX_SUFFIX_LENGTH = 96
_SUFFIX_CHARACTERS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
# At most this many per-device keys are kept from one environment (8 GPUs of 7 MIG devices each
# and their parents fit); the rest are skipped.
MAX_DEVICE_TAGS = 128
_ALLOCATION_ID_LENGTH = 16
_HEX_DIGITS = frozenset(b"0123456789abcdef")
_READ_CHUNK = 65536


def read_all(path: str) -> tuple[bytes, os.stat_result]:
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


def allocation_id_in(environ: bytes) -> tuple[bool, str | None]:
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
    return True, _valid(value)


def _valid(value: bytes) -> str | None:
    if len(value) != _ALLOCATION_ID_LENGTH or not _HEX_DIGITS.issuperset(value):
        return None
    return value.decode("ascii")


def tags_in(environ: bytes) -> tuple[bool, Tag]:
    """The allocation tag of a NUL-separated environment block: whether it sets
    `VGPU_ALLOCATION_ID` or any `VGPU_ALLOCATION_ID_<suffix>`, and the tag: the valid value of
    the former (as `allocation_id_in`) where it sets no per-device key, else `DeviceTags` with
    both (a per-device value that is not 16 lowercase hex digits names None for its device). The
    first of a key set twice counts, as for getenv(3)."""
    present, default = allocation_id_in(environ)
    if not environ.startswith(_DEVICE_PREFIX) and b"\0" + _DEVICE_PREFIX not in environ:
        return present, default
    devices: dict[str, str | None] = {}
    for entry in environ.split(b"\0"):
        if not entry.startswith(_DEVICE_PREFIX):
            continue
        key, equals, value = entry.partition(b"=")
        suffix = key[len(_DEVICE_PREFIX) :]
        if (
            not equals
            or not suffix
            or len(suffix) > _MAX_SUFFIX_LENGTH
            or not _SUFFIX_CHARACTERS.issuperset(suffix)
        ):
            continue
        name = suffix.decode("ascii")
        if name in devices:
            continue
        if len(devices) >= MAX_DEVICE_TAGS:
            break
        devices[name] = _valid(value)
    if not devices:
        return present, default
    return True, DeviceTags(default, tuple(sorted(devices.items())))


# Use at most this share of the process's file descriptor limit for pidfds.
_PIDFD_SHARE_OF_FD_LIMIT = 2


def _pidfd_budget() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(0, soft // _PIDFD_SHARE_OF_FD_LIMIT - 64)


class PidfdWatch:
    """Pidfds of resolved processes, and one poll object over them all."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()
        self._budget = _pidfd_budget()
        self.available = self._budget > 0

    def __len__(self) -> int:
        return len(self._fds)

    def __contains__(self, pid: int) -> bool:
        return pid in self._fds

    def hold(self, pid: int) -> int | None:
        """A pidfd for `pid`, held until `drop`; None where none can be had."""
        if not self.available or len(self._fds) >= self._budget:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.EPERM):
                self.available = False  # this kernel or sandbox gives none: stop asking
            return None
        os.set_inheritable(fd, False)
        self._fds[pid] = fd
        self._pids[fd] = pid
        self._poll.register(fd, select.POLLIN)
        return fd

    def exited(self) -> set[int]:
        """The held PIDs whose process has exited since it was held (one poll(2) call)."""
        if not self._fds:
            return set()
        return {self._pids[fd] for fd, _ in self._poll.poll(0)}

    def drop(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            del self._pids[fd]
            self._poll.unregister(fd)
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self.drop(pid)


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
