"""The composition root: builds the daemon's parts from its settings and runs them.

The parts: the kubelet frontend (device plugins or a DRA driver, `frontend.KubeletFrontend`:
exactly one is built), the poll loop (`poller`: the GPU backend read, the inventory and the usage
snapshot), the enforcer it hands each snapshot to (`parts.enforcement`), the optional supervised
parts (`parts.optional`: MPS, node labels; the list in `Daemon.__init__` is where one plugs in),
the HTTP servers, and the live config every part follows (`reload.LiveConfig`). Start-up
ordering is `startup`'s, health `health`'s. A part that fails for good ends the task group, and
the daemon exits non-zero so the DaemonSet restarts it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin import startup
from deviceplugin.config import Config
from deviceplugin.frontend import KubeletFrontend
from deviceplugin.gpu.backend import GpuBackend, open_backend
from deviceplugin.grants import HeldGrants, allocation_book
from deviceplugin.health import daemon_health, healthz
from deviceplugin.lazymetrics import LazyMetrics
from deviceplugin.live import LiveConfig, ReloadNotes
from deviceplugin.memlimits.cdihook import AllocationSpecs, LimitHooks
from deviceplugin.model import DaemonHealth, Inventory
from deviceplugin.parts.enforcement import Enforcement
from deviceplugin.parts.memlimits import MemoryLimitsPart
from deviceplugin.parts.mps import MpsPart
from deviceplugin.parts.nodelabels import NodeLabelsPart
from deviceplugin.parts.optional import OptionalParts
from deviceplugin.plugin.frontend import DevicePluginFrontend
from deviceplugin.plugin.tracker import POD_RESOURCES_INTERVAL_S
from deviceplugin.poller import Poller
from deviceplugin.settings import DaemonSettings, check_trust
from deviceplugin.state import Published
from deviceplugin.statedir import check_state_file, claim_state_dir, make_state_dir
from deviceplugin.usage.cgroups import kubelet_layout, pod_top_cgroups
from deviceplugin.usage.procs import AllocationResolver

if TYPE_CHECKING:
    from deviceplugin.enforcer import Enforcer
    from deviceplugin.gpu.mps import MpsControlDaemon

__all__ = ["Daemon", "DaemonSettings", "check_trust", "serve"]

log = logging.getLogger(__name__)


class Daemon:
    """The running daemon's parts, for `serve`, the demo and the black-box tests."""

    def __init__(
        self,
        settings: DaemonSettings,
        backend: GpuBackend,
        *,
        pod_resources_interval_s: float = POD_RESOURCES_INTERVAL_S,
        listing_first: bool = False,
    ) -> None:
        """`listing_first` (`serve`, a new process): the kubelet gets the first device list
        before the enforcer, the metrics and the config reload are imported and started (see
        `startup`). Otherwise (in-process, where every module is imported already) they are made
        and started before registration."""
        cfg = settings.configured(settings.config)
        # As started (the running config is `config`: a reload replaces it).
        self.settings = settings = replace(settings, config=cfg)
        self.backend = backend
        self.listing_first = listing_first
        self.inventory: Published[Inventory] = Published(Inventory())
        self.book = allocation_book(settings.state_dir, self.inventory, keep=settings.dra is None)
        self.metrics = LazyMetrics(
            settings.node_name,
            settings.config_hash,
            lambda: self.poller.snapshot,
            register=lambda registry: self.frontend.register_metrics(registry, settings.node_name),
        )
        # The MPS control daemon (the frontends ask it for MPS v3 namespaces, the enforcer
        # drains its clients through it).
        self.mps_part = MpsPart(
            cfg.mps,
            self.inventory,
            allocations=lambda: tuple(self.book),
            # NVML's (the fake backend has none): MPS v3 needs R615.
            driver_version=lambda: getattr(backend, "driver_version", None),
        )
        names_wanted = asyncio.Event()
        # Which grants' CDI specs carry the memory-limit hook (docs/design.md §15).
        memory = settings.memory_limits
        self.limit_hooks = LimitHooks(memory.command if memory is not None else None)
        self.hook_specs = (
            AllocationSpecs(memory.cdi_dir, self.limit_hooks)
            if memory is not None and settings.dra is None
            else None
        )
        self.frontend = self._frontend(cfg, names_wanted, pod_resources_interval_s)
        resolver = AllocationResolver(
            layout=kubelet_layout(settings.kubelet_cgroup_driver, settings.kubelet_cgroup_root)
        )
        self.poller = Poller(
            backend,
            cfg,
            self.inventory,
            self.book,
            node_name=settings.node_name,
            frontend=self.frontend,
            health=self.health,
            enforce=lambda snapshot: self.enforcement.enforce(snapshot),  # noqa: PLW0108 (made later)
            on_poll_duration=self.metrics.observe_poll,
            trust_host_processes=settings.trust_host_processes,
            resolver=resolver,
            names_wanted=names_wanted,
            memory_limits=lambda: self.memory_limits.view,
        )
        self.enforcement = Enforcement(
            cfg.enforcement,
            settings.state_dir,
            container_now=self.poller.container_now,
            between_polls=self.poller.submit,
            # A process stopped for good is drained first while MPS is on.
            stop_process=self.mps_part.stop_client,
        )
        # The optional supervised parts: a new one plugs in here. The memory limits the driver
        # enforces (docs/design.md §15) are on unless --memory-limits off; they serve the hook
        # from the first GPU whose driver partitions memory.
        self.memory_limits = MemoryLimitsPart(
            memory,
            backend=backend,
            state_dir=settings.state_dir,
            cgroup_mount=settings.cgroup_mount,
            tree=lambda: resolver.tree,
            source=self.frontend.limit_source,
            hooks=self.limit_hooks,
            snapshot=lambda: self.poller.snapshot,
            specs=self.hook_specs,
            live=lambda: {r.allocation_id for r in self.book},
        )
        self.optional = OptionalParts(
            [
                self.mps_part,
                self.memory_limits,
                NodeLabelsPart(
                    cfg,
                    self.inventory,
                    directory=settings.node_features_dir,
                    default_file=settings.node_features_file,
                    memory=self.memory_limits.enforcement,
                ),
            ]
        )
        # Every part that follows a live reload, in the order it does.
        self.live = LiveConfig(
            cfg,
            [
                self.frontend,
                self.enforcement,
                HeldGrants(self.book, self.inventory),
                self.poller,
                self.optional,
                ReloadNotes(settings.enforce_nvidia_config),
            ],
            configured=settings.configured,
            checks=[self.poller.refuses, self.frontend.refuses],
            verdict=self.frontend.verdict,
        )
        self.http, self.probes = startup.http_servers(
            settings, self.metrics, lambda: self.poller.snapshot, self.healthz
        )
        if not listing_first:
            self.metrics.make()

    def _frontend(
        self, cfg: Config, names_wanted: asyncio.Event, pod_resources_interval_s: float
    ) -> KubeletFrontend:
        """The one frontend of this daemon; nothing of the other is built."""
        settings = self.settings
        if settings.dra is None:
            frontend: KubeletFrontend = DevicePluginFrontend(
                cfg,
                self.book,
                self.inventory,
                plugin_dir=settings.device_plugin_dir,
                pod_resources_socket=settings.pod_resources_socket,
                names_wanted=names_wanted,
                pod_resources_interval_s=pod_resources_interval_s,
                on_allocate_duration=self.metrics.observe_allocate,
                on_allocated=lambda: self.poller.allocated(),  # noqa: PLW0108 (made later)
                hook_specs=self.hook_specs,
                mps_namespaces=self.mps_part,
            )
        else:
            # Here, not above: the Kubernetes API client (lightkube, httpx) only in DRA mode.
            from deviceplugin.dra.frontend import open_dra_frontend  # noqa: PLC0415

            frontend = open_dra_frontend(
                settings.dra,
                cfg,
                settings.state_dir,
                self.book,
                self.inventory,
                snapshot=lambda: self.poller.snapshot,
                on_claims_changed=lambda: self.poller.allocated(),  # noqa: PLW0108 (made later)
                pod_resources_socket=settings.pod_resources_socket,
                hooks=self.limit_hooks,
                mps_namespaces=self.mps_part,
            )
        return frontend

    @property
    def mps(self) -> MpsControlDaemon | None:
        """The node's MPS control daemon, while MPS is on."""
        return self.mps_part.daemon

    @property
    def enforcer(self) -> Enforcer | None:
        return self.enforcement.enforcer

    @property
    def config(self) -> Config:
        """The running config (a reload replaces it)."""
        return self.live.config

    async def apply_config(self, config: Config) -> None:
        """Apply a new config without a restart: every part follows it."""
        await self.live.apply(config)

    def health(self) -> DaemonHealth:
        frontend = self.frontend.health(time.monotonic())
        return daemon_health(self.poller, frontend, self.mps_part.status)

    def healthz(self) -> tuple[bool, str]:
        problem = self.frontend.health(time.monotonic()).problem
        return healthz(self.live.config, self.poller.snapshot, problem)

    async def run(self, stop: asyncio.Event, hangup: asyncio.Event | None = None) -> None:
        """Run until `stop` is set (see `startup` for the order). With a config file, `hangup`
        set (SIGHUP) or a change of its content reloads it."""
        settings = self.settings
        startup.log_start(
            self.frontend, self.backend.name, self.config, settings.enforce_nvidia_config
        )
        if self.listing_first:
            make_state_dir(settings.state_dir)  # its failure stops the start here
        else:
            await self.enforcement.start()
        self.frontend.recover()
        try:
            await startup.first_poll(self.poller, self.backend.name)
            await self.optional.start()
            startup.start_http(self.http, self.probes, settings)
            # Who holds what, before the first device list goes out.
            await self.frontend.prime()
            self.frontend.publish(self.inventory.value)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.poller.run(stop), name="poll")
                tasks.create_task(self.frontend.run(stop), name=self.frontend.kind)
                start_reload = functools.partial(
                    startup.start_reload,
                    tasks,
                    stop,
                    hangup,
                    live=self.live,
                    settings=settings,
                    metrics=lambda: self.metrics.reload,
                )
                if not self.listing_first:
                    start_reload()
                self.optional.run(tasks, stop)
                if self.listing_first:
                    await startup.after_listing(
                        self.frontend,
                        stop,
                        metrics=self.metrics,
                        enforcement=self.enforcement,
                        start_reload=start_reload,
                    )
        finally:
            self.optional.stopped()
            try:
                # Every process it holds stopped runs again, whatever ended the daemon: first.
                self.enforcement.close()
            finally:
                try:
                    self.optional.close()
                finally:
                    for server in (self.http, self.probes):
                        if server is not None:
                            server.stop()
        log.info("stopped")


async def serve(
    settings: DaemonSettings, stop: asyncio.Event, hangup: asyncio.Event | None = None
) -> None:
    """Open the backend, run the daemon until `stop`, and release the backend on every path.
    `hangup` (SIGHUP) reloads the config."""
    check_trust(settings)
    if settings.backend.startswith("fake:"):
        check_state_file(Path(settings.backend.removeprefix("fake:")))
    lock = claim_state_dir(settings.state_dir)
    try:
        backend = open_backend(
            settings.backend,
            settings.config,
            cgroup_mount=settings.cgroup_mount,
            probe_root=settings.memory_limit_probe_root or None,
            pod_roots=pod_top_cgroups(
                settings.kubelet_cgroup_driver, settings.kubelet_cgroup_root, settings.cgroup_mount
            ),
        )
        try:
            await Daemon(settings, backend, listing_first=True).run(stop, hangup)
        finally:
            backend.close()
    finally:
        lock.release()
