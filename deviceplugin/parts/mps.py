"""The node's MPS control daemon as an optional part (docs/design.md §10): when `mps.enabled`,
started after the first poll (its per-slice defaults follow the slicing), supervised, and sent
quit on every exit path. A reload that changes `mps` sends the running one quit and starts one
with the new settings; a start that fails then is logged and retried by the supervisor, and the
daemon keeps serving."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from deviceplugin.allocation import mps_defaults
from deviceplugin.config import Config, MpsConfig
from deviceplugin.errors import StartupError
from deviceplugin.model import Inventory, MpsStatus
from deviceplugin.state import Published

if TYPE_CHECKING:
    # Imported where used: the MPS control daemon only where MPS is on.
    from deviceplugin.gpu.mps import MpsControlDaemon

log = logging.getLogger(__name__)


class MpsPart:
    """An `optional.OptionalPart`: the MPS control daemon, when the config turns it on."""

    name = "mps"

    def __init__(self, config: MpsConfig, inventory: Published[Inventory]) -> None:
        self._inventory = inventory
        self.daemon = _control_daemon(config) if config.enabled else None

    @property
    def active(self) -> bool:
        return self.daemon is not None

    @property
    def status(self) -> MpsStatus | None:
        """For /healthz and /status; None unless MPS is on."""
        return None if self.daemon is None else self.daemon.status

    async def start(self) -> None:
        if self.daemon is not None:
            await asyncio.to_thread(self.daemon.start, mps_defaults(self._inventory.value.plans))

    async def run(self, stop: asyncio.Event) -> None:
        if self.daemon is not None:
            inventory = self._inventory
            await self.daemon.run(stop, lambda: mps_defaults(inventory.value.plans))

    def affected(self, old: Config, new: Config) -> bool:
        return new.mps != old.mps

    async def replace(self, new: Config) -> None:
        if self.daemon is not None:
            await asyncio.to_thread(self.daemon.stop)
            self.daemon = None
            log.info("config reload: MPS control daemon stopped")
        if not new.mps.enabled:
            return
        self.daemon = daemon = _control_daemon(new.mps)
        try:
            await asyncio.to_thread(daemon.start, mps_defaults(self._inventory.value.plans))
        except StartupError as e:
            log.error("config reload: %s; retrying", e)

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()


def _control_daemon(config: MpsConfig) -> MpsControlDaemon:
    from deviceplugin.gpu.mps import MpsControlDaemon  # noqa: PLC0415 (only where MPS is on)

    return MpsControlDaemon(config)
