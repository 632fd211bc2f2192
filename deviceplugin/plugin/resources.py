"""Several resources per node: one plugin endpoint per extended resource, fed by one inventory.

A node advertises full GPUs under one resource name and, with the mixed MIG strategy, each MIG
profile under its own (`nvidia.com/mig-1g.10gb`). The kubelet knows a device plugin by resource:
each needs its own socket, registration and ListAndWatch stream. `ResourcePlugins` keeps one
`ResourceEndpoint` (a published slice list, a DevicePluginService and a PluginLifecycle) per
resource that the inventory names, plus the primary resource, which is always served (a new
`resourceName` makes another resource primary: `set_primary`):

- `reconcile(inventory)` is the one place that decides which endpoints exist. It publishes each
  resource's part of the inventory to its endpoint (its ListAndWatch streams wake), creates
  endpoints for new resources and stops those whose resource has no slice left. The poll loop
  calls it after every poll (a poll that changed nothing hands the same inventory, which costs
  nothing); a MIG re-partitioning or a new config goes through it the same way.
  A resource whose devices vanished while allocated keeps its (Unhealthy) slices in the inventory
  until the kubelet frees them, so its endpoint stays until then.
- `run(stop)` runs every endpoint's life cycle concurrently: a kubelet restart makes each of them
  register again on its own, and one resource that the kubelet refuses or whose stream breaks
  never holds up the others. An endpoint that is stopped removes its socket; one re-created for
  the same resource starts only once the old one has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from deviceplugin.model import Inventory
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.state import Published

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ResourceEndpoint:
    """One resource's plugin: what it advertises, its gRPC service and its registration."""

    resource_name: str
    inventory: Published[Inventory]
    service: DevicePluginService
    lifecycle: PluginLifecycle
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


EndpointFactory = Callable[[str, Published[Inventory]], ResourceEndpoint]


class ResourcePlugins:
    """The set of resource endpoints, reconciled with the inventory. Runs on the event loop."""

    def __init__(self, primary: ResourceEndpoint, make: EndpointFactory) -> None:
        self.primary = primary.resource_name
        self._make = make
        self._endpoints: dict[str, ResourceEndpoint] = {primary.resource_name: primary}
        # The served resources and their endpoints, replaced whole: the poll worker's thread
        # reads them too (health, the checkpoint's resources).
        self.names: frozenset[str] = frozenset(self._endpoints)
        self._all: tuple[ResourceEndpoint, ...] = tuple(self._endpoints.values())
        # Endpoints being stopped, by resource: a new endpoint for the same resource waits for
        # the old one, which removes its socket on the way out.
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        # Names this node served and no longer does (a reload renamed the primary resource), or
        # that pod-resources lists for slices of ours: allocations under them are still ours.
        self._retired: frozenset[str] = frozenset()
        # The inventory (this very object), primary resource and slices held under another name
        # of the last `reconcile`: a poll that changed nothing hands the same inventory again,
        # and then nothing is to be done.
        self._reconciled: tuple[Inventory, str, frozenset[tuple[str, str]]] | None = None

    def __iter__(self) -> Iterator[ResourceEndpoint]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._endpoints)

    @property
    def retired(self) -> frozenset[str]:
        """Names this node no longer serves whose allocations are still its own."""
        return self._retired - self.names

    @property
    def known_names(self) -> frozenset[str]:
        """The served names and the retired ones: allocations under any of them are ours."""
        return self.names | self._retired

    def retire(self, resource_name: str) -> None:
        """Count allocations under `resource_name` (not served) as this node's: pod-resources
        lists it for slices of ours (a daemon restarted after a rename)."""
        if resource_name not in self.names and resource_name not in self.retired:
            log.warning(
                "allocations under a resource this node no longer serves; held until the kubelet "
                "frees them resource=%s",
                resource_name,
            )
            self._retired = self._retired | {resource_name}

    def get(self, resource_name: str) -> ResourceEndpoint | None:
        return self._endpoints.get(resource_name)

    @property
    def primary_endpoint(self) -> ResourceEndpoint:
        return self._endpoints[self.primary]

    def set_primary(self, resource_name: str) -> None:
        """Serve the primary resource (full GPUs, and MIG devices under the single strategy)
        under `resource_name` from now on (a renamed `resourceName`). Its endpoint starts at
        once, counting registrations on from the old one; the old name's endpoint stays until
        `reconcile` finds no slice left under it."""
        if resource_name == self.primary:
            return
        old = self._endpoints[self.primary]
        endpoint = self._endpoints.get(resource_name)
        if endpoint is None:
            endpoint = self._make(resource_name, Published(Inventory()))
            endpoint.lifecycle.stats = dataclasses.replace(old.lifecycle.stats)
            self._endpoints[resource_name] = endpoint
            log.info("resource added resource=%s", resource_name)
            self._changed.set()
        # Allocations made under the old name stay this node's until the kubelet frees them.
        self._retired = (self._retired | {self.primary}) - {resource_name}
        self.primary = resource_name
        self.names = frozenset(self._endpoints)
        self._all = tuple(self._endpoints.values())

    def reconcile(self, inventory: Inventory, held_elsewhere: Mapping[str, str] = {}) -> None:
        """Make the endpoints match `inventory`: each resource it names (and the primary one) has
        an endpoint advertising its slices; endpoints of resources it no longer names stop. A
        slice in `held_elsewhere` (slice ID -> the other resource name an allocation holds it
        under: a renamed resource) is advertised Unhealthy, so the kubelet does not hand it out
        a second time under its new name while it is held."""
        held = frozenset(held_elsewhere.items())
        last = self._reconciled
        if (
            last is not None
            and last[0] is inventory
            and last[1] == self.primary
            and last[2] == held
        ):
            return
        desired = {self.primary, *inventory.resource_names}
        for name in sorted(desired):
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                endpoint = self._make(name, Published(Inventory()))
                self._endpoints[name] = endpoint
                log.info("resource added resource=%s", name)
                self._changed.set()
            part = inventory.for_resource(name)
            if held_elsewhere and any(s.device_id in held_elsewhere for s in part.slices):
                part = Inventory.of(
                    part.plans,
                    (
                        dataclasses.replace(s, healthy=False)
                        if s.device_id in held_elsewhere
                        else s
                        for s in part.slices
                    ),
                )
            endpoint.inventory.set(part)
        for name in [n for n in self._endpoints if n not in desired]:
            endpoint = self._endpoints.pop(name)
            endpoint.stop.set()
            if endpoint.task is not None and not endpoint.task.done():
                self._stopping[name] = endpoint.task
            log.info("resource removed: it has no slice left resource=%s", name)
            self._changed.set()
        self.names = frozenset(self._endpoints)
        self._all = tuple(self._endpoints.values())
        self._reconciled = (inventory, self.primary, held)

    async def _run_endpoint(self, endpoint: ResourceEndpoint) -> None:
        previous = self._stopping.get(endpoint.resource_name)
        if previous is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(previous)
        if not endpoint.stop.is_set():
            await endpoint.lifecycle.run(endpoint.stop)

    async def run(self, stop: asyncio.Event) -> None:
        """Run every endpoint until `stop`; endpoints added later start at once."""
        async with asyncio.TaskGroup() as tasks:
            while True:
                for endpoint in self._endpoints.values():
                    if endpoint.task is None:
                        endpoint.task = tasks.create_task(
                            self._run_endpoint(endpoint), name=f"plugin {endpoint.resource_name}"
                        )
                for name, task in list(self._stopping.items()):
                    if task.done():
                        del self._stopping[name]
                if stop.is_set():
                    for endpoint in self._endpoints.values():
                        endpoint.stop.set()
                    return
                self._changed.clear()
                waiters = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self._changed.wait()),
                }
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()


__all__ = ["EndpointFactory", "ResourceEndpoint", "ResourcePlugins"]
