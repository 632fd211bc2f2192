"""The node's CUDA MPS control daemon: started with the daemon, supervised, and sent `quit`.

It runs in the foreground as this daemon's own child, `<mps.controlCommand> -f` (MPS v3:
`-p 3 -m -f`, with CUDA_MPS_PROTOCOL_VERSION=3), with `CUDA_MPS_PIPE_DIRECTORY=<mps.root>/pipe`
and `CUDA_MPS_LOG_DIRECTORY=<mps.root>/log`; its output goes to
`<mps.root>/log/control-output.log` (the directories: deviceplugin.gpu.mps.directories; which
process is the control daemon, and taking over one left running: deviceplugin.gpu.mps.process;
each command a bounded run of the control command: deviceplugin.gpu.mps.runner).

Once it runs, it is configured: under MPS v2 with one slice's limits per GPU as its defaults
(deviceplugin.gpu.mps.defaults), under MPS v3 with a server per GPU and the namespaces held
(deviceplugin.gpu.mps.namespaces). Every `check_interval_s` the supervisor checks that the
control daemon runs, starts it again when it has gone (a crash, or a client that sent `quit`:
both are restarts, counted) and configures it again, and reads its configuration back: a v2
default or a v3 namespace that a client changed is set again, logged and counted
(`drift_total`). A change of the defaults (a GPU added, a new slicing) is sent to the running
control daemon.

Stopping an MPS client: `drain` and `stop_client` terminate it through the control daemon first
(deviceplugin.gpu.mps.drain); a terminate that does not return in time is a wedge. With a
canary (deviceplugin.gpu.mps.canary), a client that left without a drain, and every
`canary_interval_s`, send a canary through each server's (v3) or GPU's (v2) pipe directory; one
that hangs is a wedge. A wedge is logged and counted, and MPS is restarted (`quit -t`, then
SIGTERM and SIGKILL as at stop), configured as before.

`stop()` sends `quit`, then SIGTERM, then SIGKILL, each after SETTLE_TIMEOUT_S, to the control
daemon it started or verified, and to nothing else. The daemon calls it on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from deviceplugin.allocation import DeviceLimits, MpsDefaults
from deviceplugin.config import MpsConfig
from deviceplugin.errors import StartupError
from deviceplugin.gpu.mps.canary import canary_targets, run_canary
from deviceplugin.gpu.mps.clients import RootClients
from deviceplugin.gpu.mps.defaults import DRIFT_QUIT, apply_defaults, restore_drifted
from deviceplugin.gpu.mps.directories import DEFAULT_SHM_PATH, MpsDirectories
from deviceplugin.gpu.mps.drain import ClientWatch, Drain, Drainer, DrainOutcome
from deviceplugin.gpu.mps.namespaces import MpsNamespaceError, NamespaceBook
from deviceplugin.gpu.mps.options import MpsOptions
from deviceplugin.gpu.mps.process import (
    ENV_PIPE_DIRECTORY,
    SETTLE_TIMEOUT_S,
    ControlProcess,
    quit_control_daemon,
    running_protocol,
    spawn,
    take_over,
    wait_for_pid_file,
)
from deviceplugin.gpu.mps.protocol import ENV_PROTOCOL_VERSION, V3
from deviceplugin.gpu.mps.runner import ControlCommand, MpsCommandError, MpsPathError
from deviceplugin.model import MpsNamespace, MpsStatus

log = logging.getLogger(__name__)

ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
RESTART_BACKOFF_MAX_S = 30.0
# `quit -t`: how long MPS gives its servers before it forces them down, after a wedge.
WEDGE_QUIT_TIMEOUT_S = 2
T = TypeVar("T")

__all__ = ["SETTLE_TIMEOUT_S", "MpsControlDaemon"]


class MpsControlDaemon:
    """Runs and supervises the node's MPS control daemon. `status` may be read from any thread;
    the other methods block (they run the control command) and belong on a worker thread."""

    def __init__(
        self,
        config: MpsConfig,
        *,
        options: MpsOptions | None = None,
        shm_path: Path = DEFAULT_SHM_PATH,
        check_interval_s: float = 1.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.options = options = options or MpsOptions()
        self.protocol = options.protocol
        self.directories = MpsDirectories(config.root, shm_path)
        self.root = self.directories.root
        self.pipe_directory = self.directories.pipe
        self.log_directory = self.directories.log
        self.shm_directory = self.directories.shm
        self.check_interval_s = check_interval_s
        env = {
            **(os.environ if environ is None else environ),
            ENV_PIPE_DIRECTORY: str(self.pipe_directory),
            ENV_LOG_DIRECTORY: str(self.log_directory),
        }
        if self.protocol == V3:
            env[ENV_PROTOCOL_VERSION] = "3"
        self.runner = ControlCommand(config.control_command, env)
        self._lock = threading.Lock()
        self._process: ControlProcess | None = None
        self._defaults = MpsDefaults()
        self._applied: tuple[str, ...] = ()
        self._attempted = False
        self._unreadable_warned = False
        self._next_restart_s = 0.0
        self._backoff_s = 1.0
        self._drift: dict[str, int] = {}
        self._restarts = 0
        self._drains = 0
        self._undrained = 0
        self._wedges = 0
        self._canary_error = ""
        self._book = (
            NamespaceBook(
                self.runner,
                self.pipe_directory,
                timing=options.namespaces,
                count_drift=self._count_drift,
            )
            if self.protocol == V3
            else None
        )
        self._drainer = Drainer(self.runner, self.protocol, options.drain_timeout_s)
        self._watch = ClientWatch()
        self._root = RootClients()
        self._next_canary_s = 0.0
        self.status = MpsStatus(
            pipe_directory=str(self.pipe_directory),
            down_since_s=time.monotonic(),
            error="not started yet",
            protocol=self.protocol,
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
            restarts_total=self._restarts,
            down_since_s=down_since,
            pipe_directory=str(self.pipe_directory),
            error=error,
            drift_total=tuple(sorted(self._drift.items())),
            protocol=self.protocol,
            drains_total=self._drains,
            undrained_total=self._undrained,
            wedges_total=self._wedges,
            canary_error=self._canary_error,
            namespaces=() if self._book is None else self._book.held(),
            root_clients=self._root.pids,
        )

    def _refresh_status(self) -> None:
        old = self.status
        self._set_status(up=old.up, pid=old.pid, error=old.error)

    def _count_drift(self, change: str) -> None:
        self._drift[change] = self._drift.get(change, 0) + 1

    # --- life cycle -------------------------------------------------------------------------

    def _start_once(self, defaults: MpsDefaults) -> int:
        """Start the control daemon (or take over one left running) and configure it; its
        PID. Raises MpsCommandError."""
        self._attempted = True
        self._defaults = defaults
        self.directories.prepare()
        try:
            process = take_over(self.directories, self.runner.binary())
            if process is not None and running_protocol(process) != self.protocol:
                log.warning(
                    "the MPS control daemon left running speaks another protocol; sending it "
                    "quit and starting one with protocol %d pid=%d",
                    self.protocol,
                    process.pid,
                )
                quit_control_daemon(self.runner, process)
                process = None
            if process is None:
                process = self._spawn()
        except OSError as e:
            raise MpsCommandError(
                f"cannot start the MPS control daemon in {self.root}: {e.strerror or e}"
            ) from e
        if process.child is not None:
            self._process = process
            wait_for_pid_file(process, self.directories, " ".join(self._argv()))
        self._process = process
        self._applied = ()
        self._watch.reset()
        self._configure(defaults, fresh=process.child is not None)
        return process.pid

    def _argv(self) -> list[str]:
        flags = ["-p", "3", "-m", "-f"] if self.protocol == V3 else ["-f"]
        return [self.runner.command, *flags]

    def _spawn(self) -> ControlProcess:
        output = self.directories.output_file()
        try:
            return spawn(self._argv(), self.runner.env, output)
        except (FileNotFoundError, PermissionError) as e:
            raise self.runner.not_runnable(e) from e

    def _configure(self, defaults: MpsDefaults, *, fresh: bool) -> None:
        if self._book is not None:
            self._book.configure(defaults, fresh=fresh)
            self._applied = defaults.commands()
        else:
            self._applied = apply_defaults(self.runner, defaults, str(self.pipe_directory))

    def _restore_drifted(self, defaults: MpsDefaults) -> None:
        restore_drifted(
            self.runner, defaults, self._unreadable, self._count_drift, str(self.pipe_directory)
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
                "MPS control daemon started pid=%d protocol=%d pipe_directory=%s log_directory=%s",
                pid,
                self.protocol,
                self.pipe_directory,
                self.log_directory,
            )

    def supervise_once(self, defaults: MpsDefaults) -> None:
        """One supervision step: start the control daemon again if it has gone (and configure
        it again), send defaults that changed, restore what a client changed, watch for
        wedges. Never raises."""
        with self._lock:
            self._defaults = defaults
            process = self._process
            if process is not None and process.alive():
                if self._check_running(process, defaults):
                    self._watch_for_wedges()
                return
            now = time.monotonic()
            if process is not None:
                self._gone(process)
                self._next_restart_s = now
                self._backoff_s = 1.0
            if now < self._next_restart_s:
                return
            self._restart(defaults, now)

    def _check_running(self, process: ControlProcess, defaults: MpsDefaults) -> bool:
        """Configuration sent or read back; False (status set) when the control daemon did not
        answer."""
        try:
            if self._book is not None:
                self._book.check(defaults)
            elif self._applied != defaults.commands():
                self._configure(defaults, fresh=False)
            else:
                self._restore_drifted(defaults)
        except MpsCommandError as e:
            # Once per failure, not once a second while it lasts.
            level = logging.DEBUG if self.status.error == str(e) else logging.WARNING
            log.log(level, "MPS configuration not sent or read; retrying error=%s", e)
            self._applied = ()
            self._set_status(up=True, pid=process.pid, error=str(e))
            return False
        self._set_status(up=True, pid=process.pid)
        return True

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
        self._restarts += 1
        self._set_status(up=True, pid=pid)
        log.warning("MPS control daemon started again pid=%d restarts=%d", pid, self._restarts)

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

    def _quit(self, force_after_s: int | None = None) -> None:
        process, self._process = self._process, None
        quit_control_daemon(self.runner, process, force_after_s=force_after_s)

    def stop(self) -> None:
        """Send `quit`, if a start was ever attempted, and make sure (bounded) that the control
        daemon has exited. Never raises."""
        with self._lock:
            if not self._attempted:
                return
            self._attempted = False
            self._quit()
            self._set_status(up=False, error="stopped")

    # --- MPS v3 namespaces ------------------------------------------------------------------

    def provision(self, owner: str, devices: Sequence[DeviceLimits]) -> MpsNamespace:
        """The MPS v3 namespace of `owner` (an allocation ID or a claim UID) on the GPUs of
        `devices`, capped at their share and memory: made before the container starts, its
        pipe directory the one the container mounts. Idempotent for the same caps. Raises
        MpsNamespaceError (under MPS v2, with the control daemon down, or when MPS refuses)."""
        with self._lock:
            if self._book is None:
                raise MpsNamespaceError("MPS v2 has no namespaces: the per-slice defaults hold")
            if self._process is None or not self._process.alive():
                raise MpsNamespaceError(
                    f"the MPS control daemon is not running ({self.status.error or 'down'}); "
                    "the container cannot be given an MPS namespace now"
                )
            try:
                return self._book.provision(owner, devices)
            finally:
                self._refresh_status()

    def release(self, owner: str) -> None:
        """`owner`'s container is gone: its namespace is deleted, now or as soon as no client
        is attached. Never raises; a no-op under MPS v2 or for an unknown owner."""
        with self._lock:
            if self._book is None:
                return
            self._book.release(owner)
            self._refresh_status()

    # --- drains and wedges ------------------------------------------------------------------

    def drain(self, pid: int) -> Drain:
        """Terminate `pid` through the control daemon, if it is an MPS client, bounded by
        `options.drain_timeout_s`; a wedge restarts MPS. Logged and counted. Never raises."""
        with self._lock:
            return self._drain(pid)

    def stop_client(self, pid: int, kill: Callable[[], T]) -> T:
        """`kill()` (which stops process `pid`) after draining `pid`: the callable the
        enforcer is given as its way to stop a process safely. The caller resumes a stopped
        process first."""
        with self._lock:
            self._drain(pid)
            return kill()

    def _drain(self, pid: int) -> Drain:
        process = self._process
        took_s = 0.0
        if process is None or not process.alive():
            drain = Drain(DrainOutcome.UNREACHABLE, "the MPS control daemon is not running")
        else:
            started = time.monotonic()
            drain = self._drainer.drain(pid)
            took_s = time.monotonic() - started
        if drain.outcome is DrainOutcome.NOT_A_CLIENT:
            return drain
        if drain.outcome is DrainOutcome.DRAINED:
            self._drains += 1
            self._watch.note_drained(pid)
            log.warning("MPS client drained before its stop pid=%d took_s=%.2f", pid, took_s)
        elif drain.outcome is DrainOutcome.UNREACHABLE:
            self._undrained += 1
            log.error(
                "MPS client cannot be drained before its stop: the control daemon did not "
                "answer; stopped without a drain pid=%d error=%s",
                pid,
                drain.detail,
            )
        else:
            self._wedged(f"the drain of client {pid} did not return: {drain.detail}")
        self._refresh_status()
        return drain

    def _watch_for_wedges(self) -> None:
        """List the clients (those running as root are flagged); with a canary, run it where
        a client left without a drain, and every `canary_interval_s` everywhere."""
        options = self.options
        now = time.monotonic()
        try:
            clients = self._drainer.clients()
        except MpsCommandError as e:
            log.debug("MPS clients not listed error=%s", e)
            return
        flagged = self._root.pids
        if self._root.look(clients) != flagged:
            self._refresh_status()
        if options.canary is None:
            return
        left = self._watch.left_undrained(clients)
        periodic = options.canary_interval_s > 0 and now >= self._next_canary_s
        if not left and not periodic:
            return
        if periodic:
            self._next_canary_s = now + options.canary_interval_s
        if left:
            log.info(
                "MPS clients left without a drain; running the canary pids=%s",
                ",".join(map(str, sorted(left))),
            )
        servers = None if self._book is None else sorted(self._book.servers())
        for target in canary_targets(self.pipe_directory, servers, self._defaults):
            result = run_canary(options.canary, self.runner.env, target, options.canary_timeout_s)
            if result.hung:
                self._wedged(result.error)
                return
            if result.error and result.error != self._canary_error:
                log.warning(
                    "MPS canary failed (not a hang: not taken for a wedge) error=%s", result.error
                )
            self._canary_error = result.error
        self._refresh_status()

    def _wedged(self, why: str) -> None:
        """The GPU is wedged: log, count, restart MPS (configured again)."""
        self._wedges += 1
        log.error(
            "MPS is wedged; restarting it (every MPS client on the node loses its server) "
            "wedges=%d reason=%s",
            self._wedges,
            why,
        )
        self._quit(force_after_s=WEDGE_QUIT_TIMEOUT_S)
        self._attempted = True
        self._set_status(up=False, error=f"restarting after a wedge: {why}")
        self._restart(self._defaults, time.monotonic())
