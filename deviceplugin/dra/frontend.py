"""The DRA frontend (`--kubelet-api dra`, docs/dra.md): the daemon's GPUs served to the kubelet as
a DRA driver. It puts together the driver (`driver`: prepared claims, prepare and unprepare, the
devices' health), the kubelet-plugin helper that serves and registers it (`kubelet.draplugin`),
and the node's ResourceSlice, which follows the poll's inventory (GPUs, their health, the MIG
layout, a reload's new plan): whenever the devices it would publish change, the publisher
(`publisher`) writes it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin import __version__
from deviceplugin.config import Config
from deviceplugin.dra.driver import DraDriver
from deviceplugin.dra.kubeapi import KubeApi, LightkubeApi, load_config
from deviceplugin.dra.limits import ClaimSource
from deviceplugin.dra.publisher import SlicePublisher
from deviceplugin.dra.settings import DraSettings, device_ids_ignored
from deviceplugin.dra.slices import build_devices, build_slice, slice_problems
from deviceplugin.dra.store import ClaimStore
from deviceplugin.errors import StartupError
from deviceplugin.frontend import FrontendHealth
from deviceplugin.kubelet.draplugin import KubeletPlugin
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.memlimits.cdihook import LimitHooks
from deviceplugin.model import SOURCE_DRA, Inventory, NodeSnapshot
from deviceplugin.mpsnamespaces import NO_NAMESPACES, ContainerNamespaces
from deviceplugin.owners import AllocationOwners
from deviceplugin.slicing import plan_gpus
from deviceplugin.state import AllocationBook, Published

if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

# How long a reload waits for the API server's answer to the new slice.
VERDICT_TIMEOUT_S = 30.0


class DraFrontend:
    """A `frontend.KubeletFrontend` speaking DRA."""

    kind = SOURCE_DRA

    def __init__(
        self,
        settings: DraSettings,
        config: Config,
        state_dir: Path,
        book: AllocationBook,
        inventory: Published[Inventory],
        *,
        api: KubeApi,
        snapshot: Callable[[], NodeSnapshot | None] = lambda: None,
        on_claims_changed: Callable[[], None] = lambda: None,
        pod_resources_socket: Path | None = None,
        hooks: LimitHooks | None = None,
        mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
    ) -> None:
        self.settings = settings
        # The running config (a reload replaces it): new claims get its env settings, the
        # slice its request policies.
        self._config = config
        self._inventory = inventory
        self._api = api
        self.driver = DraDriver(
            settings,
            lambda: self._config,
            state_dir,
            book,
            api,
            snapshot=snapshot,
            on_claims_changed=on_claims_changed,
            pod_resources=(
                None if pod_resources_socket is None else PodResourcesClient(pod_resources_socket)
            ),
            hooks=hooks,
            mps_namespaces=mps_namespaces,
        )
        self.publisher = SlicePublisher(settings, api, self.driver.devices)
        self.plugin = KubeletPlugin(
            self.driver,
            settings.driver_name,
            settings.service_socket,
            settings.registration_socket,
            # A kubelet that starts removes its node's ResourceSlices: publish again.
            on_registered=self._on_registered,
            hint=(f"is --kubelet-root-dir ({settings.kubelet_root_dir}) the kubelet's --root-dir?"),
        )

    @property
    def store(self) -> ClaimStore:
        return self.driver.store

    @property
    def registered(self) -> bool:
        return self.plugin.registered

    def announce(self, backend_name: str) -> None:
        s = self.settings
        log.info(
            "starting vgpu DRA driver version=%s backend=%s driver=%s node=%s "
            "kubelet_root_dir=%s cdi_dir=%s gpu_cdi=%s",
            __version__,
            backend_name,
            s.driver_name,
            s.node_name,
            s.kubelet_root_dir,
            s.cdi_dir,
            s.gpu_cdi.value,
        )

    # --- the inventory, the evidence and health --------------------------------------------

    def view(self, built: Inventory) -> Inventory:
        return self.driver.view(built)

    def publish(self, inventory: Inventory) -> None:
        """After each poll, on the event loop: publish when the devices changed."""
        if self.driver.devices() != self.publisher.attempted:
            self.publisher.request()
            self.driver.health_changed()

    def evidence(self) -> AllocationOwners:
        return self.driver.evidence()

    def health(self, now_mono_s: float) -> FrontendHealth:
        registered = self.plugin.registered
        return FrontendHealth(
            registered=registered,
            unregistered_since_s=0.0 if registered else self.plugin.unregistered_since_s,
            pod_resources_ok=self.driver.users.ok,
            listed=True,
            # The registration's reasons first, then the API server's refusal of the slice.
            problem=self.plugin.unhealthy(now_mono_s) or self.publisher.unhealthy(now_mono_s),
        )

    def register_metrics(self, registry: CollectorRegistry, node_name: str) -> None:
        registry.register(self.publisher.collector(node_name))

    def _on_registered(self) -> None:
        self.publisher.request()

    # --- running ----------------------------------------------------------------------------

    def recover(self) -> None:
        try:
            self.driver.recover()
        except (OSError, ValueError) as e:
            raise StartupError(str(e)) from e

    async def prime(self) -> None:
        """Nothing to ask: the prepared claims, recovered before the first poll, are what is
        held."""

    async def run(self, stop: asyncio.Event) -> None:
        await self.plugin.start()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.plugin.follow(stop), name="dra-registration")
                tasks.create_task(self.driver.run(stop), name="dra-claims")
                watch = tasks.create_task(self.publisher.watch(stop), name="dra-watch")
                try:
                    await self.publisher.run(stop)
                finally:
                    watch.cancel()
        finally:
            await self.plugin.stop()
            await self._api.close()

    # --- a live reload ----------------------------------------------------------------------

    def refuses(self, config: Config) -> list[str]:
        """Why the API server would refuse the ResourceSlice `config` makes for this node's
        devices (its slicing and its `dra` policy); empty when it would take it."""
        gpus = [plan.gpu for plan in self._inventory.value.plans]
        plans = plan_gpus(gpus, config.slicing, mig=config.mig, resource_name=config.resource_name)
        devices = build_devices(
            Inventory(plans=tuple(plans)), config.dra, self.settings.driver_name
        )
        return slice_problems(
            build_slice(self.settings.node_name, self.settings.driver_name, devices, 1)
        )

    async def reconfigure(self, old: Config, new: Config) -> None:
        """New claims get the new config's settings; the next poll republishes the slice with
        its policies."""
        self._config = new
        if new.allocation != old.allocation:
            ignored = device_ids_ignored(new)
            if ignored:
                log.warning("config reload: %s", ignored)

    async def verdict(self) -> str:
        """Why the API server refuses the slice the config just applied makes, where it took the
        slice before ("" when it takes it, does not answer, or refused it already: then the new
        config is not what it refuses)."""
        if self.publisher.refusal:
            return ""
        return await self.publisher.verdict(self.publisher.request(), VERDICT_TIMEOUT_S)

    def limit_source(self) -> ClaimSource:
        """The prepared claims' memory, for the containers of the pods they are reserved for."""
        return ClaimSource(self.driver)


def open_dra_frontend(
    settings: DraSettings,
    config: Config,
    state_dir: Path,
    book: AllocationBook,
    inventory: Published[Inventory],
    *,
    snapshot: Callable[[], NodeSnapshot | None],
    on_claims_changed: Callable[[], None],
    pod_resources_socket: Path,
    hooks: LimitHooks | None = None,
    mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
) -> DraFrontend:
    """The DRA frontend with its API server client; the driver's name is the config's at start
    (it names the kubelet sockets). Raises StartupError."""
    try:
        api = LightkubeApi(load_config(settings.kubeconfig), settings.api_timeout_s)
    except ValueError as e:
        raise StartupError(str(e)) from None
    ignored = device_ids_ignored(config)
    if ignored:
        log.warning("%s", ignored)
    return DraFrontend(
        replace(settings, driver_name=config.dra.driver_name),
        config,
        state_dir,
        book,
        inventory,
        api=api,
        snapshot=snapshot,
        on_claims_changed=on_claims_changed,
        pod_resources_socket=pod_resources_socket,
        hooks=hooks,
        mps_namespaces=mps_namespaces,
    )
