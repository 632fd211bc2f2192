"""The node's CUDA MPS control daemon: started with the daemon, supervised, and sent `quit`.

It runs in the foreground as this daemon's own child, `<mps.controlCommand> -f`, with
`CUDA_MPS_PIPE_DIRECTORY=<mps.root>/pipe` and `CUDA_MPS_LOG_DIRECTORY=<mps.root>/log`; its output
goes to `<mps.root>/log/control-output.log` (the directories: deviceplugin.gpu.mps.directories;
which process is the control daemon, and taking over one left running:
deviceplugin.gpu.mps.process; each command a bounded run of the control command:
deviceplugin.gpu.mps.runner).

Once it runs, it is given one slice's limits per GPU (deviceplugin.gpu.mps.defaults). Every
`check_interval_s` the supervisor checks that the control daemon runs, starts it again when it
has gone (a crash, or a client that sent `quit`: both are restarts, counted), and reads the
defaults back: a default that a client changed through the control socket is set again, logged
and counted (`drift_total`). A change of the defaults (a GPU added, a new slicing) is sent to the
running control daemon; it applies to MPS servers started afterwards.

`stop()` sends `quit`, then SIGTERM, then SIGKILL, each after SETTLE_TIMEOUT_S, to the control
daemon it started or verified, and to nothing else. The daemon calls it on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from deviceplugin.allocation import MpsDefaults
from deviceplugin.config import MpsConfig
from deviceplugin.errors import StartupError
from deviceplugin.gpu.mps.defaults import DRIFT_QUIT, apply_defaults, find_drift
from deviceplugin.gpu.mps.directories import (
    DEFAULT_SHM_PATH,
    OUTPUT_FILE,
    PID_FILE,
    MpsDirectories,
)
from deviceplugin.gpu.mps.process import (
    ENV_PIPE_DIRECTORY,
    ControlProcess,
    spawn,
    take_over,
)
from deviceplugin.gpu.mps.runner import (
    ControlCommand,
    MpsCommandError,
    MpsPathError,
)
from deviceplugin.model import MpsStatus

log = logging.getLogger(__name__)

ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
# How long the control daemon has to write its PID file after it starts, and to exit after quit
# or SIGTERM.
SETTLE_TIMEOUT_S = 5.0
RESTART_BACKOFF_MAX_S = 30.0


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
        self.directories = MpsDirectories(config.root, shm_path)
        self.root = self.directories.root
        self.pipe_directory = self.directories.pipe
        self.log_directory = self.directories.log
        self.shm_directory = self.directories.shm
        self.check_interval_s = check_interval_s
        self.runner = ControlCommand(
            config.control_command,
            {
                **(os.environ if environ is None else environ),
                ENV_PIPE_DIRECTORY: str(self.pipe_directory),
                ENV_LOG_DIRECTORY: str(self.log_directory),
            },
        )
        self._lock = threading.Lock()
        self._process: ControlProcess | None = None
        self._applied: tuple[str, ...] = ()
        self._attempted = False
        self._unreadable_warned = False
        self._next_restart_s = 0.0
        self._backoff_s = 1.0
        self._drift: dict[str, int] = {}
        self.status = MpsStatus(
            pipe_directory=str(self.pipe_directory),
            down_since_s=time.monotonic(),
            error="not started yet",
        )

    def send(self, command: str) -> str:
        """One command on the control daemon's stdin, as `echo <command> | <controlCommand>`."""
        return self.runner.send(command)

    # --- state ------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The control daemon's PID, when the one this daemon started or verified runs."""
        process = self._process
        return process.pid if process is not None and process.alive() else None

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

    def _start_once(self, defaults: MpsDefaults) -> int:
        """Start the control daemon (or take over one left running) and set its defaults; its
        PID. Raises MpsCommandError."""
        self._attempted = True
        self.directories.prepare()
        try:
            process = take_over(self.directories, self.runner.binary())
            if process is None:
                process = self._spawn()
        except OSError as e:
            raise MpsCommandError(
                f"cannot start the MPS control daemon in {self.root}: {e.strerror or e}"
            ) from e
        if process.child is not None:
            self._process = process
            self._wait_for_pid_file(process)
        self._process = process
        self._applied = ()
        self._apply(defaults)
        return process.pid

    def _spawn(self) -> ControlProcess:
        output = self.directories.output_file()
        try:
            return spawn([self.runner.command, "-f"], self.runner.env, output)
        except (FileNotFoundError, PermissionError) as e:
            raise self.runner.not_runnable(e) from e

    def _wait_for_pid_file(self, process: ControlProcess) -> None:
        """Until the child has written its PID file. Raises MpsCommandError when it exits first
        or takes longer than SETTLE_TIMEOUT_S."""
        command = self.runner.command
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while self.directories.read_pid_file() != process.pid:
            status = process.exit_status()
            if status is not None:
                raise MpsCommandError(
                    f"{command} -f exited with {status}; see {self.log_directory / OUTPUT_FILE}"
                )
            if time.monotonic() > deadline:
                raise MpsCommandError(
                    f"{command} -f runs, but has not written its PID to "
                    f"{self.pipe_directory / PID_FILE} after {SETTLE_TIMEOUT_S:g} s; see "
                    f"{self.log_directory / OUTPUT_FILE}"
                )
            time.sleep(0.02)

    def _apply(self, defaults: MpsDefaults) -> None:
        self._applied = apply_defaults(self.runner, defaults, str(self.pipe_directory))

    def _restore_drifted(self, defaults: MpsDefaults) -> None:
        """Read the defaults back; set again, log and count each one that a client changed.
        Raises MpsCommandError."""
        for drift in find_drift(self.runner, defaults, self._unreadable):
            self.send(drift.restore)
            self._count_drift(drift.change)
            log.warning(
                "an MPS default was changed through the control socket, not by this daemon "
                "(MPS does not say which client sent it); set again setting=%s found=%s "
                "restored=%s pipe_directory=%s",
                drift.change,
                drift.found,
                drift.wanted,
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
                self._check_running(process, defaults)
                return
            now = time.monotonic()
            if process is not None:
                self._gone(process)
                self._next_restart_s = now
                self._backoff_s = 1.0
            if now < self._next_restart_s:
                return
            self._restart(defaults, now)

    def _check_running(self, process: ControlProcess, defaults: MpsDefaults) -> None:
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

    def _restart(self, defaults: MpsDefaults, now: float) -> None:
        """Start the control daemon again after it has gone; back off while that fails."""
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
