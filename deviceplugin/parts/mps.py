"""The node's MPS control daemon as an optional part (docs/design.md §10): when `mps.enabled`,
started after the first poll (its per-slice defaults follow the slicing), supervised, and sent
quit on every exit path. A reload that changes `mps` sends the running one quit and starts one
with the new settings; a start that fails then is logged and retried by the supervisor, and the
daemon keeps serving.

The protocol is chosen at each start (`mps.protocol`; `auto`: MPS v3 where the driver and the
control command offer it, `detect_protocol`), and under MPS v3 the canary watches for wedges.

Besides the supervision it is what the rest of the daemon asks of MPS:
- the kubelet frontends' `ContainerNamespaces` (deviceplugin.mpsnamespaces): under MPS v3 a
  namespace per allocation, made before its container starts (`provision`), and deleted once
  the allocation book no longer holds the allocation (checked with every supervision step, a
  namespace made in the last RELEASE_GRACE_S kept: its Allocate may not have recorded it yet);
  at each start of its supervision (the daemon's start, a reload) the namespaces of the
  allocations the book holds are provisioned again: taken over unchanged, or made again with
  the caps they were made with (a reload never changes what a running allocation was given);
- the enforcer's way to stop a process for good (`stop_client`): with MPS on, drained through
  the control daemon first (deviceplugin.gpu.mps.drain), else the plain kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from deviceplugin.allocation import (
    DeviceLimits,
    mps_defaults,
    mps_log_directory,
    mps_pipe_directory,
)
from deviceplugin.config import Config, MpsConfig, MpsProtocol
from deviceplugin.errors import StartupError
from deviceplugin.model import AllocationRecord, Inventory, MpsNamespace, MpsStatus
from deviceplugin.mpsnamespaces import NamespaceRefusedError, grant_limits
from deviceplugin.state import Published

if TYPE_CHECKING:
    # Imported where used: the MPS control daemon only where MPS is on.
    from deviceplugin.gpu.mps import Detection, MpsControlDaemon

log = logging.getLogger(__name__)

T = TypeVar("T")
# A namespace made this recently is not deleted for want of an allocation: its Allocate (or
# prepare) may not have recorded the allocation yet, or may have failed (then it goes after).
RELEASE_GRACE_S = 30.0
# How long a container's Allocate waits for a control daemon a reload is starting.
READY_TIMEOUT_S = 30.0
V3 = 3


class MpsPart:
    """An `optional.OptionalPart`: the MPS control daemon, when the config turns it on; the
    frontends' `mpsnamespaces.ContainerNamespaces`; the enforcer's `StopProcess`."""

    name = "mps"

    def __init__(
        self,
        config: MpsConfig,
        inventory: Published[Inventory],
        *,
        allocations: Callable[[], Iterable[AllocationRecord]] = tuple,
        driver_version: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._config = config
        self._inventory = inventory
        # The allocations the daemon holds now (the allocation book, on the event loop).
        self._allocations = allocations
        # The GPU driver's version (NVML's), for the protocol's detection; None where unknown.
        self._driver_version = driver_version
        self.daemon: MpsControlDaemon | None = None
        self.detection: Detection | None = None
        # Clear while a control daemon is being started (a reload): provisions wait for it.
        self._ready = asyncio.Event()
        # When each owner's namespace was provisioned last (monotonic).
        self._provisioned: dict[str, float] = {}
        self._refused: set[str] = set()
        self.release_grace_s = RELEASE_GRACE_S

    @property
    def active(self) -> bool:
        return self.daemon is not None

    @property
    def status(self) -> MpsStatus | None:
        """For /healthz and /status; None unless MPS is on."""
        return None if self.daemon is None else self.daemon.status

    async def start(self) -> None:
        try:
            if self._config.enabled:
                self.daemon = daemon = await asyncio.to_thread(self._make, self._config)
                await asyncio.to_thread(daemon.start, mps_defaults(self._inventory.value.plans))
        finally:
            self._ready.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Supervise until `stop`: every check off the event loop, then the namespaces of
        allocations gone deleted. First the namespaces of the allocations held now."""
        daemon = self.daemon
        if daemon is None:
            return
        await self._adopt(daemon)
        inventory = self._inventory
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), daemon.check_interval_s)
            if stop.is_set():
                return
            await asyncio.to_thread(daemon.supervise_once, mps_defaults(inventory.value.plans))
            await self._release_gone(daemon)

    def affected(self, old: Config, new: Config) -> bool:
        return new.mps != old.mps

    async def replace(self, new: Config) -> None:
        self._ready.clear()
        try:
            await self._replace(new.mps)
        finally:
            self._ready.set()

    async def _replace(self, config: MpsConfig) -> None:
        self._config = config
        if self.daemon is not None:
            await asyncio.to_thread(self.daemon.stop)
            self.daemon = None
            log.info("config reload: MPS control daemon stopped")
        if not config.enabled:
            return
        try:
            self.daemon = daemon = await asyncio.to_thread(self._make, config)
            await asyncio.to_thread(daemon.start, mps_defaults(self._inventory.value.plans))
        except StartupError as e:
            log.error("config reload: %s; retrying", e)

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    # --- the control daemon ------------------------------------------------------------------

    def _make(self, config: MpsConfig) -> MpsControlDaemon:
        """A control daemon (not started) with the protocol `config` asks for or the node
        offers. Raises StartupError where `mps.protocol: v3` is not offered."""
        from deviceplugin.gpu.mps import (  # noqa: PLC0415 (only where MPS is on)
            MpsControlDaemon,
            MpsOptions,
            default_canary,
        )

        self.detection = detection = self._detect(config)
        log.info("MPS protocol chosen protocol=%d reason=%s", detection.protocol, detection.reason)
        canary = None
        if detection.protocol == V3:
            # mps.canaryCommand, else a CUDA context through libcuda.
            canary = tuple(shlex.split(config.canary_command or "")) or default_canary()
        return MpsControlDaemon(
            config, options=MpsOptions(protocol=detection.protocol, canary=canary)
        )

    def _detect(self, config: MpsConfig) -> Detection:
        from deviceplugin.gpu.mps import (  # noqa: PLC0415 (only where MPS is on)
            V2,
            ControlCommand,
            Detection,
            detect_protocol,
        )

        if config.protocol is MpsProtocol.V2:
            return Detection(V2, "mps.protocol is v2")
        env = {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": mps_pipe_directory(config.root),
            "CUDA_MPS_LOG_DIRECTORY": mps_log_directory(config.root),
        }
        detection = detect_protocol(
            ControlCommand(config.control_command, env), self._driver_version()
        )
        if config.protocol is MpsProtocol.V3 and detection.protocol != V3:
            raise StartupError(
                f"mps.protocol is v3, but MPS v3 is not offered here: {detection.reason}; "
                "set mps.protocol: auto (or v2)"
            )
        return detection

    # --- the enforcer's stop -----------------------------------------------------------------

    def stop_client(self, pid: int, kill: Callable[[], T]) -> T:
        """`kill()`, after draining `pid` through the control daemon while MPS is on (the
        enforcer's `StopProcess`; it resumes a stopped process first). On the poll worker."""
        daemon = self.daemon
        return kill() if daemon is None else daemon.stop_client(pid, kill)

    # --- MPS v3 namespaces -------------------------------------------------------------------

    async def provision(self, owner: str, limits: Sequence[DeviceLimits]) -> MpsNamespace | None:
        """`mpsnamespaces.ContainerNamespaces`: under MPS v3 the namespace of allocation
        `owner`, made now (off the event loop); None otherwise. Raises NamespaceRefusedError."""
        try:
            await asyncio.wait_for(self._ready.wait(), READY_TIMEOUT_S)
        except TimeoutError:
            raise NamespaceRefusedError(
                f"the MPS control daemon has been restarting for {READY_TIMEOUT_S:g} s after a "
                "config reload; see the daemon's log"
            ) from None
        daemon = self.daemon
        if daemon is None or daemon.protocol != V3:
            return None
        return await self._provision(daemon, owner, limits)

    async def _provision(
        self, daemon: MpsControlDaemon, owner: str, limits: Sequence[DeviceLimits]
    ) -> MpsNamespace:
        from deviceplugin.gpu.mps import MpsNamespaceError  # noqa: PLC0415

        try:
            ns = await asyncio.to_thread(daemon.provision, owner, limits)
        except MpsNamespaceError as e:
            raise NamespaceRefusedError(str(e)) from e
        self._provisioned[owner] = time.monotonic()
        self._refused.discard(owner)
        return ns

    async def _adopt(self, daemon: MpsControlDaemon) -> None:
        """Under MPS v3, the namespace of every allocation held now, with the caps it was
        granted: one the control daemon still has is taken over as it is."""
        if daemon.protocol != V3:
            return
        for record in list(self._allocations()):
            owner = record.allocation_id
            try:
                await self._provision(daemon, owner, grant_limits(record.grants))
            except NamespaceRefusedError as e:
                if owner not in self._refused:
                    self._refused.add(owner)
                    log.warning(
                        "the MPS namespace of a running allocation cannot be made again; its "
                        "containers' MPS clients find no server until it can allocation=%s "
                        "error=%s",
                        owner,
                        e,
                    )

    async def _release_gone(self, daemon: MpsControlDaemon) -> None:
        """Delete the namespaces of allocations the book no longer holds."""
        if daemon.protocol != V3:
            return
        live = {r.allocation_id for r in self._allocations()}
        now = time.monotonic()
        for ns in daemon.status.namespaces:
            made = self._provisioned.get(ns.owner, 0.0)
            if ns.owner in live or now - made < self.release_grace_s:
                continue
            log.info("allocation gone; deleting its MPS namespace allocation=%s", ns.owner)
            await asyncio.to_thread(daemon.release, ns.owner)
            self._provisioned.pop(ns.owner, None)
            self._refused.discard(ns.owner)
