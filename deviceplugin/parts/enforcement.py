"""The enforcer the poll hands each snapshot to, as a part of the running daemon: made when the
daemon starts (with `listing_first`, once the kubelet has the first device list), replaced
between two polls when a reload changes `enforcement` (the old one first resumes every process
it holds stopped), and closed on every exit path (resuming what it holds stopped)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin.config import Config, EnforcementConfig
from deviceplugin.model import NodeSnapshot
from deviceplugin.statedir import make_state_dir

if TYPE_CHECKING:
    # Imported where used: `serve` starts the enforcer (and psutil) once the kubelet has the
    # first device list.
    from deviceplugin.enforcer import Enforcer
    from deviceplugin.enforcer.stopping import StopProcess


class Enforcement:
    """The running enforcer, if any: None until `start`."""

    def __init__(
        self,
        config: EnforcementConfig,
        state_dir: Path,
        *,
        container_now: Callable[[int], str | None],
        between_polls: Callable[[Callable[[], None]], concurrent.futures.Future[None]],
        stop_process: StopProcess | None = None,
    ) -> None:
        self._config = config
        self._state_dir = state_dir
        # The pod container a process is in now, read afresh (for a check before a signal).
        self._container_now = container_now
        # Runs a call on the poll worker, between two polls.
        self._between_polls = between_polls
        # How a process is stopped for good (with MPS: drained first); None: the plain kill.
        self._stop_process = stop_process
        self.enforcer: Enforcer | None = None

    def enforce(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """The snapshot, acted on and annotated by the enforcer (as it is, before one runs)."""
        enforcer = self.enforcer
        return snapshot if enforcer is None else enforcer.on_snapshot(snapshot)

    async def start(self) -> None:
        """Make the enforcer (off the event loop: it reads its record and resumes what a daemon
        killed outright left stopped, before anything else runs); one with the settings of a
        reload that came meanwhile."""
        self.enforcer = await asyncio.to_thread(self._make)
        if self.enforcer.config != self._config:
            await self._replace()

    def _make(self) -> Enforcer:
        from deviceplugin.enforcer import (  # noqa: PLC0415
            Enforcer,
            PsutilControl,
            RecordingControl,
            plain_stop,
        )

        cfg = self._config
        state_dir = make_state_dir(self._state_dir)
        # A signal is held back from a process that left its pod container since it was
        # attributed (read afresh right before each SIGKILL or SIGSTOP).
        control = RecordingControl() if cfg.dry_run else PsutilControl(where=self._container_now)
        stop_process = self._stop_process or plain_stop
        enforcer = Enforcer(cfg, state_dir, control=control, stop_process=stop_process)
        # Resume whatever a daemon killed outright left stopped, before anything else runs.
        enforcer.recover()
        return enforcer

    async def reconfigure(self, old: Config, new: Config) -> None:
        self._config = new.enforcement
        if new.enforcement != old.enforcement:
            await self._replace()

    async def _replace(self) -> None:
        """Swap in an enforcer with the current settings, between two polls (so that no snapshot
        is half enforced). The old one resumes what it holds stopped."""

        def swap() -> None:
            old = self.enforcer
            if old is None:
                return
            old.close()
            self.enforcer = self._make()

        await asyncio.wrap_future(self._between_polls(swap))

    def close(self) -> None:
        """Every process it holds stopped runs again, whatever ended the daemon."""
        if self.enforcer is not None:
            self.enforcer.close()
