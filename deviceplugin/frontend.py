"""The seam between the daemon and the kubelet: how the node's GPUs are served to it.

Two implementations, one per kubelet API, each in its own package: device plugins
(`plugin.frontend.DevicePluginFrontend`: one extended resource per socket, slices as device IDs,
allocations from Allocate and pod-resources) and a DRA driver (`dra.frontend.DraFrontend`: a
ResourceSlice of devices with consumable memory and compute, allocations from prepared claims).
The composition root builds exactly one (`frontend: KubeletFrontend = ...`, so that mypy checks
each against this Protocol) and nothing of the other; everything else in the daemon (the poll,
attribution, the enforcer, /status, the metrics) sees allocations and their grants, whichever
frontend made them.

What a frontend does, and on which thread:
- publish the inventory: `view` (poll worker: what the poll publishes of the inventory it
  built) and `publish` (event loop, after each poll: hand it to the kubelet);
- answer who owns an allocation: `evidence` (poll worker), attribution's evidence;
- its health: `health` (any thread), registration and pod-resources for /healthz and /status;
- its life: `announce` the start, `recover` before the first poll, `prime` after it and before
  the kubelet hears of the node, `run` until the daemon stops;
- a live reload: `refuses` a config this node cannot serve (before anything is applied),
  `reconfigure` to the new config, and `verdict` once it is applied (what the kubelet's side
  says of it: the API server's answer in DRA mode).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from deviceplugin.config import Config
from deviceplugin.memlimits.source import LimitSource
from deviceplugin.model import Inventory
from deviceplugin.owners import AllocationOwners

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


@dataclass(frozen=True, slots=True)
class FrontendHealth:
    """A frontend's state, for /healthz, /status and the self-metrics."""

    # Registered with the kubelet now (every resource, holding its stream, for device plugins).
    registered: bool = False
    # Monotonic time since which it has not been; 0 while registered.
    unregistered_since_s: float = 0.0
    registrations_total: int = 0
    registration_failures_total: int = 0
    # Whether pod-resources answered the last ask.
    pod_resources_ok: bool = False
    # Whether the kubelet has had the node's inventory once (a device list sent, or a
    # registration failed: no kubelet to wait for). The daemon starts what it imports late then.
    listed: bool = False
    # Why /healthz fails on the frontend's own account, saying what to do; "" when it does not.
    problem: str = ""


class KubeletFrontend(Protocol):
    """How the kubelet is served (see the module's docstring)."""

    # What /status and the metrics speak: model.SOURCE_DEVICE_PLUGIN or model.SOURCE_DRA.
    kind: str

    def announce(self, backend_name: str) -> None:
        """Log the daemon's start line: what it serves, on which backend, with which settings."""
        ...

    def view(self, built: Inventory) -> Inventory:
        """What the poll publishes of the inventory it built (poll worker)."""
        ...

    def publish(self, inventory: Inventory) -> None:
        """Hand the published inventory to the kubelet (event loop, after each poll)."""
        ...

    def evidence(self) -> AllocationOwners:
        """Who holds which allocation, as attribution checks it (poll worker)."""
        ...

    def health(self, now_mono_s: float) -> FrontendHealth: ...

    def register_metrics(self, registry: CollectorRegistry, node_name: str) -> None:
        """Add the frontend's own metrics, if any, to the daemon's registry."""
        ...

    def recover(self) -> None:
        """Before the first poll: take back what it held before a restart that the enforcer
        must know at once. Raises StartupError."""
        ...

    async def prime(self) -> None:
        """After the first poll, before the kubelet hears of the node: what is held now."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Serve the kubelet until `stop`; raising ends the daemon."""
        ...

    def refuses(self, config: Config) -> list[str]:
        """Why `config` cannot be served on this node (checked before a reload applies it)."""
        ...

    async def reconfigure(self, old: Config, new: Config) -> None: ...

    async def verdict(self) -> str:
        """Once a reload is applied: why the kubelet's side refuses it ("" when it does not);
        the reload is then undone."""
        ...

    def limit_source(self) -> LimitSource:
        """What its allocations give a container's GPU memory, for the memory-limit hook
        (docs/design.md §15)."""
        ...
