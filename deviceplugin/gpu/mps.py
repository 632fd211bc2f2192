"""The node's CUDA MPS control daemon: started with the daemon, supervised, and sent `quit`.

With `mps.enabled`, one MPS control daemon serves the node. It is started as the real one is
meant to be started: `<mps.controlCommand> -d` (it forks into the background and the command
returns) with `CUDA_MPS_PIPE_DIRECTORY=<mps.root>/pipe` and `CUDA_MPS_LOG_DIRECTORY=<mps.root>/log`.
Each command it takes is a separate run of the control command without `-d`, with the command on
stdin and the same environment, as `echo quit | nvidia-cuda-mps-control` does.

Once it runs, it is given one slice's limits per GPU (`MpsDefaults.commands()`): every MPS client
process that connects afterwards is held to them by the GPU. The control daemon writes its PID to
`<pipe>/nvidia-cuda-mps-control.pid`; the supervisor reads it every `check_interval_s` and, when
that process is gone, starts the control daemon again and sets the defaults again (the control
daemon keeps no settings across a restart). A change of the defaults (a GPU added, a new slicing)
is sent to the running control daemon; it applies to MPS servers started afterwards.

`stop()` sends `quit` and waits for the control daemon to exit. The daemon calls it on every exit
path, a failed start included. A daemon killed outright (SIGKILL, OOM) cannot, so at start a
control daemon already running on the pipe directory is taken over: given the defaults and
supervised like one started here.

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
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
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

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_SHM_PATH = Path("/dev/shm")  # noqa: S108 (where MPS shares memory, not a temp file)
# How long a run of the control command may take, and how long the control daemon has to write
# its PID file after `-d` returns or to exit after `quit`.
COMMAND_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 5.0
RESTART_BACKOFF_MAX_S = 30.0


class MpsCommandError(Exception):
    """A run of the control command failed; the message says how."""


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not). A dead child of ours is reaped on the way."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state in ("Z", "X"):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


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
        self._applied: tuple[str, ...] = ()
        self._attempted = False
        self._shm_warned = False
        self._next_restart_s = 0.0
        self._backoff_s = 1.0
        self.status = MpsStatus(
            pipe_directory=str(self.pipe_directory),
            down_since_s=time.monotonic(),
            error="not started yet",
        )

    # --- the control command ----------------------------------------------------------------

    def _run(self, args: list[str], stdin: str | None) -> str:
        try:
            done = subprocess.run(
                [self._command, *args],
                input=stdin,
                env=self._env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
                # The daemon's own umask is 077; the control daemon's socket must be reachable
                # by clients of any user, as when it is started by hand.
                umask=0o022,
            )
        except FileNotFoundError as e:
            raise MpsCommandError(
                f"the MPS control command {self._command!r} is not installed here: give the "
                "daemon the NVIDIA driver's utilities (nvidia-cuda-mps-control) or set "
                "mps.controlCommand"
            ) from e
        except PermissionError as e:
            raise MpsCommandError(
                f"the MPS control command {self._command!r} is not executable"
            ) from e
        except subprocess.TimeoutExpired as e:
            raise MpsCommandError(
                f"{self._command} {' '.join(args)} did not finish within {COMMAND_TIMEOUT_S:g} s"
            ) from e
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise MpsCommandError(
                f"{' '.join([self._command, *args]) if args else self._command}"
                f"{' <<< ' + stdin.strip() if stdin else ''} exited with {done.returncode}"
                + (f": {said[-1]}" if said else "")
            )
        return done.stdout.strip()

    def send(self, command: str) -> str:
        """One command on the control daemon's stdin, as `echo <command> | <controlCommand>`."""
        return self._run([], command + "\n")

    # --- state ------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The control daemon's PID from its PID file, when that process runs."""
        try:
            text = (self.pipe_directory / PID_FILE).read_text(encoding="ascii").strip()
            pid = int(text)
        except (OSError, ValueError):
            return None
        return pid if pid > 0 and _process_alive(pid) else None

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
        )

    # --- life cycle -------------------------------------------------------------------------

    def _prepare_directories(self) -> None:
        try:
            for directory in (self.root, self.pipe_directory, self.log_directory):
                directory.mkdir(parents=True, exist_ok=True)
                # Not owner-only, unlike the daemon's own files: clients of any user enter the
                # pipe directory, and MPS servers run as their clients' users and log here.
                directory.chmod(0o755)
            self.shm_directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            # Like /dev/shm: MPS servers run as their clients' users and create files here.
            self.shm_directory.chmod(0o1777)
        except OSError as e:
            raise MpsCommandError(
                f"cannot create the MPS directories under {self.root}: {e.strerror or e}; "
                "set mps.root to a writable directory (the DaemonSet's MPS component mounts it)"
            ) from e
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

    def _start_once(self, defaults: MpsDefaults) -> int:
        """Start the control daemon and set its defaults; its PID. Raises MpsCommandError."""
        self._attempted = True
        self._prepare_directories()
        running = self.pid()
        if running is not None:
            # One left by a daemon that was killed outright: take it over rather than fail on
            # "already running"; its settings are replaced below.
            log.warning(
                "an MPS control daemon already runs on this pipe directory; taking it over "
                "pid=%d pipe_directory=%s",
                running,
                self.pipe_directory,
            )
        else:
            self._run(["-d"], None)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (pid := self.pid()) is None:
            if time.monotonic() > deadline:
                raise MpsCommandError(
                    f"{self._command} -d returned, but no control daemon runs: no live PID in "
                    f"{self.pipe_directory / PID_FILE} after {SETTLE_TIMEOUT_S:g} s; see "
                    f"{self.log_directory / 'control.log'}"
                )
            time.sleep(0.02)
        self._applied = ()
        self._apply(defaults)
        return pid

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

    def start(self, defaults: MpsDefaults) -> None:
        """Start the control daemon with `defaults`, at daemon start. Raises StartupError (after
        sending `quit`, as a half-started control daemon must not outlive the daemon)."""
        with self._lock:
            try:
                pid = self._start_once(defaults)
            except MpsCommandError as e:
                self._set_status(up=False, error=str(e))
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
        """One supervision step: start the control daemon again if it died (and set its
        defaults again), or send defaults that changed. Never raises."""
        with self._lock:
            pid = self.pid()
            if pid is not None:
                if self._applied != defaults.commands():
                    try:
                        self._apply(defaults)
                    except MpsCommandError as e:
                        # Once per failure, not once a second while it lasts.
                        level = logging.DEBUG if self.status.error == str(e) else logging.WARNING
                        log.log(level, "MPS defaults not sent; retrying error=%s", e)
                        self._applied = ()
                        self._set_status(up=True, pid=pid, error=str(e))
                        return
                self._set_status(up=True, pid=pid)
                return
            now = time.monotonic()
            if self.status.up:
                log.warning(
                    "MPS control daemon has died; starting it again pid=%s", self.status.pid
                )
                self._set_status(up=False, error="the MPS control daemon died")
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
            )
            log.warning(
                "MPS control daemon started again pid=%d restarts=%d",
                pid,
                self.status.restarts_total,
            )

    async def run(self, stop: asyncio.Event, defaults: Callable[[], MpsDefaults]) -> None:
        """Supervise until `stop`: every check runs off the event loop."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.check_interval_s)
            if stop.is_set():
                return
            await asyncio.to_thread(self.supervise_once, defaults())

    def _quit(self) -> None:
        """`quit`; if the control daemon that this daemon started (its PID file is in our pipe
        directory) does not take it, or still runs 5 s later, SIGTERM: it must not outlive us."""
        pid = self.pid()
        took = True
        try:
            self.send("quit")
        except MpsCommandError as e:
            if pid is None:
                log.debug("MPS quit sent with no control daemon running error=%s", e)
                return
            log.warning("MPS control daemon did not take quit pid=%d error=%s", pid, e)
            took = False
        if pid is None:
            log.info("MPS control daemon stopped")
            return
        if took and self._wait_gone(pid):
            log.info("MPS control daemon stopped pid=%d", pid)
            return
        log.warning("MPS control daemon still runs after quit; sending SIGTERM pid=%d", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(pid):
            log.error("MPS control daemon still runs after SIGTERM pid=%d", pid)

    @staticmethod
    def _wait_gone(pid: int) -> bool:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while _process_alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        """Send `quit`, if a start was ever attempted, and wait (bounded) for the control daemon
        to exit. Never raises."""
        with self._lock:
            if not self._attempted:
                return
            self._attempted = False
            self._quit()
            self._set_status(up=False, error="stopped")
