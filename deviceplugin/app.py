"""The composition root: builds the daemon from its settings, owns its tasks and its shutdown.

One poll loop reads the GPU backend (in a worker thread, never on the event loop), turns the
reading into the slice inventory and the usage snapshot, and publishes both: ListAndWatch streams
wake on an inventory change; the exporter and /status read the latest snapshot. The plugin life
cycle keeps the gRPC server registered with the kubelet; the allocation tracker keeps the record
of allocations in step with pod-resources. A part that fails for good ends the TaskGroup, and the
daemon exits non-zero so the DaemonSet restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc

from deviceplugin import __version__
from deviceplugin.allocation import mps_defaults
from deviceplugin.config import Config, MpsConfig
from deviceplugin.enforcer import Enforcer, RecordingControl
from deviceplugin.enforcer.record import AllocationBook, Published
from deviceplugin.errors import BackendError, StartupError
from deviceplugin.gpu.backend import GpuBackend
from deviceplugin.gpu.mps import MpsControlDaemon
from deviceplugin.incremental import InventoryCache
from deviceplugin.kubelet.checkpoint import CHECKPOINT_FILE, CheckpointReader
from deviceplugin.kubelet.lifecycle import PluginLifecycle
from deviceplugin.kubelet.limits import DeviceListTooLargeError, device_list_problem
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.kubelet.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.kubelet.resources import ResourceEndpoint, ResourcePlugins
from deviceplugin.kubelet.server import DevicePluginService
from deviceplugin.model import (
    AllocationRecord,
    DaemonHealth,
    Inventory,
    NodeSnapshot,
    allocation_id,
)
from deviceplugin.nodelabels import NodeLabelFile
from deviceplugin.reload import (
    ConfigReloader,
    ReloadMetrics,
    apply_config,
    report_hangups_without_a_config,
)
from deviceplugin.slicing import format_bytes, keep_held, plan_gpus
from deviceplugin.statedir import check_state_file, claim_state_dir
from deviceplugin.usage.attribution import AttributionEvidence, SnapshotBuilder, mark_stale
from deviceplugin.usage.httpserver import HttpServer, TlsFiles
from deviceplugin.usage.metrics import DaemonMetrics, healthz
from deviceplugin.usage.procs import AllocationResolver, pid_namespace_warning

log = logging.getLogger(__name__)

T = TypeVar("T")

POD_RESOURCES_INTERVAL_S = 10.0
# /healthz fails when no poll has succeeded for this many intervals (and at least this long), or
# when the plugin has not been registered with the kubelet for this long.
HEALTHZ_STALE_POLLS = 20
HEALTHZ_MIN_STALE_S = 10.0
HEALTHZ_UNREGISTERED_S = 60.0


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Everything `serve` needs, resolved once at the edge (flags, environment, config file)."""

    config: Config = field(default_factory=Config)
    backend: str = "nvml"
    device_plugin_dir: Path = Path(DEFAULT_DEVICE_PLUGIN_DIR)
    pod_resources_socket: Path = Path(DEFAULT_POD_RESOURCES_SOCKET)
    metrics_address: str = ":9410"
    # HTTPS for the metrics endpoint; None: plain HTTP.
    metrics_tls: TlsFiles | None = None
    state_dir: Path = Path("/var/lib/vgpu")
    node_name: str = ""
    # The file `config` was read from, watched for changes and read again on SIGHUP; None for
    # the built-in defaults (nothing to reload).
    config_path: Path | None = None
    config_hash: str = ""
    # Let a process outside every pod cgroup keep its claimed allocation: only for workloads
    # that are not in pods (the demo, tests); `serve` refuses it outside a fake backend.
    trust_host_processes: bool = False


def open_backend(spec: str, config: Config | None = None) -> GpuBackend:
    """`fake:PATH` or `nvml`. Raises BackendError with what to do instead. `config` (default:
    the defaults) sets the nvml backend's health checks and call timeout."""
    if spec.startswith("fake:"):
        from deviceplugin.gpu.fake import FakeBackend  # noqa: PLC0415 (only the chosen backend)

        path = spec.removeprefix("fake:")
        if not path:
            raise BackendError("--backend fake:PATH needs the path of a state file")
        return FakeBackend(Path(path))
    if spec == "nvml":
        from deviceplugin.gpu.nvml import open_nvml_backend  # noqa: PLC0415 (pynvml only here)

        return open_nvml_backend(config or Config())
    raise BackendError(f"unknown backend {spec!r}: use nvml or fake:PATH")


def describe_inventory_change(old: Inventory, new: Inventory) -> list[str]:
    """Human lines for what changed between two inventories: GPUs, slicing and health."""
    lines: list[str] = []
    old_plans = {p.gpu.uuid: p for p in old.plans}
    new_plans = {p.gpu.uuid: p for p in new.plans}
    for uuid in old_plans.keys() - new_plans.keys():
        lines.append(f"gpu removed uuid={uuid}")
    for plan in new.plans:
        before = old_plans.get(plan.gpu.uuid)
        if before == plan:
            continue
        if plan.excluded_reason:
            lines.append(
                f"gpu not sliced index={plan.gpu.index} uuid={plan.gpu.uuid} "
                f"reason={plan.excluded_reason!r}"
            )
        else:
            lines.append(
                f"gpu sliced index={plan.gpu.index} uuid={plan.gpu.uuid} "
                f"model={plan.gpu.name!r} resource={plan.resource_name} slices={plan.replicas} "
                f"memory_per_slice={format_bytes(plan.memory_per_slice_bytes)} "
                f"compute_share={plan.compute_share_ratio:.3f}"
            )
    old_health = {s.device_id: s.healthy for s in old.slices}
    changed_gpus: dict[str, bool] = {}
    for s in new.slices:
        if s.device_id in old_health and old_health[s.device_id] != s.healthy:
            changed_gpus[s.id.gpu_uuid] = s.healthy
    for uuid, healthy in changed_gpus.items():
        lines.append(f"gpu {'healthy' if healthy else 'unhealthy'} uuid={uuid}")
    return lines


class DaemonWorker:
    """One daemon thread that runs submitted calls in order.

    Unlike a ThreadPoolExecutor's threads, which the interpreter joins at exit, a daemon thread
    never keeps the process alive: a call hung in the GPU driver or on a stuck /proc read must
    not stop the daemon from exiting once it has cleaned up."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, call))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 (handed to whoever awaits the future)
                future.set_exception(e)

    def shutdown(self) -> None:
        """Finish the call under way (if it ever returns), then stop; does not wait."""
        self._queue.put(None)


@dataclass(frozen=True, slots=True)
class Tick:
    """What one poll produced, off the event loop."""

    inventory: Inventory
    snapshot: NodeSnapshot
    unknown_allocations: frozenset[str]
    duration_s: float


class Poller:
    """The one poll loop. Each tick runs in a worker thread, never on the event loop: read the
    backend, build the inventory, attribute processes, build the snapshot and hand it to the
    enforcer, which acts on it and fills in the enforcement state. The loop then
    publishes the inventory (ListAndWatch wakes on a change) and swaps the snapshot in by
    reference (the exporter and /status read it from their own thread)."""

    def __init__(
        self,
        backend: GpuBackend,
        config: Config,
        inventory: Published[Inventory],
        book: AllocationBook,
        *,
        node_name: str = "",
        health: Callable[[], DaemonHealth] = DaemonHealth,
        resolver: AllocationResolver | None = None,
        checkpoint: CheckpointReader | None = None,
        enforce: Callable[[NodeSnapshot], NodeSnapshot] = lambda snapshot: snapshot,
        on_poll_duration: Callable[[float], None] = lambda seconds: None,
        timeout_s: float | None = None,
        on_inventory: Callable[[Inventory], None] = lambda inventory: None,
        trust_host_processes: bool = False,
    ) -> None:
        self._backend = backend
        self._config = config
        self._inventory = inventory
        self._book = book
        self._health = health
        self._resolver = resolver or AllocationResolver()
        self._builder_node = node_name
        self._builder = SnapshotBuilder(node_name, config.enforcement.compute.window_s)
        # The inventory is rebuilt only when a GPU's facts or health, or the slicing, change.
        self._inventories = InventoryCache()
        self._checkpoint = checkpoint
        self._checkpoint_reason: str | None = None
        self._trust_host_processes = trust_host_processes
        self._enforce = enforce
        self._on_poll_duration = on_poll_duration
        self._on_inventory = on_inventory
        self._interval_s = config.enforcement.poll_interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(5.0, 4 * self._interval_s)
        self._worker = DaemonWorker("vgpu-poll")
        # Stale snapshots reach the enforcer through a worker of their own: the poll worker may
        # be the one that is stuck.
        self._stale_worker = DaemonWorker("vgpu-stale")
        self._pending: asyncio.Future[Tick] | None = None
        self._previous_reading_s: float | None = None
        self.snapshot: NodeSnapshot | None = None
        self.names_wanted = asyncio.Event()
        # Set to poll at once rather than at the next tick.
        self.wake = asyncio.Event()
        self.failures = 0
        self.last_success_wall_s = 0.0

    def _tick(self, allocations: tuple[AllocationRecord, ...]) -> Tick:
        started = time.perf_counter()
        reading = self._backend.poll()
        now_s = time.monotonic()
        cfg = self._config
        # Refused before a single slice is built: the kubelet could not take the list anyway.
        problem = device_list_problem(
            plan_gpus(
                [g.info for g in reading.gpus],
                cfg.slicing,
                mig=cfg.mig,
                resource_name=cfg.resource_name,
            ),
            cfg.slicing,
        )
        if problem is not None:
            raise DeviceListTooLargeError(problem)
        # Held slices that a new plan or a MIG layout change dropped stay, Unhealthy, until freed.
        inventory = keep_held(
            self._inventory.value,
            self._inventories.build(
                reading, cfg.slicing, mig=cfg.mig, resource_name=cfg.resource_name
            ),
            (slice_id for record in allocations for slice_id in record.slice_ids),
        )
        pids = {p.pid for gpu in reading.gpus for p in gpu.processes}
        pid_allocation = self._resolver.resolve(pids)
        snapshot, unknown = self._builder.build(
            reading,
            inventory,
            allocations,
            pid_allocation,
            now_s=now_s,
            wall_s=time.time(),
            health=self._health(),
            previous_reading_s=self._previous_reading_s,
            evidence=self._evidence(),
        )
        self._previous_reading_s = now_s
        duration_s = time.perf_counter() - started
        return Tick(inventory, self._enforce(snapshot), unknown, duration_s)

    def reconfigure(self, config: Config) -> None:
        """Poll with a new config from the next tick on (a live reload)."""
        old, self._config = self._config, config
        self._interval_s = config.enforcement.poll_interval_s
        self.timeout_s = max(5.0, 4 * self._interval_s)
        if config.enforcement.compute.window_s != old.enforcement.compute.window_s:
            self._builder = SnapshotBuilder(self._builder_node, config.enforcement.compute.window_s)
        self.wake.set()

    def _evidence(self) -> AttributionEvidence | None:
        """What a process's claimed allocation is checked against: the kubelet's device
        checkpoint (which pod holds which allocation) and the process's pod and container
        cgroups. A claim from a process in no pod cgroup is refused unless the settings trust
        host processes (demo, tests). Without a readable checkpoint, claims stand as they are."""
        if self._checkpoint is None:
            return None
        checkpoint = self._checkpoint.read()
        if checkpoint.reason != self._checkpoint_reason:
            first = self._checkpoint_reason is None
            self._checkpoint_reason = checkpoint.reason
            if checkpoint.readable:
                log.info("verifying attribution against the kubelet's device checkpoint")
            else:
                # On a fresh node the kubelet writes it only after our first device list.
                fresh = first and checkpoint.reason.startswith("no checkpoint")
                log.log(
                    logging.INFO if fresh else logging.WARNING,
                    "kubelet device checkpoint unreadable; attribution rests on the environment "
                    "alone reason=%s",
                    checkpoint.reason,
                )
        return AttributionEvidence(
            checkpoint,
            self._resolver.pod_uid_of,
            trust_host_processes=self._trust_host_processes,
            cgroup_of=self._resolver.cgroup_of,
        )

    def submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `call` on the poll worker, between two ticks."""
        return self._worker.submit(call)

    async def poll_once(self) -> None:
        """One poll; raises BackendError or TimeoutError when the backend does not answer."""
        if self._pending is None or self._pending.done():
            allocations = tuple(self._book)
            self._pending = asyncio.wrap_future(
                self._worker.submit(functools.partial(self._tick, allocations))
            )
        # A hung call keeps its worker; the next tick waits on the same call, never stacks more.
        # (asyncio.wait leaves it running on a timeout, as wait_for on a shield would, for less.)
        done, _ = await asyncio.wait((self._pending,), timeout=self.timeout_s)
        if not done:
            raise TimeoutError
        tick = self._pending.result()
        self._pending = None
        old = self._inventory.value
        if self._inventory.set(tick.inventory):
            for line in describe_inventory_change(old, tick.inventory):
                (log.warning if "unhealthy" in line or "removed" in line else log.info)(line)
        self._on_inventory(tick.inventory)
        self.last_success_wall_s = tick.snapshot.taken_at_s
        self.failures = 0
        self.snapshot = replace(tick.snapshot, health=self._health())
        self._on_poll_duration(tick.duration_s)
        # Ask pod-resources again when processes carry an allocation this daemon does not know
        # (made before it started) or a container has no name yet (allocated since the last ask).
        if tick.unknown_allocations or any(not c.pod for c in tick.snapshot.containers):
            self.names_wanted.set()

    async def run(self, stop: asyncio.Event) -> None:
        # One waiter on `stop` for the whole run and one on `wake` until it fires: a tick that
        # only times out creates no task.
        stopped = asyncio.ensure_future(stop.wait())
        woken = asyncio.ensure_future(self.wake.wait())
        try:
            while not stop.is_set():
                if woken.done():
                    woken = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait(
                    (stopped, woken), timeout=self._interval_s, return_when=asyncio.FIRST_COMPLETED
                )
                if stop.is_set():
                    return
                self.wake.clear()
                failures = self.failures
                try:
                    await self.poll_once()
                    if failures:
                        log.info("polling recovered after_failures=%d", failures)
                except (BackendError, TimeoutError) as e:
                    self.failures += 1
                    level = logging.ERROR if self.failures == 1 else logging.DEBUG
                    log.log(
                        level,
                        "poll failed; keeping the last device list error=%r consecutive=%d",
                        str(e) or type(e).__name__,
                        self.failures,
                    )
                    if self.snapshot is not None:
                        self.snapshot = await self._enforce_stale(
                            mark_stale(self.snapshot, self._health())
                        )
        finally:
            stopped.cancel()
            woken.cancel()
            self._worker.shutdown()
            self._stale_worker.shutdown()

    async def _enforce_stale(self, stale: NodeSnapshot) -> NodeSnapshot:
        """The enforcer sees stale snapshots too: it acts on none, and releases its throttles when
        polling stays down. Off the event loop, and never waited on for longer than a poll."""
        future = asyncio.wrap_future(self._stale_worker.submit(lambda: self._enforce(stale)))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._interval_s)
        except TimeoutError:
            log.warning("enforcer busy; stale snapshot published without its enforcement state")
            return stale


class AllocationTracker:
    """Keeps the allocation record in step with the kubelet's pod-resources API.

    The allocation ID is derived from the slice IDs, so what the kubelet reports is enough to
    know every allocation made before this daemon (re)started, and who holds it. Asked again
    every `interval_s`, and at once (at most every `min_gap_s`) after an Allocate, when a GPU
    process carries an allocation this daemon does not know, or when a container has no name
    yet. An allocation the kubelet listed and no longer lists (its pod is gone) is dropped; one
    it never listed is dropped `grace_s` after it was handed out."""

    def __init__(
        self,
        book: AllocationBook,
        socket: Path,
        resource_name: str | Callable[[], Collection[str]],
        *,
        interval_s: float = POD_RESOURCES_INTERVAL_S,
        min_gap_s: float = 0.25,
        grace_s: float = 60.0,
    ) -> None:
        self._book = book
        self._socket = socket
        # One channel for every refresh (a new one only after a failed call).
        self._client = PodResourcesClient(socket)
        # The resources whose allocations are ours: one name, or the names currently served.
        self._resources: Callable[[], Collection[str]] = (
            (lambda: (resource_name,)) if isinstance(resource_name, str) else resource_name
        )
        self._interval_s = interval_s
        self._min_gap_s = min_gap_s
        self._grace_s = grace_s
        self.ok = False
        self.refreshes = 0

    async def refresh(self) -> None:
        """Ask pod-resources once; raises grpc.aio.AioRpcError when it does not answer."""
        containers = await self._client.list_container_devices()
        now = time.time()
        resources = self._resources()
        live = [
            AllocationRecord(
                allocation_id(c.device_ids),
                tuple(sorted(c.device_ids)),
                now,
                namespace=c.namespace,
                pod=c.pod,
                container=c.container,
            )
            for c in containers
            if c.resource_name in resources
        ]
        added, dropped = self._book.sync(live, now_s=now, grace_s=self._grace_s)
        self.refreshes += 1
        if added or dropped or self.refreshes == 1:
            log.info(
                "allocations in step with pod-resources live=%d added=%d dropped=%d",
                len(live),
                added,
                dropped,
            )

    async def run(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        try:
            await self._run(stop, wake)
        finally:
            await self._client.close()

    async def _run(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        while not stop.is_set():
            wake.clear()
            try:
                await self.refresh()
                if not self.ok:
                    self.ok = True
                    if self.refreshes > 1:
                        log.info("pod-resources API answering again socket=%s", self._socket)
            except grpc.aio.AioRpcError as e:
                if self.ok or self.refreshes == 0:
                    log.warning(
                        "pod-resources API not answering; containers keep their allocation IDs "
                        "but not their pod names until it does socket=%s error=%s",
                        self._socket,
                        e.code().name,
                    )
                self.ok = False
                self.refreshes = max(self.refreshes, 1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._min_gap_s)
            if stop.is_set():
                return
            waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())}
            try:
                await asyncio.wait(
                    waiters, timeout=self._interval_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()


class Daemon:
    """The running daemon's parts, for `serve`, the demo and the black-box tests."""

    def __init__(
        self,
        settings: DaemonSettings,
        backend: GpuBackend,
        *,
        pod_resources_interval_s: float = POD_RESOURCES_INTERVAL_S,
    ) -> None:
        self.settings = settings
        self.backend = backend
        cfg = settings.config
        self.inventory: Published[Inventory] = Published(Inventory())
        self.book = AllocationBook()
        self.metrics = DaemonMetrics(
            settings.node_name, lambda: self.poller.snapshot, version=__version__
        )
        # Made in run(): its duty-cycle thread must not outlive a daemon that never ran.
        self.enforcer: Enforcer | None = None
        self.poller = Poller(
            backend,
            cfg,
            self.inventory,
            self.book,
            node_name=settings.node_name,
            health=self.health,
            checkpoint=CheckpointReader(
                settings.device_plugin_dir / CHECKPOINT_FILE,
                lambda: self.resources.names,
            ),
            enforce=self._enforce,
            on_poll_duration=self.metrics.observe_poll,
            on_inventory=lambda inventory: self.reconcile_resources(),
            trust_host_processes=settings.trust_host_processes,
        )
        # One plugin endpoint per resource; the primary one (resourceName) always exists, and
        # `service` and `lifecycle` are its own.
        primary = self._make_endpoint(cfg.resource_name, Published(Inventory()))
        self.resources = ResourcePlugins(primary, self._make_endpoint)
        self.tracker = AllocationTracker(
            self.book,
            settings.pod_resources_socket,
            lambda: self.resources.names,
            interval_s=pod_resources_interval_s,
        )
        # The node's MPS control daemon, when MPS is on: started after the first poll (its
        # defaults follow the slicing), supervised, and sent quit on every exit path.
        self.mps = MpsControlDaemon(cfg.mps) if cfg.mps.enabled else None
        self.reload_metrics = ReloadMetrics(
            self.metrics.registry, settings.node_name, settings.config_hash
        )
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
                self.metrics,
                lambda: self.poller.snapshot,
                self.healthz,
                tls=settings.metrics_tls,
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

    async def apply_config(self, config: Config) -> None:
        """Apply a new config without a restart: the one entry point of a live reload."""
        await apply_config(self, config)

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
            on_allocate_duration=self.metrics.observe_allocate,
            # The kubelet lists an allocation in pod-resources right after Allocate: ask soon,
            # so that the container's series and any action on it carry its pod's name.
            on_allocated=self.poller.names_wanted.set,
        )
        lifecycle = PluginLifecycle(
            service,
            plugin_dir=self.settings.device_plugin_dir,
            resource_name=resource_name,
        )
        endpoint.append(ResourceEndpoint(resource_name, inventory, service, lifecycle))
        return endpoint[0]

    def reconcile_resources(self) -> None:
        """Bring the plugin endpoints in line with the current inventory: every resource it
        names is served and registered, with its slices; a resource with no slice left (none
        even held by an allocation) is stopped. Called after every poll; whatever changes the
        inventory (a MIG layout change, a new config) ends here."""
        self.resources.reconcile(self.inventory.value)

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
        if not cfg.node_labels.path:
            return None
        return NodeLabelFile(
            Path(cfg.node_labels.path),
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
        self.mps = mps = MpsControlDaemon(config)
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

    def _start_enforcer(self) -> Enforcer:
        cfg = self.settings.config.enforcement
        state_dir = self.settings.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StartupError(
                f"cannot create the state directory {state_dir}: {e.strerror or e}; "
                "set --state-dir to a writable directory"
            ) from e
        enforcer = Enforcer(cfg, state_dir, control=RecordingControl() if cfg.dry_run else None)
        # Resume whatever a daemon killed outright left stopped, before anything else runs.
        enforcer.recover()
        return enforcer

    def health(self) -> DaemonHealth:
        # Registered only when every resource is and holds its stream (a registration that holds
        # no stream counts as none, so /healthz fails in time); unregistered since the earliest.
        lifecycles = [endpoint.lifecycle for endpoint in self.resources]
        since = [
            t
            for lc in lifecycles
            for t in (lc.unregistered_since_s, lc.unstable_since_s)
            if t > 0 and (not lc.registered or lc.unstable_since_s)
        ]
        return DaemonHealth(
            registered=all(lc.registered and not lc.unstable_since_s for lc in lifecycles),
            unregistered_since_s=min(since, default=0.0),
            registrations_total=sum(lc.stats.registrations for lc in lifecycles),
            registration_failures_total=sum(lc.stats.registration_failures for lc in lifecycles),
            last_poll_success_s=self.poller.last_success_wall_s,
            poll_failures_consecutive=self.poller.failures,
            pod_resources_ok=self.tracker.ok,
            mps=None if self.mps is None else self.mps.status,
        )

    def healthz(self) -> tuple[bool, str]:
        interval = self.settings.config.enforcement.poll_interval_s
        return healthz(
            self.poller.snapshot,
            now_mono_s=time.monotonic(),
            now_wall_s=time.time(),
            poll_stale_after_s=max(HEALTHZ_STALE_POLLS * interval, HEALTHZ_MIN_STALE_S),
            unregistered_after_s=HEALTHZ_UNREGISTERED_S,
        )

    async def run(self, stop: asyncio.Event, hangup: asyncio.Event | None = None) -> None:
        """Run until `stop` is set. The first poll must succeed: nothing can be served before.
        With a config file, `hangup` set (SIGHUP) or a change of its content reloads it."""
        cfg = self.settings.config
        log.info(
            "starting vgpu device plugin version=%s backend=%s resource=%s device_plugin_dir=%s",
            __version__,
            self.backend.name,
            cfg.resource_name,
            self.settings.device_plugin_dir,
        )
        for warning in cfg.warnings:
            log.warning("config: %s", warning)
        pid_namespace = pid_namespace_warning()
        if pid_namespace:
            log.warning("%s", pid_namespace)
        self.enforcer = await asyncio.to_thread(self._start_enforcer)
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
            if self.http is not None:
                try:
                    self.http.start()
                except OSError as e:
                    raise StartupError(
                        f"{e.strerror}; set --metrics-address to a free host:port"
                    ) from e
                log.info("serving metrics and status address=%s", self.settings.metrics_address)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.poller.run(stop), name="poll")
                self._tasks, self._stop = tasks, stop
                tasks.create_task(self.resources.run(stop), name="plugins")
                if self.settings.config_path is not None:
                    reloader = ConfigReloader(
                        self,
                        self.settings.config_path,
                        self.reload_metrics,
                        self.settings.config_hash,
                    )
                    tasks.create_task(
                        reloader.run(stop, hangup or asyncio.Event()), name="config-reload"
                    )
                elif hangup is not None:
                    tasks.create_task(
                        report_hangups_without_a_config(stop, hangup), name="config-reload"
                    )
                tasks.create_task(
                    self.tracker.run(stop, self.poller.names_wanted), name="pod-resources"
                )
                if self.mps is not None:
                    self._supervise_mps(self.mps)
                if self.node_labels is not None:
                    self._start_component(
                        "node-labels", functools.partial(self._label, self.node_labels)
                    )
        finally:
            self._tasks = self._stop = None
            self._components.clear()
            try:
                # Every process it holds stopped runs again, whatever ended the daemon: first.
                self.enforcer.close()
            finally:
                if self.mps is not None:
                    self.mps.stop()
                if self.http is not None:
                    self.http.stop()
        log.info("stopped")


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
            await Daemon(settings, backend).run(stop, hangup)
        finally:
            backend.close()
    finally:
        lock.release()
