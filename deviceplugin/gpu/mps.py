"""The node's CUDA MPS control daemon: started with the daemon, supervised, and sent `quit`.

With `mps.enabled`, one MPS control daemon serves the node. It runs in the foreground as this
daemon's own child, `<mps.controlCommand> -f`, with `CUDA_MPS_PIPE_DIRECTORY=<mps.root>/pipe` and
`CUDA_MPS_LOG_DIRECTORY=<mps.root>/log`; its output goes to `<mps.root>/log/control-output.log`.
Each command it takes is a separate run of the control command without arguments, with the
command on stdin and the same environment, as `echo quit | nvidia-cuda-mps-control` does. What
such a run prints is read up to OUTPUT_LIMIT_BYTES and for COMMAND_TIMEOUT_S at most: past
either, the run is killed and the command counts as failed.

Which process is the control daemon. The PID file the control daemon writes
(`<pipe>/nvidia-cuda-mps-control.pid`) sits in a directory that MPS clients see, so it is never
taken on its word: the control daemon is the child this daemon started (held by a pidfd, so a
reused PID is never signalled), or, at start, one left running by an earlier daemon that was
killed outright, taken over only when `/proc/<pid>/exe` is the configured control command (or,
for a script, its interpreter with the script as an argument) and its environment names this
pipe directory; it is then held by a pidfd opened before its start time is read again. Signals
go through that pidfd only. Anything else the PID file names is ignored (and the file removed,
so that a new control daemon can start).

Once it runs, it is given one slice's limits per GPU (`MpsDefaults.commands()`): every MPS client
process that connects afterwards is held to them by the GPU. Every `check_interval_s` the
supervisor checks that the control daemon runs, starts it again when it has gone (a crash, or a
client that sent `quit`: both are restarts, counted), and reads the defaults back: a default
that a client changed through the control socket is set again, logged and counted
(`drift_total`). A change of the defaults (a GPU added, a new slicing) is sent to the running
control daemon; it applies to MPS servers started afterwards.

`stop()` sends `quit`, then SIGTERM, then SIGKILL, each after SETTLE_TIMEOUT_S, to the control
daemon it started or verified, and to nothing else. The daemon calls it on every exit path.

Directories: `<mps.root>`, its `pipe`, `log` and `shm` are opened component by component without
following a symbolic link (deviceplugin.safefs). Only a directory created here is given its mode
(0755; `shm` 1777 like /dev/shm); one that was there before keeps its mode, except `shm` when it
is this daemon's own /dev/shm (a mount the DaemonSet made, not a path the config chose).

Shared memory: an MPS client and its server exchange data through files in `/dev/shm`, so a
client must see the server's `/dev/shm`. The server inherits it from the control daemon, which
inherits it from this daemon; the DaemonSet's MPS component mounts `<mps.root>/shm` there, and
Allocate mounts the same directory at each container's `/dev/shm`. At start the supervisor checks
that its own `/dev/shm` is that directory, and says so in the log when it is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.allocation import (
    MpsDefaults,
    mps_log_directory,
    mps_pipe_directory,
    mps_shm_directory,
)
from deviceplugin.config import MpsConfig
from deviceplugin.errors import StartupError
from deviceplugin.model import MpsStatus
from deviceplugin.safefs import open_directory

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
OUTPUT_FILE = "control-output.log"
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_SHM_PATH = Path("/dev/shm")  # noqa: S108 (where MPS shares memory, not a temp file)
# How long a run of the control command may take and how much it may print; how long the
# control daemon has to write its PID file after it starts, and to exit after quit or SIGTERM.
COMMAND_TIMEOUT_S = 10.0
OUTPUT_LIMIT_BYTES = 64 * 1024
SETTLE_TIMEOUT_S = 5.0
RESTART_BACKOFF_MAX_S = 30.0
# Reading another process's environment or PID file: more than this is not what MPS writes.
_PROC_READ_LIMIT = 1 << 20
# What drift_total counts: a default changed behind the daemon's back, or a quit it did not send.
DRIFT_MEMORY = "pinned_mem_limit"
DRIFT_THREADS = "active_thread_percentage"
DRIFT_QUIT = "quit"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_SIZE_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


class MpsCommandError(Exception):
    """A run of the control command failed; the message says how."""


class MpsPathError(MpsCommandError):
    """The MPS directories cannot be made safely: nothing was started, nothing is sent."""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (the state is [0], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _read_proc(pid: int, name: str) -> bytes:
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
        argv = _read_proc(pid, "cmdline").split(b"\0")
        environ = _read_proc(pid, "environ").split(b"\0")
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


def _mib(text: str) -> float | None:
    """A size as the control daemon prints it ("20480M", "20G", "0") in MiB, or None."""
    match = _SIZE.match(text)
    if match is None:
        return None
    return float(match.group(1)) * _SIZE_MIB[match.group(2).upper()]


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


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
        _close_quietly(self.pidfd)


class MpsControlDaemon:
    """Runs and supervises the node's MPS control daemon. `status` may be read from any thread;
    the other methods block (they run the control command) and belong on a worker thread."""

    def __init__(
        self,
        config: MpsConfig,
        *,
        shm_path: Path = DEFAULT_SHM_PATH,
        check_interval_s: float = 1.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._command = config.control_command
        self.root = Path(config.root)
        self.pipe_directory = Path(mps_pipe_directory(config.root))
        self.log_directory = Path(mps_log_directory(config.root))
        self.shm_directory = Path(mps_shm_directory(config.root))
        self._shm_path = shm_path
        self.check_interval_s = check_interval_s
        self._env = {
            **(os.environ if environ is None else environ),
            ENV_PIPE_DIRECTORY: str(self.pipe_directory),
            ENV_LOG_DIRECTORY: str(self.log_directory),
        }
        self._lock = threading.Lock()
        self._process: ControlProcess | None = None
        self._applied: tuple[str, ...] = ()
        self._attempted = False
        self._shm_warned = False
        self._unreadable_warned = False
        self._next_restart_s = 0.0
        self._backoff_s = 1.0
        self._drift: dict[str, int] = {}
        self.status = MpsStatus(
            pipe_directory=str(self.pipe_directory),
            down_since_s=time.monotonic(),
            error="not started yet",
        )

    # --- the control command ----------------------------------------------------------------

    def _binary(self) -> str | None:
        return shutil.which(self._command, path=self._env.get("PATH"))

    def _run(self, args: list[str], stdin: str | None) -> str:
        shown = " ".join([self._command, *args]) + (f" <<< {stdin.strip()}" if stdin else "")
        try:
            proc = subprocess.Popen(
                [self._command, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                # The daemon's own umask is 077; the control daemon's socket must be reachable
                # by clients of any user, as when it is started by hand.
                umask=0o022,
            )
        except (FileNotFoundError, PermissionError) as e:
            raise self._not_runnable(e) from e
        try:
            out, err = _bounded_output(proc, (stdin or "").encode(), shown)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode != 0:
            said = (err or out).strip().splitlines()
            raise MpsCommandError(
                f"{shown} exited with {proc.returncode}" + (f": {said[-1]}" if said else "")
            )
        return out.strip()

    def _not_runnable(self, e: FileNotFoundError | PermissionError) -> MpsCommandError:
        """Why the control command could not be started, and what to do."""
        if isinstance(e, FileNotFoundError):
            return MpsCommandError(
                f"the MPS control command {self._command!r} is not installed here: give the "
                "daemon the NVIDIA driver's utilities (nvidia-cuda-mps-control) or set "
                "mps.controlCommand"
            )
        return MpsCommandError(f"the MPS control command {self._command!r} is not executable")

    def send(self, command: str) -> str:
        """One command on the control daemon's stdin, as `echo <command> | <controlCommand>`."""
        return self._run([], command + "\n")

    # --- state ------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The control daemon's PID, when the one this daemon started or verified runs."""
        process = self._process
        return process.pid if process is not None and process.alive() else None

    def _pid_file(self) -> int | None:
        """The PID in the PID file: a regular file, read without following a symlink or
        blocking on a FIFO, at most 64 bytes."""
        try:
            fd = os.open(
                self.pipe_directory / PID_FILE,
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

    def _set_status(self, *, up: bool, pid: int | None = None, error: str = "") -> None:
        old = self.status
        down_since = 0.0 if up else (old.down_since_s or time.monotonic())
        self.status = MpsStatus(
            up=up,
            pid=pid,
            restarts_total=old.restarts_total,
            down_since_s=down_since,
            pipe_directory=str(self.pipe_directory),
            error=error,
            drift_total=tuple(sorted(self._drift.items())),
        )

    def _count_drift(self, change: str) -> None:
        self._drift[change] = self._drift.get(change, 0) + 1

    # --- life cycle -------------------------------------------------------------------------

    def _prepare_directories(self) -> None:
        opened: list[int] = []
        try:
            for directory, mode in (
                (self.root, 0o755),
                (self.pipe_directory, 0o755),
                (self.log_directory, 0o755),
                (self.shm_directory, 0o1777),
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
                _close_quietly(fd)
        try:
            same = os.path.samefile(self._shm_path, self.shm_directory)
        except OSError:
            same = False
        if not same and not self._shm_warned:
            self._shm_warned = True
            log.warning(
                "MPS clients get %s at /dev/shm, but this daemon's %s is another directory: "
                "the MPS server will not share memory with them; mount %s at %s (the "
                "DaemonSet's MPS component does)",
                self.shm_directory,
                self._shm_path,
                self.shm_directory,
                self._shm_path,
            )

    def _check_existing(self, directory: Path, fd: int, mode: int) -> None:
        """A directory that was there before keeps its mode: only the daemon's own /dev/shm
        (the DaemonSet's mount) is opened up like /dev/shm. Anything narrower is logged."""
        now = stat.S_IMODE(os.fstat(fd).st_mode)
        if now & mode == mode:
            return
        if directory == self.shm_directory and _fd_is(fd, self._shm_path):
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

    def _output_file(self) -> int:
        handle = open_directory(str(self.log_directory), create=True)
        try:
            return os.open(
                OUTPUT_FILE,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=handle.fd,
            )
        finally:
            os.close(handle.fd)

    def _take_over(self) -> ControlProcess | None:
        """A control daemon left running on this pipe directory (by a daemon killed outright),
        when it proves to be one; whatever else the PID file names is ignored."""
        pid = self._pid_file()
        if pid is None or pid <= 0:
            return None
        before = _start_time(pid)
        if before is None:
            log.debug("removing a stale MPS PID file pid=%d", pid)
            self._remove_pid_file()
            return None
        binary = self._binary()
        why = (
            "the control command is not installed"
            if binary is None
            else identify(pid, binary, str(self.pipe_directory))
        )
        pidfd = -1
        if why is None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                why = "it does not run"
            else:
                if _start_time(pid) != before:
                    why = "it exited while it was checked"
        if why is None:
            log.warning(
                "an MPS control daemon already runs on this pipe directory; taking it over "
                "pid=%d pipe_directory=%s",
                pid,
                self.pipe_directory,
            )
            return ControlProcess(pid=pid, pidfd=pidfd)
        if pidfd >= 0:
            _close_quietly(pidfd)
        log.warning(
            "the MPS PID file names a process that is not this pipe directory's control daemon "
            "(%s); it is ignored and never signalled, and the file is removed pid=%d path=%s",
            why,
            pid,
            self.pipe_directory / PID_FILE,
        )
        self._remove_pid_file()
        return None

    def _remove_pid_file(self) -> None:
        """Remove the PID file (the link itself, never what a link points to)."""
        handle = open_directory(str(self.pipe_directory), create=False)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(PID_FILE, dir_fd=handle.fd)
        finally:
            os.close(handle.fd)

    def _spawn(self) -> ControlProcess:
        output = self._output_file()
        try:
            child = subprocess.Popen(
                [self._command, "-f"],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                env=self._env,
                umask=0o022,
                # Its own session: a signal to the daemon's process group (Ctrl-C) leaves it to
                # the daemon's quit.
                start_new_session=True,
            )
        except (FileNotFoundError, PermissionError) as e:
            raise self._not_runnable(e) from e
        finally:
            os.close(output)
        return ControlProcess(pid=child.pid, pidfd=os.pidfd_open(child.pid), child=child)

    def _start_once(self, defaults: MpsDefaults) -> int:
        """Start the control daemon (or take over one left running) and set its defaults; its
        PID. Raises MpsCommandError."""
        self._attempted = True
        self._prepare_directories()
        try:
            process = self._take_over()
            if process is None:
                process = self._spawn()
        except OSError as e:
            raise MpsCommandError(
                f"cannot start the MPS control daemon in {self.root}: {e.strerror or e}"
            ) from e
        if process.child is not None:
            self._process = process
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while self._pid_file() != process.pid:
                status = process.exit_status()
                if status is not None:
                    raise MpsCommandError(
                        f"{self._command} -f exited with {status}; see "
                        f"{self.log_directory / OUTPUT_FILE}"
                    )
                if time.monotonic() > deadline:
                    raise MpsCommandError(
                        f"{self._command} -f runs, but has not written its PID to "
                        f"{self.pipe_directory / PID_FILE} after {SETTLE_TIMEOUT_S:g} s; see "
                        f"{self.log_directory / OUTPUT_FILE}"
                    )
                time.sleep(0.02)
        self._process = process
        self._applied = ()
        self._apply(defaults)
        return process.pid

    def _apply(self, defaults: MpsDefaults) -> None:
        commands = defaults.commands()
        for command in commands:
            self.send(command)
        self._applied = commands
        log.info(
            "MPS defaults set pipe_directory=%s commands=%s",
            self.pipe_directory,
            "; ".join(commands) or "none (no GPU is sliced)",
        )

    def _restore_drifted(self, defaults: MpsDefaults) -> None:
        """Read the defaults back; set again, log and count each one that a client changed.
        Raises MpsCommandError."""
        reads = [f"get_default_device_pinned_mem_limit {uuid}" for uuid, _ in
                 defaults.pinned_mem_limit_mib]  # fmt: skip
        if defaults.active_thread_percentage is not None:
            reads.append("get_default_active_thread_percentage")
        if not reads:
            return
        answers = self._run([], "".join(f"{r}\n" for r in reads)).splitlines()
        if len(answers) != len(reads):
            answers = [self.send(r) for r in reads]
        found: list[tuple[str, str, str, str]] = []  # (change, command to restore, found, want)
        for (uuid, mib), answer in zip(defaults.pinned_mem_limit_mib, answers, strict=False):
            seen = _mib(answer)
            if seen is None:
                self._unreadable(answer)
            elif round(seen) != mib:
                found.append(
                    (
                        DRIFT_MEMORY,
                        f"set_default_device_pinned_mem_limit {uuid} {mib}M",
                        f"{uuid}={answer.strip()}",
                        f"{uuid}={mib}M",
                    )
                )
        want = defaults.active_thread_percentage
        if want is not None:
            answer = answers[-1]
            try:
                seen_threads: float | None = float(answer)
            except ValueError:
                seen_threads = None
                self._unreadable(answer)
            if seen_threads is not None and round(seen_threads) != want:
                found.append(
                    (
                        DRIFT_THREADS,
                        f"set_default_active_thread_percentage {want}",
                        answer.strip(),
                        str(want),
                    )
                )
        for change, command, seen_text, want_text in found:
            self.send(command)
            self._count_drift(change)
            log.warning(
                "an MPS default was changed through the control socket, not by this daemon "
                "(MPS does not say which client sent it); set again setting=%s found=%s "
                "restored=%s pipe_directory=%s",
                change,
                seen_text,
                want_text,
                self.pipe_directory,
            )

    def _unreadable(self, answer: str) -> None:
        if not self._unreadable_warned:
            self._unreadable_warned = True
            log.warning(
                "cannot read an MPS default back; drift of it goes unseen answer=%r", answer[:80]
            )

    def start(self, defaults: MpsDefaults) -> None:
        """Start the control daemon with `defaults`, at daemon start. Raises StartupError (after
        stopping it, as a half-started control daemon must not outlive the daemon)."""
        with self._lock:
            try:
                pid = self._start_once(defaults)
            except MpsCommandError as e:
                self._set_status(up=False, error=str(e))
                if not isinstance(e, MpsPathError):
                    # No quit to a pipe directory that could not be made safely: the control
                    # program would follow the symlink there.
                    self._quit()
                self._attempted = False
                raise StartupError(f"cannot start the MPS control daemon: {e}") from e
            self._set_status(up=True, pid=pid)
            log.info(
                "MPS control daemon started pid=%d pipe_directory=%s log_directory=%s",
                pid,
                self.pipe_directory,
                self.log_directory,
            )

    def supervise_once(self, defaults: MpsDefaults) -> None:
        """One supervision step: start the control daemon again if it has gone (and set its
        defaults again), send defaults that changed, restore defaults a client changed. Never
        raises."""
        with self._lock:
            process = self._process
            if process is not None and process.alive():
                try:
                    if self._applied != defaults.commands():
                        self._apply(defaults)
                    else:
                        self._restore_drifted(defaults)
                except MpsCommandError as e:
                    # Once per failure, not once a second while it lasts.
                    level = logging.DEBUG if self.status.error == str(e) else logging.WARNING
                    log.log(level, "MPS defaults not sent or read; retrying error=%s", e)
                    self._applied = ()
                    self._set_status(up=True, pid=process.pid, error=str(e))
                    return
                self._set_status(up=True, pid=process.pid)
                return
            now = time.monotonic()
            if process is not None:
                self._gone(process)
                self._next_restart_s = now
                self._backoff_s = 1.0
            if now < self._next_restart_s:
                return
            try:
                pid = self._start_once(defaults)
            except MpsCommandError as e:
                self._next_restart_s = now + self._backoff_s
                log.error(
                    "MPS control daemon did not start again; retrying in %g s error=%s",
                    self._backoff_s,
                    e,
                )
                self._backoff_s = min(self._backoff_s * 2, RESTART_BACKOFF_MAX_S)
                self._set_status(up=False, error=str(e))
                return
            self.status = MpsStatus(
                up=True,
                pid=pid,
                restarts_total=self.status.restarts_total + 1,
                pipe_directory=str(self.pipe_directory),
                drift_total=tuple(sorted(self._drift.items())),
            )
            log.warning(
                "MPS control daemon started again pid=%d restarts=%d",
                pid,
                self.status.restarts_total,
            )

    def _gone(self, process: ControlProcess) -> None:
        """The control daemon exited without being asked by this daemon: a client's quit (it
        exits 0) or a crash."""
        status = process.exit_status()
        process.close()
        self._process = None
        if status == 0:
            self._count_drift(DRIFT_QUIT)
            log.warning(
                "MPS control daemon exited cleanly without this daemon asking: a client sent "
                "it quit; starting it again pid=%d",
                process.pid,
            )
            error = "a client sent the MPS control daemon quit"
        else:
            log.warning(
                "MPS control daemon has died; starting it again pid=%d status=%s",
                process.pid,
                "unknown (not this daemon's child)" if status is None else status,
            )
            error = "the MPS control daemon died"
        self._set_status(up=False, error=error)

    async def run(self, stop: asyncio.Event, defaults: Callable[[], MpsDefaults]) -> None:
        """Supervise until `stop`: every check runs off the event loop."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.check_interval_s)
            if stop.is_set():
                return
            await asyncio.to_thread(self.supervise_once, defaults())

    def _quit(self) -> None:
        """`quit`; then SIGTERM and SIGKILL, each after SETTLE_TIMEOUT_S, to the control daemon
        this daemon started or verified (and to nothing else): it must not outlive us."""
        process = self._process
        took = True
        try:
            self.send("quit")
        except MpsCommandError as e:
            if process is None:
                log.debug("MPS quit sent with no control daemon running error=%s", e)
                return
            log.warning("MPS control daemon did not take quit pid=%d error=%s", process.pid, e)
            took = False
        if process is None:
            log.info("MPS control daemon stopped")
            return
        self._process = None
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

    def stop(self) -> None:
        """Send `quit`, if a start was ever attempted, and make sure (bounded) that the control
        daemon has exited. Never raises."""
        with self._lock:
            if not self._attempted:
                return
            self._attempted = False
            self._quit()
            self._set_status(up=False, error="stopped")


def _fd_is(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _bounded_output(proc: subprocess.Popen[bytes], stdin: bytes, shown: str) -> tuple[str, str]:
    """Write `stdin`, then read stdout and stderr until both close, at most OUTPUT_LIMIT_BYTES
    together and for COMMAND_TIMEOUT_S; raises MpsCommandError past either (the caller kills
    the process)."""
    if proc.stdin is None or proc.stdout is None or proc.stderr is None:
        raise MpsCommandError(f"{shown}: its standard streams are not pipes")
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(stdin)
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    open_fds = set(chunks)
    total = 0
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MpsCommandError(f"{shown} did not finish within {COMMAND_TIMEOUT_S:g} s")
        readable, _, _ = select.select(list(open_fds), [], [], left)
        for fd in readable:
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
                continue
            total += len(data)
            if total > OUTPUT_LIMIT_BYTES:
                raise MpsCommandError(
                    f"{shown} printed more than {OUTPUT_LIMIT_BYTES // 1024} KiB; stopped it"
                )
            chunks[fd].append(data)
    try:
        proc.wait(max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired as e:
        raise MpsCommandError(f"{shown} did not finish within {COMMAND_TIMEOUT_S:g} s") from e
    out = b"".join(chunks[proc.stdout.fileno()]).decode(errors="replace")
    err = b"".join(chunks[proc.stderr.fileno()]).decode(errors="replace")
    return out, err
