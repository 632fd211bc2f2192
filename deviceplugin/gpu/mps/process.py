"""Which process is the control daemon, and how it is held.

The PID file the control daemon writes sits in a directory that MPS clients see, so it is never
taken on its word: the control daemon is the child this daemon started (held by a pidfd, so a
reused PID is never signalled), or, at start, one left running by an earlier daemon that was
killed outright, taken over only when `/proc/<pid>/exe` is the configured control command (or,
for a script, its interpreter with the script as an argument) and its environment names this
pipe directory; it is then held by a pidfd opened before its start time is read again. Signals
go through that pidfd only. Anything else the PID file names is ignored (and the file removed,
so that a new control daemon can start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from deviceplugin.gpu.mps.directories import (
    OUTPUT_FILE,
    PID_FILE,
    MpsDirectories,
    close_quietly,
)
from deviceplugin.gpu.mps.protocol import process_protocol
from deviceplugin.gpu.mps.runner import ControlCommand, MpsCommandError

log = logging.getLogger(__name__)

ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
# How long the control daemon has to write its PID file after it starts, and to exit after quit
# or SIGTERM.
SETTLE_TIMEOUT_S = 5.0
# Reading another process's environment or PID file: more than this is not what MPS writes.
_PROC_READ_LIMIT = 1 << 20


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (the state is [0], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The start time of a live process `pid` in clock ticks since boot; None when it is gone
    (or a zombie)."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def read_proc(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read(_PROC_READ_LIMIT)


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def identify(pid: int, binary: str, pipe_directory: str) -> str | None:
    """Why process `pid` is not an MPS control daemon run from `binary` on `pipe_directory`, or
    None when it is: its executable is `binary` (or, for a `#!` script, the script is among its
    first arguments) and its environment has CUDA_MPS_PIPE_DIRECTORY=`pipe_directory`."""
    try:
        argv = read_proc(pid, "cmdline").split(b"\0")
        environ = read_proc(pid, "environ").split(b"\0")
    except OSError as e:
        return f"its /proc entry cannot be read ({e.strerror or e})"
    if not _same_file(f"/proc/{pid}/exe", binary):
        script = _is_script(binary) and any(
            arg.startswith(b"/") and _same_file(os.fsdecode(arg), binary) for arg in argv[1:3]
        )
        if not script:
            return f"its executable is not {binary}"
    if f"{ENV_PIPE_DIRECTORY}={pipe_directory}".encode() not in environ:
        return f"its environment does not name {ENV_PIPE_DIRECTORY}={pipe_directory}"
    return None


@dataclass(slots=True)
class ControlProcess:
    """The control daemon this daemon started (`child`) or verified and took over: held by a
    pidfd, which names that process and no other even once its PID is reused."""

    pid: int
    pidfd: int
    child: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        if self.child is not None:
            return self.child.poll() is None
        readable, _, _ = select.select([self.pidfd], [], [], 0)
        return not readable

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signum)

    def wait_gone(self, timeout_s: float) -> bool:
        if self.child is not None:
            try:
                self.child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        readable, _, _ = select.select([self.pidfd], [], [], timeout_s)
        return bool(readable)

    def exit_status(self) -> int | None:
        """The child's exit status (negative: the signal), None while it runs or when it is not
        this daemon's child."""
        return None if self.child is None else self.child.poll()

    def close(self) -> None:
        close_quietly(self.pidfd)


def take_over(directories: MpsDirectories, binary: str | None) -> ControlProcess | None:
    """A control daemon left running on this pipe directory (by a daemon killed outright),
    when it proves to be one; whatever else the PID file names is ignored (and the file
    removed). `binary`: where the control command is (None: not installed)."""
    pid = directories.read_pid_file()
    if pid is None or pid <= 0:
        return None
    before = start_time(pid)
    if before is None:
        log.debug("removing a stale MPS PID file pid=%d", pid)
        directories.remove_pid_file()
        return None
    why = (
        "the control command is not installed"
        if binary is None
        else identify(pid, binary, str(directories.pipe))
    )
    pidfd = -1
    if why is None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            why = "it does not run"
        else:
            if start_time(pid) != before:
                why = "it exited while it was checked"
    if why is None:
        log.warning(
            "an MPS control daemon already runs on this pipe directory; taking it over "
            "pid=%d pipe_directory=%s",
            pid,
            directories.pipe,
        )
        return ControlProcess(pid=pid, pidfd=pidfd)
    if pidfd >= 0:
        close_quietly(pidfd)
    log.warning(
        "the MPS PID file names a process that is not this pipe directory's control daemon "
        "(%s); it is ignored and never signalled, and the file is removed pid=%d path=%s",
        why,
        pid,
        directories.pipe / PID_FILE,
    )
    directories.remove_pid_file()
    return None


def spawn(argv: list[str], env: Mapping[str, str], output_fd: int) -> ControlProcess:
    """Start the control daemon in the foreground as this daemon's child, its output to
    `output_fd` (closed here). Raises FileNotFoundError, PermissionError, OSError."""
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output_fd,
            stderr=output_fd,
            env=dict(env),
            umask=0o022,
            # Its own session: a signal to the daemon's process group (Ctrl-C) leaves it to
            # the daemon's quit.
            start_new_session=True,
        )
    finally:
        os.close(output_fd)
    return ControlProcess(pid=child.pid, pidfd=os.pidfd_open(child.pid), child=child)


def running_protocol(process: ControlProcess) -> int:
    """The MPS protocol a control daemon runs with (2 when /proc cannot tell)."""
    try:
        argv = read_proc(process.pid, "cmdline").split(b"\0")
        environ = read_proc(process.pid, "environ").split(b"\0")
    except OSError:
        return 2
    return process_protocol(argv, environ)


def wait_for_pid_file(process: ControlProcess, directories: MpsDirectories, command: str) -> None:
    """Until the child has written its PID file. Raises MpsCommandError when it exits first
    or takes longer than SETTLE_TIMEOUT_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while directories.read_pid_file() != process.pid:
        status = process.exit_status()
        if status is not None:
            raise MpsCommandError(
                f"{command} exited with {status}; see {directories.log / OUTPUT_FILE}"
            )
        if time.monotonic() > deadline:
            raise MpsCommandError(
                f"{command} runs, but has not written its PID to "
                f"{directories.pipe / PID_FILE} after {SETTLE_TIMEOUT_S:g} s; see "
                f"{directories.log / OUTPUT_FILE}"
            )
        time.sleep(0.02)


def quit_control_daemon(
    runner: ControlCommand, process: ControlProcess | None, *, force_after_s: int | None = None
) -> None:
    """`quit` (`quit -t <force_after_s>`: MPS forces its servers down after that long); then
    SIGTERM and SIGKILL, each after SETTLE_TIMEOUT_S, to `process`, the control daemon this
    daemon started or verified (and to nothing else): it must not outlive us. Closes
    `process`'s pidfd."""
    took = True
    try:
        runner.send("quit" if force_after_s is None else f"quit -t {force_after_s}")
    except MpsCommandError as e:
        if process is None:
            log.debug("MPS quit sent with no control daemon running error=%s", e)
            return
        log.warning("MPS control daemon did not take quit pid=%d error=%s", process.pid, e)
        took = False
    if process is None:
        log.info("MPS control daemon stopped")
        return
    try:
        if not process.alive() or (took and process.wait_gone(SETTLE_TIMEOUT_S)):
            log.info("MPS control daemon stopped pid=%d", process.pid)
            return
        for signum in (signal.SIGTERM, signal.SIGKILL):
            log.warning(
                "MPS control daemon still runs; sending %s pid=%d",
                signal.Signals(signum).name,
                process.pid,
            )
            process.signal(signum)
            if process.wait_gone(SETTLE_TIMEOUT_S):
                log.info("MPS control daemon stopped pid=%d", process.pid)
                return
        log.error("MPS control daemon still runs after SIGKILL pid=%d", process.pid)
    finally:
        process.close()
