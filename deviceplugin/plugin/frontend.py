"""The device-plugin frontend (the default, `--kubelet-api device-plugin`): the daemon's GPUs
served to the kubelet as device plugins, one endpoint per extended resource (`resources`), each
with its gRPC service (`server`) and its registration (`lifecycle`); the allocations are kept
in step with pod-resources and the kubelet's device checkpoint (`tracker`), which is also
attribution's evidence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin import __version__
from deviceplugin.config import Config
from deviceplugin.frontend import FrontendHealth
from deviceplugin.kubelet.checkpoint import CHECKPOINT_FILE, CheckpointReader
from deviceplugin.memlimits.cdihook import AllocationSpecs
from deviceplugin.memlimits.sources import AllocationSource
from deviceplugin.model import SOURCE_DEVICE_PLUGIN, Inventory
from deviceplugin.mpsnamespaces import NO_NAMESPACES, ContainerNamespaces
from deviceplugin.owners import AllocationOwners
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.resources import ResourceEndpoint, ResourcePlugins
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.plugin.tracker import POD_RESOURCES_INTERVAL_S, AllocationTracker
from deviceplugin.state import AllocationBook, Published

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


class DevicePluginFrontend:
    """A `frontend.KubeletFrontend` speaking the device-plugin API."""

    kind = SOURCE_DEVICE_PLUGIN

    def __init__(
        self,
        config: Config,
        book: AllocationBook,
        inventory: Published[Inventory],
        *,
        plugin_dir: Path,
        pod_resources_socket: Path,
        names_wanted: asyncio.Event,
        pod_resources_interval_s: float = POD_RESOURCES_INTERVAL_S,
        on_allocate_duration: Callable[[float], None] = lambda seconds: None,
        on_allocated: Callable[[], None] = lambda: None,
        hook_specs: AllocationSpecs | None = None,
        mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
    ) -> None:
        # The running config: endpoints made from now on answer Allocate with it.
        self._config = config
        self._mps_namespaces = mps_namespaces
        self._book = book
        self._inventory = inventory
        self._plugin_dir = plugin_dir
        self._names_wanted = names_wanted
        self._on_allocate_duration = on_allocate_duration
        self._on_allocated = on_allocated
        self._hook_specs = hook_specs
        # One plugin endpoint per resource; the primary one (resourceName) always exists.
        primary = self._make_endpoint(config.resource_name, Published(Inventory()))
        self.resources = ResourcePlugins(primary, self._make_endpoint)
        # Attribution's evidence, read by the poll worker: the checkpoint's entries of the
        # resources this node serves (or served: a renamed resource's allocations are its own).
        self._checkpoint = CheckpointReader(
            plugin_dir / CHECKPOINT_FILE, lambda: self.resources.known_names
        )
        self.tracker = AllocationTracker(
            book,
            pod_resources_socket,
            lambda: self.resources.known_names,
            interval_s=pod_resources_interval_s,
            # A reader of its own (the poll worker's is read on another thread), of every
            # resource: the tracker keeps the entries that are this node's.
            checkpoint=CheckpointReader(plugin_dir / CHECKPOINT_FILE, None).read,
            adopt=self._adopt,
        )

    @property
    def service(self) -> DevicePluginService:
        """The primary resource's (`resourceName`) plugin service."""
        return self.resources.primary_endpoint.service

    @property
    def lifecycle(self) -> PluginLifecycle:
        """The primary resource's plugin life cycle."""
        return self.resources.primary_endpoint.lifecycle

    @lifecycle.setter
    def lifecycle(self, lifecycle: PluginLifecycle) -> None:
        # Before run(): a life cycle made otherwise (a test's watch settings) for the primary.
        self.resources.primary_endpoint.lifecycle = lifecycle

    def announce(self, backend_name: str) -> None:
        log.info(
            "starting vgpu device plugin version=%s backend=%s resource=%s device_plugin_dir=%s",
            __version__,
            backend_name,
            self._config.resource_name,
            self._plugin_dir,
        )

    def _make_endpoint(
        self, resource_name: str, inventory: Published[Inventory]
    ) -> ResourceEndpoint:
        # The service and the endpoint refer to each other; the lambdas resolve the endpoint's
        # life cycle when they are called, after it exists (and after it is replaced).
        endpoint: list[ResourceEndpoint] = []
        service = DevicePluginService(
            self._config,
            inventory,
            self._book,
            generation=lambda: endpoint[0].lifecycle.generation(),  # noqa: PLW0108
            on_stream_end=lambda generation: endpoint[0].lifecycle.stream_ended(generation),  # noqa: PLW0108
            on_allocate_duration=self._on_allocate_duration,
            # The kubelet lists an allocation in pod-resources right after Allocate: ask soon,
            # so that the container's series and any action on it carry its pod's name.
            on_allocated=self._on_allocated,
            resource_name=resource_name,
            hook_specs=self._hook_specs,
            mps_namespaces=self._mps_namespaces,
        )
        lifecycle = PluginLifecycle(
            service, plugin_dir=self._plugin_dir, resource_name=resource_name
        )
        endpoint.append(ResourceEndpoint(resource_name, inventory, service, lifecycle))
        return endpoint[0]

    # --- the inventory, the evidence and health --------------------------------------------

    def view(self, built: Inventory) -> Inventory:
        return built

    def publish(self, inventory: Inventory) -> None:
        """Bring the plugin endpoints in line with the inventory: every resource it names is
        served and registered, with its slices; a resource with no slice left (none even held
        by an allocation) is stopped. Called after every poll; whatever changes the inventory (a
        MIG layout change, a new config) ends here. Slices held under another name (a renamed
        resource) are advertised Unhealthy until the kubelet frees them."""
        self.resources.reconcile(inventory, self._book.held_elsewhere(inventory.by_id))
        self._book.retired = self.resources.retired

    def evidence(self) -> AllocationOwners:
        return self._checkpoint.read()

    def _adopt(self, resource_name: str, device_ids: Sequence[str]) -> bool:
        """Whether allocations that pod-resources lists under `resource_name`, which this node
        does not serve, are still this node's: every device is one of its slices (a daemon
        restarted after a rename). Such a name counts as retired from then on."""
        by_id = self._inventory.value.by_id
        if not device_ids or not all(d in by_id for d in device_ids):
            return False
        self.resources.retire(resource_name)
        self._book.retired = self.resources.retired
        return True

    def health(self, now_mono_s: float) -> FrontendHealth:
        # Registered only when every resource is and holds its stream (a registration that holds
        # no stream counts as none, so /healthz fails in time); unregistered since the earliest.
        endpoints = tuple(self.resources)
        lifecycles = [e.lifecycle for e in endpoints]
        since = [
            t
            for lc in lifecycles
            for t in (lc.unregistered_since_s, lc.unstable_since_s)
            if t > 0 and (not lc.registered or lc.unstable_since_s)
        ]
        return FrontendHealth(
            registered=all(lc.registered and not lc.unstable_since_s for lc in lifecycles),
            unregistered_since_s=min(since, default=0.0),
            registrations_total=sum(lc.stats.registrations for lc in lifecycles),
            registration_failures_total=sum(lc.stats.registration_failures for lc in lifecycles),
            pod_resources_ok=self.tracker.ok,
            listed=any(
                e.service.lists_sent or e.lifecycle.stats.registration_failures for e in endpoints
            ),
        )

    def register_metrics(self, registry: CollectorRegistry, node_name: str) -> None:
        """None of its own: Allocate's durations are the daemon's metrics."""

    # --- running ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Nothing of its own to take back: the kubelet knows the allocations (`prime`)."""

    async def prime(self) -> None:
        """Who holds what, before the first device list goes out: a slice held under a name
        this node no longer serves must not be offered as free, not even once."""
        await self.tracker.prime()

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.resources.run(stop), name="plugins")
            tasks.create_task(self.tracker.run(stop, self._names_wanted), name="pod-resources")

    # --- a live reload ----------------------------------------------------------------------

    def refuses(self, config: Config) -> list[str]:
        return []

    async def reconfigure(self, old: Config, new: Config) -> None:
        """Every resource's endpoint answers Allocate with the new settings (endpoints made from
        now on take them too); a renamed primary resource is served and registered under the new
        name at once, the old name's endpoint going once no slice is left under it."""
        self._config = new
        for endpoint in self.resources:
            endpoint.service.reconfigure(new)
        if new.resource_name != old.resource_name:
            log.warning(
                "config reload: resource renamed; registering again old=%s new=%s",
                old.resource_name,
                new.resource_name,
            )
            self.resources.set_primary(new.resource_name)
            self.publish(self._inventory.value)

    async def verdict(self) -> str:
        return ""

    def limit_source(self) -> AllocationSource:
        """The allocation book's grants, for the pods the kubelet's checkpoint gives them to
        (a reader of its own: it is read off the event loop)."""
        reader = CheckpointReader(
            self._plugin_dir / CHECKPOINT_FILE, lambda: self.resources.known_names
        )
        return AllocationSource(self._book, reader.read)
