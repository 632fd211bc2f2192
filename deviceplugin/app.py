"""The composition root: builds the daemon from its settings, owns its tasks and its shutdown.

The poll loop (`poller`) reads the GPU backend and publishes the slice inventory and the usage
snapshot. The plugin life cycle keeps the gRPC server registered with the kubelet; the allocation
tracker (`plugin.tracker`) keeps the record of allocations in step with pod-resources. A part
that fails for good ends the TaskGroup, and the daemon exits non-zero so the DaemonSet restarts it.

Over 400 lines: `Daemon` is the wiring of every part and its reload hooks, best read as one class.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deviceplugin import __version__
from deviceplugin.allocation import mps_defaults
from deviceplugin.config import Config, DeviceIdStrategy, MpsConfig
from deviceplugin.dra.settings import DraSettings, device_ids_ignored
from deviceplugin.enforcement_mode import as_run, in_monitor_mode, mode_line
from deviceplugin.errors import StartupError
from deviceplugin.gpu.backend import GpuBackend, open_backend
from deviceplugin.grants import allocation_book
from deviceplugin.kubelet.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointReader,
)
from deviceplugin.kubelet.limits import device_list_problem
from deviceplugin.kubelet.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.model import DaemonHealth, Inventory, NodeSnapshot
from deviceplugin.nodelabels import NodeLabelFile
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.resources import ResourceEndpoint, ResourcePlugins
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.plugin.tracker import POD_RESOURCES_INTERVAL_S, AllocationTracker
from deviceplugin.poller import Poller, idle_interval_s
from deviceplugin.slicing import plan_gpus
from deviceplugin.state import Published
from deviceplugin.statedir import check_state_file, claim_state_dir
from deviceplugin.usage.cgroups import kubelet_layout
from deviceplugin.usage.httpserver import HttpServer, TlsFiles
from deviceplugin.usage.procs import AllocationResolver, pid_namespace_warning

if TYPE_CHECKING:
    # Imported where used, so that a new process registers sooner: the DRA driver and per-node
    # configs bring the Kubernetes API client (lightkube, httpx), which the device-plugin mode
    # without per-node configs never needs; the enforcer starts once the kubelet has the first
    # device list (see run()), and so do the metrics and the config reload (prometheus_client);
    # the MPS control daemon is only where MPS is on.
    from deviceplugin.dra.driver import DraDriver
    from deviceplugin.enforcer import Enforcer
    from deviceplugin.gpu.mps import MpsControlDaemon
    from deviceplugin.nodeconfig import NodeConfig
    from deviceplugin.reload import ReloadMetrics
    from deviceplugin.usage.metrics import DaemonMetrics

log = logging.getLogger(__name__)

# /healthz fails when no poll has succeeded for this many intervals (and this many idle intervals,
# and at least this long), or when the plugin has not been registered with the kubelet for this
# long.
HEALTHZ_STALE_POLLS = 20
HEALTHZ_STALE_IDLE_POLLS = 5
HEALTHZ_MIN_STALE_S = 10.0
HEALTHZ_UNREGISTERED_S = 60.0
# The enforcer starts once the kubelet has the first device list, checked this often, or after
# this long at the latest (a kubelet slow to open its stream).
FIRST_LIST_CHECK_S = 0.005
FIRST_LIST_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Everything `serve` needs, resolved once at the edge (flags, environment, config file)."""

    config: Config = field(default_factory=Config)
    backend: str = "nvml"
    device_plugin_dir: Path = Path(DEFAULT_DEVICE_PLUGIN_DIR)
    pod_resources_socket: Path = Path(DEFAULT_POD_RESOURCES_SOCKET)
    metrics_address: str = ":9410"
    # /healthz alone, for the kubelet's probes, on a listener of its own; "": none.
    probe_address: str = ""
    # HTTPS for the metrics endpoint; None: plain HTTP.
    metrics_tls: TlsFiles | None = None
    state_dir: Path = Path("/var/lib/vgpu")
    node_name: str = ""
    # The file `config` was read from, watched for changes and read again on SIGHUP; None for
    # the built-in defaults (nothing to reload).
    config_path: Path | None = None
    # The node feature discovery features directory: the only place node labels are written;
    # None: nowhere.
    node_features_dir: Path | None = None
    config_hash: str = ""
    # Let a process outside every pod cgroup keep its claimed allocation: only for workloads
    # that are not in pods (the demo, tests); `serve` refuses it outside a fake backend.
    trust_host_processes: bool = False
    # Per-node configs: the config file is one of a directory's, chosen by a label of the node
    # (config_path is the one chosen at start; None with the `empty` choice).
    node_config: NodeConfig | None = None
    # Node labels where the config names no nodeLabels.file: the feature file of this name in
    # node_features_dir (given at start, whatever the config's format).
    node_features_file: str = ""
    # Where the kubelet puts pod containers (docs/design.md §12): "auto" and "" read them from
    # this daemon's own pod container (either driver at / outside a pod).
    kubelet_cgroup_driver: str = "auto"
    kubelet_cgroup_root: str = ""
    # `--kubelet-api dra`: served as a DRA driver (deviceplugin.dra) instead of device plugins.
    dra: DraSettings | None = None
    # --device-id-strategy: wins over every config file's deviceIDStrategy, as NVIDIA's flag
    # (DEVICE_ID_STRATEGY) wins over its config file; None: the file's.
    device_id_strategy: DeviceIdStrategy | None = None
    # --enforce-nvidia-config: an NVIDIA-format config is enforced; else it runs in monitor
    # mode, a dry run (deviceplugin/enforcement_mode.py).
    enforce_nvidia_config: bool = False

    def configured(self, config: Config) -> Config:
        """`config` with the flags that win over the config file applied, and in monitor mode
        where it is NVIDIA's format and enforcement is not turned on."""
        config = as_run(config, self.enforce_nvidia_config)
        if self.device_id_strategy is None:
            return config
        allocation = replace(config.allocation, device_id_strategy=self.device_id_strategy)
        return replace(config, allocation=allocation)


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
        run()). Otherwise (in-process, where every module is imported already) they are made
        here and started before registration."""
        self.settings = settings = replace(settings, config=settings.configured(settings.config))
        self.backend = backend
        self.listing_first = listing_first
        cfg = settings.config
        self.inventory: Published[Inventory] = Published(Inventory())
        self.book = allocation_book(settings.state_dir, self.inventory, keep=settings.dra is None)
        # Made by _make_metrics(), on first use (a scrape may come first, on an HTTP thread);
        # until then (listing_first) the durations observed wait in these lists.
        self._metrics: DaemonMetrics | None = None
        self._reload_metrics: ReloadMetrics | None = None
        self._metrics_lock = threading.Lock()
        self._early_polls: list[float] = []
        self._early_allocates: list[float] = []
        # Made in run(): its duty-cycle thread must not outlive a daemon that never ran.
        self.enforcer: Enforcer | None = None
        self.dra = self._make_dra(settings)
        self.poller = Poller(
            backend,
            cfg,
            self.inventory,
            self.book,
            node_name=settings.node_name,
            health=self.health,
            evidence=self.dra.evidence
            if self.dra is not None
            else CheckpointReader(
                settings.device_plugin_dir / CHECKPOINT_FILE,
                lambda: self.resources.known_names,
            ).read,
            enforce=self._enforce,
            on_poll_duration=self._observe_poll,
            on_inventory=lambda inventory: self.reconcile_resources(),
            trust_host_processes=settings.trust_host_processes,
            resolver=AllocationResolver(
                layout=kubelet_layout(settings.kubelet_cgroup_driver, settings.kubelet_cgroup_root)
            ),
            inventory_view=None if self.dra is None else self.dra.inventory_view,
        )
        # One plugin endpoint per resource; the primary one (resourceName) always exists, and
        # `service` and `lifecycle` are its own.
        primary = self._make_endpoint(cfg.resource_name, Published(Inventory()))
        self.resources = ResourcePlugins(primary, self._make_endpoint)
        self.tracker = AllocationTracker(
            self.book,
            settings.pod_resources_socket,
            lambda: self.resources.known_names,
            interval_s=pod_resources_interval_s,
            # A reader of its own (the poll worker's is read on another thread), of every
            # resource: the tracker keeps the entries that are this node's.
            checkpoint=CheckpointReader(settings.device_plugin_dir / CHECKPOINT_FILE, None).read,
            adopt=self._adopt,
        )
        # The node's MPS control daemon, when MPS is on: started after the first poll (its
        # defaults follow the slicing), supervised, and sent quit on every exit path.
        self.mps = _mps_control_daemon(cfg.mps) if cfg.mps.enabled else None
        # Node labels through node feature discovery's feature file, when the config asks.
        self.node_labels = self._make_node_labels(cfg)
        # While running: the task group, the daemon's stop, and the optional components' tasks
        # (MPS supervision, node labels), which a reload stops and starts again.
        self._tasks: asyncio.TaskGroup | None = None
        self._stop: asyncio.Event | None = None
        self._components: dict[str, tuple[asyncio.Event, asyncio.Task[Any]]] = {}
        self.http: HttpServer | None = None
        if settings.metrics_address:
            self.http = HttpServer(
                settings.metrics_address,
                _DaemonMetricsOf(self),
                lambda: self.poller.snapshot,
                self.healthz,
                tls=settings.metrics_tls,
            )
        self.probes: HttpServer | None = None
        if settings.probe_address:
            self.probes = HttpServer(
                settings.probe_address,
                _DaemonMetricsOf(self),
                lambda: self.poller.snapshot,
                self.healthz,
                probes_only=True,
            )
        if not listing_first:
            self._make_metrics()

    def _make_metrics(self) -> None:
        """The metrics and the reload's metrics, once; the durations observed before them."""
        from deviceplugin.reload import ReloadMetrics  # noqa: PLC0415 (see TYPE_CHECKING above)
        from deviceplugin.usage.metrics import DaemonMetrics  # noqa: PLC0415

        with self._metrics_lock:
            if self._metrics is not None:
                return
            settings = self.settings
            metrics = DaemonMetrics(
                settings.node_name, lambda: self.poller.snapshot, version=__version__
            )
            self._reload_metrics = ReloadMetrics(
                metrics.registry, settings.node_name, settings.config_hash
            )
            if self.dra is not None:
                metrics.registry.register(self.dra.publisher.collector(settings.node_name))
            for seconds in self._early_polls:
                metrics.observe_poll(seconds)
            for seconds in self._early_allocates:
                metrics.observe_allocate(seconds)
            self._early_polls.clear()
            self._early_allocates.clear()
            self._metrics = metrics

    @property
    def metrics(self) -> DaemonMetrics:
        if self._metrics is None:
            self._make_metrics()
        assert self._metrics is not None
        return self._metrics

    @property
    def reload_metrics(self) -> ReloadMetrics:
        if self._reload_metrics is None:
            self._make_metrics()
        assert self._reload_metrics is not None
        return self._reload_metrics

    def _observe_poll(self, seconds: float) -> None:
        metrics = self._metrics or self._metrics_or_keep(self._early_polls, seconds)
        if metrics is not None:
            metrics.observe_poll(seconds)

    def _observe_allocate(self, seconds: float) -> None:
        metrics = self._metrics or self._metrics_or_keep(self._early_allocates, seconds)
        if metrics is not None:
            metrics.observe_allocate(seconds)

    def _metrics_or_keep(self, early: list[float], seconds: float) -> DaemonMetrics | None:
        """The metrics if made (by another thread, a scrape, meanwhile); else `seconds` is kept
        in `early` for them, and None."""
        with self._metrics_lock:
            if self._metrics is None:
                early.append(seconds)
            return self._metrics

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

    async def apply_config(self, config: Config) -> None:
        """Apply a new config without a restart: the one entry point of a live reload."""
        from deviceplugin.reload import apply_config  # noqa: PLC0415 (see TYPE_CHECKING above)

        old = self.settings.config
        await apply_config(self, config)
        self._log_mode_change(old, self.settings.config)

    def _log_mode_change(self, old: Config, new: Config) -> None:
        """Say so when a reload turns monitor mode (or a dry run) on or off."""
        enforce = self.settings.enforce_nvidia_config
        if old.enforcement.dry_run == new.enforcement.dry_run:
            return
        line = mode_line(new, enforce) or "enforcement: on, as the config says"
        log.warning("config reload: %s", line)

    def plan_problem(self, config: Config) -> str | None:
        """Why `config`'s slicing plan cannot be advertised on this node's GPUs (its device list
        would not fit in one kubelet message); None when it fits or no GPU is known yet."""
        gpus = [plan.gpu for plan in self.inventory.value.plans]
        plans = plan_gpus(gpus, config.slicing, mig=config.mig, resource_name=config.resource_name)
        return device_list_problem(plans, config.slicing)

    async def replace_enforcer(self) -> None:
        """Swap in an enforcer with the current settings, between two polls (on the poll worker,
        so that no snapshot is half enforced). The old one resumes what it holds stopped."""

        def swap() -> None:
            old = self.enforcer
            if old is None:
                return
            old.close()
            self.enforcer = self._start_enforcer()

        await asyncio.wrap_future(self.poller.submit(swap))

    def _make_endpoint(
        self, resource_name: str, inventory: Published[Inventory]
    ) -> ResourceEndpoint:
        # The service and the endpoint refer to each other; the lambdas resolve the endpoint's
        # life cycle when they are called, after it exists (and after it is replaced).
        endpoint: list[ResourceEndpoint] = []
        service = DevicePluginService(
            self.settings.config,
            inventory,
            self.book,
            generation=lambda: endpoint[0].lifecycle.generation(),  # noqa: PLW0108
            on_stream_end=lambda generation: endpoint[0].lifecycle.stream_ended(generation),  # noqa: PLW0108
            on_allocate_duration=self._observe_allocate,
            # The kubelet lists an allocation in pod-resources right after Allocate: ask soon,
            # so that the container's series and any action on it carry its pod's name.
            on_allocated=self.poller.allocated,
            resource_name=resource_name,
        )
        lifecycle = PluginLifecycle(
            service,
            plugin_dir=self.settings.device_plugin_dir,
            resource_name=resource_name,
        )
        endpoint.append(ResourceEndpoint(resource_name, inventory, service, lifecycle))
        return endpoint[0]

    def _make_dra(self, settings: DaemonSettings) -> DraDriver | None:
        if settings.dra is None:
            return None
        from deviceplugin.dra.driver import DraDriver  # noqa: PLC0415 (see TYPE_CHECKING above)
        from deviceplugin.dra.kubeapi import LightkubeApi, load_config  # noqa: PLC0415

        try:
            api = LightkubeApi(load_config(settings.dra.kubeconfig), settings.dra.api_timeout_s)
        except ValueError as e:
            raise StartupError(str(e)) from None
        # The driver's name is the config's at start: it names the kubelet sockets.
        dra = replace(settings.dra, driver_name=settings.config.dra.driver_name)
        ignored = device_ids_ignored(settings.config)
        if ignored:
            log.warning("%s", ignored)
        return DraDriver(
            dra,
            lambda: self.settings.config,
            settings.state_dir,
            self.book,
            api,
            snapshot=lambda: self.poller.snapshot,
            on_claims_changed=lambda: self.poller.allocated(),  # noqa: PLW0108 (made later)
            pod_resources_socket=settings.pod_resources_socket,
        )

    def reconcile_resources(self) -> None:
        """Bring the plugin endpoints in line with the current inventory: every resource it
        names is served and registered, with its slices; a resource with no slice left (none
        even held by an allocation) is stopped. Called after every poll; whatever changes the
        inventory (a MIG layout change, a new config) ends here. Slices held under another
        name (a renamed resource) are advertised Unhealthy until the kubelet frees them."""
        inventory = self.inventory.value
        if self.dra is not None:
            self.dra.inventory_changed(inventory)
            return
        self.resources.reconcile(inventory, self.book.held_elsewhere(inventory.by_id))
        self.book.retired = self.resources.retired

    def _adopt(self, resource_name: str, device_ids: Sequence[str]) -> bool:
        """Whether allocations that pod-resources lists under `resource_name`, which this node
        does not serve, are still this node's: every device is one of its slices (a daemon
        restarted after a rename). Such a name counts as retired from then on."""
        by_id = self.inventory.value.by_id
        if not device_ids or not all(d in by_id for d in device_ids):
            return False
        self.resources.retire(resource_name)
        self.book.retired = self.resources.retired
        return True

    # --- optional components: the MPS control daemon and the node feature file ---------------

    def _start_component(self, name: str, run: Callable[[asyncio.Event], Any]) -> None:
        """Run `run(stop)` as a task of the running daemon, stopped by `_stop_component(name)` or
        when the daemon stops."""
        if self._tasks is None or self._stop is None:
            return
        stop = asyncio.Event()
        relay = asyncio.ensure_future(self._stop.wait())
        relay.add_done_callback(functools.partial(_set_on_done, stop))
        task = self._tasks.create_task(run(stop), name=name)
        task.add_done_callback(lambda _: relay.cancel())
        self._components[name] = (stop, task)

    async def _stop_component(self, name: str) -> None:
        component = self._components.pop(name, None)
        if component is not None:
            stop, task = component
            stop.set()
            await asyncio.wait({task})

    def _supervise_mps(self, mps: MpsControlDaemon) -> None:
        inventory = self.inventory
        self._start_component(
            "mps", lambda stop: mps.run(stop, lambda: mps_defaults(inventory.value.plans))
        )

    def _make_node_labels(self, cfg: Config) -> NodeLabelFile | None:
        """The feature file, only ever in the directory the daemon was started with: the
        config's nodeLabels.file, else --node-features-file (an NVIDIA file has no place for
        it)."""
        name = cfg.node_labels.file or self.settings.node_features_file
        directory = self.settings.node_features_dir
        if not name:
            return None
        if directory is None:
            log.error(
                "node labels are not written: the config asks for nodeLabels.file %s, but the "
                "daemon was started without --node-features-dir (VGPU_NODE_FEATURES_DIR)",
                name,
            )
            return None
        legacy = cfg.node_labels.legacy_directory
        if legacy and os.path.normpath(legacy) != os.path.normpath(directory):
            log.error(
                "node labels are not written: nodeLabels.path names the directory %s, but this "
                "daemon writes node labels only in its --node-features-dir %s; set "
                "nodeLabels.file: %s instead",
                legacy,
                directory,
                name,
            )
            return None
        return NodeLabelFile(
            directory,
            name,
            mig_strategy=cfg.mig.strategy.value,
            resource_name=cfg.resource_name,
        )

    async def reconfigure_mps(self, config: MpsConfig) -> None:
        """A reload changed `mps`: the running control daemon (if any) is sent quit, and one
        with the new settings is started and supervised (if enabled). A start that fails is
        logged and retried by the supervisor; the daemon keeps serving."""
        if self.mps is not None:
            await self._stop_component("mps")
            await asyncio.to_thread(self.mps.stop)
            self.mps = None
            log.info("config reload: MPS control daemon stopped")
        if not config.enabled:
            return
        self.mps = mps = _mps_control_daemon(config)
        try:
            await asyncio.to_thread(mps.start, mps_defaults(self.inventory.value.plans))
        except StartupError as e:
            log.error("config reload: %s; retrying", e)
        self._supervise_mps(mps)

    async def reconfigure_node_labels(self, config: Config) -> None:
        """A reload changed what the node feature file says or where it is: a file at an old
        path is removed (its labels would stay otherwise), and the new one written."""
        old = self.node_labels
        await self._stop_component("node-labels")
        self.node_labels = self._make_node_labels(config)
        if old is not None and (self.node_labels is None or self.node_labels.path != old.path):
            await asyncio.to_thread(old.remove)
        if self.node_labels is not None:
            self._start_component("node-labels", functools.partial(self._label, self.node_labels))

    async def _label(self, labels: NodeLabelFile, stop: asyncio.Event) -> None:
        await labels.run(self.inventory, stop)

    def _enforce(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        return snapshot if self.enforcer is None else self.enforcer.on_snapshot(snapshot)

    def _make_state_dir(self) -> Path:
        state_dir = self.settings.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StartupError(
                f"cannot create the state directory {state_dir}: {e.strerror or e}; "
                "set --state-dir to a writable directory"
            ) from e
        return state_dir

    def _start_enforcer(self) -> Enforcer:
        from deviceplugin.enforcer import Enforcer, PsutilControl, RecordingControl  # noqa: PLC0415

        cfg = self.settings.config.enforcement
        state_dir = self._make_state_dir()
        # A signal is held back from a process that left its pod container since it was
        # attributed (read afresh right before each SIGKILL or SIGSTOP).
        control = (
            RecordingControl() if cfg.dry_run else PsutilControl(where=self.poller.container_now)
        )
        enforcer = Enforcer(cfg, state_dir, control=control)
        # Resume whatever a daemon killed outright left stopped, before anything else runs.
        enforcer.recover()
        return enforcer

    async def _until_listed(self, stop: asyncio.Event) -> None:
        """Until the kubelet has had a device list from this daemon, a registration has failed
        (no kubelet to wait for), `stop`, or FIRST_LIST_WAIT_S; at once in DRA mode."""
        deadline = time.monotonic() + FIRST_LIST_WAIT_S
        while self.dra is None and not stop.is_set() and time.monotonic() < deadline:
            if any(
                e.service.lists_sent or e.lifecycle.stats.registration_failures
                for e in self.resources
            ):
                return
            await asyncio.sleep(FIRST_LIST_CHECK_S)

    def health(self) -> DaemonHealth:
        # Registered only when every resource is and holds its stream (a registration that holds
        # no stream counts as none, so /healthz fails in time); unregistered since the earliest.
        lifecycles = [] if self.dra is not None else [e.lifecycle for e in self.resources]
        since = [
            t
            for lc in lifecycles
            for t in (lc.unregistered_since_s, lc.unstable_since_s)
            if t > 0 and (not lc.registered or lc.unstable_since_s)
        ]
        unregistered_since_s = min(since, default=0.0)
        registered = all(lc.registered and not lc.unstable_since_s for lc in lifecycles)
        if self.dra is not None:
            registered = self.dra.registered
            unregistered_since_s = 0.0 if registered else self.dra.unregistered_since_s
        return DaemonHealth(
            registered=registered,
            unregistered_since_s=unregistered_since_s,
            unregistered_since_wall_s=(
                time.time() - (time.monotonic() - unregistered_since_s)
                if unregistered_since_s > 0
                else 0.0
            ),
            registrations_total=sum(lc.stats.registrations for lc in lifecycles),
            registration_failures_total=sum(lc.stats.registration_failures for lc in lifecycles),
            last_poll_success_s=self.poller.last_success_wall_s,
            poll_failures_consecutive=self.poller.failures,
            poll_interval_s=self.poller.interval_s,
            polling_idle=self.poller.idle,
            pod_resources_ok=self.tracker.ok if self.dra is None else self.dra.pod_resources_ok,
            mps=None if self.mps is None else self.mps.status,
        )

    def healthz(self) -> tuple[bool, str]:
        from deviceplugin.usage.metrics import healthz  # noqa: PLC0415 (see TYPE_CHECKING above)

        config = self.settings.config
        interval = config.enforcement.poll_interval_s
        if self.dra is not None:
            # The driver's own reasons first: they say what to do.
            reason = self.dra.unhealthy(time.monotonic())
            if reason:
                return False, reason
        return healthz(
            self.poller.snapshot,
            now_mono_s=time.monotonic(),
            now_wall_s=time.time(),
            poll_stale_after_s=max(
                HEALTHZ_STALE_POLLS * interval,
                HEALTHZ_STALE_IDLE_POLLS * idle_interval_s(config),
                HEALTHZ_MIN_STALE_S,
            ),
            unregistered_after_s=HEALTHZ_UNREGISTERED_S,
        )

    async def run(self, stop: asyncio.Event, hangup: asyncio.Event | None = None) -> None:
        """Run until `stop` is set. The first poll must succeed: nothing can be served before.
        With a config file, `hangup` set (SIGHUP) or a change of its content reloads it.

        With `listing_first`, the metrics, the config reload and the enforcer are imported and
        started once the kubelet has the first device list (or a registration failed, or after
        FIRST_LIST_WAIT_S): a new process reaches the kubelet ~0.15 s sooner. Polls before are
        not enforced; a scrape before makes the metrics at once."""
        cfg = self.settings.config
        if self.dra is not None:
            dra = self.dra.settings
            log.info(
                "starting vgpu DRA driver version=%s backend=%s driver=%s node=%s "
                "kubelet_root_dir=%s cdi_dir=%s gpu_cdi=%s",
                __version__,
                self.backend.name,
                dra.driver_name,
                dra.node_name,
                dra.kubelet_root_dir,
                dra.cdi_dir,
                dra.gpu_cdi.value,
            )
        else:
            log.info(
                "starting vgpu device plugin version=%s backend=%s resource=%s "
                "device_plugin_dir=%s",
                __version__,
                self.backend.name,
                cfg.resource_name,
                self.settings.device_plugin_dir,
            )
        for warning in cfg.warnings:
            log.warning("config: %s", warning)
        mode = mode_line(cfg, self.settings.enforce_nvidia_config)
        if mode:
            monitor = in_monitor_mode(cfg, self.settings.enforce_nvidia_config)
            log.log(logging.WARNING if monitor else logging.INFO, "%s", mode)
        pid_namespace = pid_namespace_warning()
        if pid_namespace:
            log.warning("%s", pid_namespace)
        if self.listing_first:
            self._make_state_dir()  # its failure stops the start here, as the enforcer's would
        else:
            self.enforcer = await asyncio.to_thread(self._start_enforcer)
        if self.dra is not None:
            try:
                self.dra.recover()
            except (OSError, ValueError) as e:
                raise StartupError(str(e)) from e
        try:
            try:
                await self.poller.poll_once()
            except TimeoutError as e:
                raise StartupError(
                    f"the GPU backend {self.backend.name} did not answer its first poll within "
                    f"{self.poller.timeout_s:g} s; see the log lines above for the GPU at fault"
                ) from e
            if self.mps is not None:
                await asyncio.to_thread(self.mps.start, mps_defaults(self.inventory.value.plans))
            self._start_http()
            # Who holds what, before the first device list goes out: a slice held under a name
            # this node no longer serves must not be offered as free, not even once. (DRA mode:
            # the prepared claims, recovered above, are what is held.)
            if self.dra is None:
                await self.tracker.prime()
            self.reconcile_resources()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.poller.run(stop), name="poll")
                self._tasks, self._stop = tasks, stop
                if self.dra is not None:
                    tasks.create_task(self.dra.run(stop), name="dra")
                else:
                    tasks.create_task(self.resources.run(stop), name="plugins")
                if not self.listing_first:
                    self._start_reload(tasks, stop, hangup)
                if self.dra is None:
                    tasks.create_task(
                        self.tracker.run(stop, self.poller.names_wanted), name="pod-resources"
                    )
                if self.mps is not None:
                    self._supervise_mps(self.mps)
                if self.node_labels is not None:
                    self._start_component(
                        "node-labels", functools.partial(self._label, self.node_labels)
                    )
                if self.listing_first:
                    await self._start_after_listing(tasks, stop, hangup)
        finally:
            self._tasks = self._stop = None
            self._components.clear()
            try:
                # Every process it holds stopped runs again, whatever ended the daemon: first.
                if self.enforcer is not None:
                    self.enforcer.close()
            finally:
                if self.mps is not None:
                    self.mps.stop()
                if self.http is not None:
                    self.http.stop()
                if self.probes is not None:
                    self.probes.stop()
        log.info("stopped")

    async def _start_after_listing(
        self, tasks: asyncio.TaskGroup, stop: asyncio.Event, hangup: asyncio.Event | None
    ) -> None:
        """listing_first: once the kubelet has the first device list, import (on a thread, so
        that the event loop keeps answering the kubelet) and start the metrics, the config
        reload and the enforcer. The enforcer starts even when stopping: it resumes what a
        daemon killed outright left stopped, which is owed."""
        await self._until_listed(stop)
        await asyncio.to_thread(_import_late_parts)
        self._make_metrics()
        if not stop.is_set():
            self._start_reload(tasks, stop, hangup)
        self.enforcer = await asyncio.to_thread(self._start_enforcer)
        if self.enforcer.config != self.settings.config.enforcement:
            await self.replace_enforcer()  # a reload changed it while it started

    def _start_http(self) -> None:
        if self.http is not None:
            try:
                self.http.start()
            except OSError as e:
                raise StartupError(
                    f"{e.strerror}; set --metrics-address to a free host:port"
                ) from e
            log.info("serving metrics and status address=%s", self.settings.metrics_address)
        if self.probes is not None:
            try:
                self.probes.start()
            except OSError as e:
                raise StartupError(f"{e.strerror}; set --probe-address to a free host:port") from e

    def _start_reload(
        self, tasks: asyncio.TaskGroup, stop: asyncio.Event, hangup: asyncio.Event | None
    ) -> None:
        """The config file's watch (and SIGHUP), and per-node configs' watch of the Node."""
        from deviceplugin.reload import (  # noqa: PLC0415 (see TYPE_CHECKING above)
            ConfigReloader,
            report_hangups_without_a_config,
        )

        node_config = self.settings.node_config
        if self.settings.config_path is not None or node_config is not None:
            reloader = ConfigReloader(
                self,
                self.settings.config_path,
                self.reload_metrics,
                self.settings.config_hash,
                watch_dir=node_config.rules.directory if node_config else None,
            )
            tasks.create_task(reloader.run(stop, hangup or asyncio.Event()), name="config-reload")
            if node_config is not None:
                tasks.create_task(
                    node_config.run(stop, reloader.switch, reloader.refuse),
                    name="node-config",
                )
        elif hangup is not None:
            tasks.create_task(report_hangups_without_a_config(stop, hangup), name="config-reload")


def _import_late_parts() -> None:
    """What listing_first starts after the first device list: imported here, off the loop."""
    import deviceplugin.enforcer  # noqa: PLC0415
    import deviceplugin.reload  # noqa: PLC0415
    import deviceplugin.usage.metrics  # noqa: F401, PLC0415


class _DaemonMetricsOf:
    """The daemon's metrics for its HTTP servers, which start before they are made."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def render(self, accept: str = "") -> tuple[bytes, str]:
        return self._daemon.metrics.render(accept)


def _mps_control_daemon(config: MpsConfig) -> MpsControlDaemon:
    from deviceplugin.gpu.mps import MpsControlDaemon  # noqa: PLC0415 (only where MPS is on)

    return MpsControlDaemon(config)


def _set_on_done(event: asyncio.Event, _: asyncio.Future[Any]) -> None:
    event.set()


def check_trust(settings: DaemonSettings) -> None:
    """Refuse to trust host processes' claims on real GPUs: any process on the node could then
    charge its use to a pod and have that pod's processes killed. Raises StartupError."""
    if settings.trust_host_processes and not settings.backend.startswith("fake:"):
        raise StartupError(
            "--trust-host-processes lets any process outside the pods charge its GPU use to a "
            "pod (and get that pod's processes killed); it is only for the demo and tests and "
            f"needs --backend fake:PATH, not {settings.backend!r}: drop the flag "
            "(and VGPU_TRUST_HOST_PROCESSES)"
        )


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
        backend = open_backend(settings.backend, settings.config)
        try:
            await Daemon(settings, backend, listing_first=True).run(stop, hangup)
        finally:
            backend.close()
    finally:
        lock.release()
