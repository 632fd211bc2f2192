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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc

from deviceplugin import __version__
from deviceplugin.allocation import mps_defaults
from deviceplugin.checkpoint import CHECKPOINT_FILE, CheckpointReader
from deviceplugin.config import Config
from deviceplugin.enforcer import Enforcer, RecordingControl
from deviceplugin.errors import BackendError, StartupError
from deviceplugin.gpu.backend import GpuBackend
from deviceplugin.httpserver import HttpServer
from deviceplugin.incremental import InventoryCache
from deviceplugin.metrics import DaemonMetrics, healthz
from deviceplugin.model import (
    AllocationRecord,
    DaemonHealth,
    Inventory,
    NodeSnapshot,
    allocation_id,
)
from deviceplugin.mps import MpsControlDaemon
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.podresources import list_container_devices
from deviceplugin.procs import AllocationResolver, pid_namespace_warning
from deviceplugin.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.reload import (
    ConfigReloader,
    ReloadMetrics,
    apply_config,
    report_hangups_without_a_config,
)
from deviceplugin.slicing import format_bytes, keep_held_slices
from deviceplugin.state import AllocationBook, Published
from deviceplugin.usage import AttributionEvidence, SnapshotBuilder, mark_stale

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
    state_dir: Path = Path("/var/lib/vgpu")
    node_name: str = ""
    # The file `config` was read from, watched for changes and read again on SIGHUP; None for
    # the built-in defaults (nothing to reload).
    config_path: Path | None = None
    config_hash: str = ""


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
                f"model={plan.gpu.name!r} slices={plan.replicas} "
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
        self._enforce = enforce
        self._on_poll_duration = on_poll_duration
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
        inventory = keep_held_slices(
            self._inventories.build(reading, self._config.slicing),
            self._inventory.value,
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
        if config.resource_name != old.resource_name and self._checkpoint is not None:
            self._checkpoint = CheckpointReader(self._checkpoint.path, config.resource_name)
        self.wake.set()

    def _evidence(self) -> AttributionEvidence | None:
        """What a process's claimed allocation is checked against: the kubelet's device
        checkpoint (which pod holds which allocation) and the process's pod cgroup. A process in
        no pod cgroup is the host's, trusted as before: the checks stop pods from claiming
        each other's allocations. Without a readable checkpoint, claims stand as they are."""
        if self._checkpoint is None:
            return None
        checkpoint = self._checkpoint.read()
        if checkpoint.reason != self._checkpoint_reason:
            self._checkpoint_reason = checkpoint.reason
            if checkpoint.readable:
                log.info("verifying attribution against the kubelet's device checkpoint")
            else:
                log.warning(
                    "kubelet device checkpoint unreadable; attribution rests on the environment "
                    "alone reason=%s",
                    checkpoint.reason,
                )
        return AttributionEvidence(checkpoint, self._resolver.pod_uid_of, trust_host_processes=True)

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
        tick = await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
        self._pending = None
        old = self._inventory.value
        if self._inventory.set(tick.inventory):
            for line in describe_inventory_change(old, tick.inventory):
                (log.warning if "unhealthy" in line or "removed" in line else log.info)(line)
        self.last_success_wall_s = tick.snapshot.taken_at_s
        self.failures = 0
        self.snapshot = replace(tick.snapshot, health=self._health())
        self._on_poll_duration(tick.duration_s)
        # Ask pod-resources again when processes carry an allocation this daemon does not know
        # (made before it started) or a container has no name yet (allocated since the last ask).
        if tick.unknown_allocations or any(not c.pod for c in tick.snapshot.containers):
            self.names_wanted.set()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                waiters = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self.wake.wait()),
                }
                try:
                    await asyncio.wait(
                        waiters, timeout=self._interval_s, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for waiter in waiters:
                        waiter.cancel()
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
        resource_name: str,
        *,
        interval_s: float = POD_RESOURCES_INTERVAL_S,
        min_gap_s: float = 0.25,
        grace_s: float = 60.0,
    ) -> None:
        self._book = book
        self._socket = socket
        self.resource_name = resource_name
        self._interval_s = interval_s
        self._min_gap_s = min_gap_s
        self._grace_s = grace_s
        self.ok = False
        self.refreshes = 0

    async def refresh(self) -> None:
        """Ask pod-resources once; raises grpc.aio.AioRpcError when it does not answer."""
        containers = await list_container_devices(self._socket)
        now = time.time()
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
            if c.resource_name == self.resource_name
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
                settings.device_plugin_dir / CHECKPOINT_FILE, cfg.resource_name
            ),
            enforce=self._enforce,
            on_poll_duration=self.metrics.observe_poll,
        )
        # The service and the life cycle refer to each other; the lambdas resolve the life cycle
        # when they are called, after it exists.
        self.service = DevicePluginService(
            cfg,
            self.inventory,
            self.book,
            generation=lambda: self.lifecycle.generation(),  # noqa: PLW0108
            on_stream_end=lambda generation: self.lifecycle.stream_ended(generation),  # noqa: PLW0108
            on_allocate_duration=self.metrics.observe_allocate,
            # The kubelet lists an allocation in pod-resources right after Allocate: ask soon,
            # so that the container's series and any action on it carry its pod's name.
            on_allocated=self.poller.names_wanted.set,
        )
        self.lifecycle = PluginLifecycle(
            self.service,
            plugin_dir=settings.device_plugin_dir,
            resource_name=cfg.resource_name,
        )
        self.tracker = AllocationTracker(
            self.book,
            settings.pod_resources_socket,
            cfg.resource_name,
            interval_s=pod_resources_interval_s,
        )
        # The node's MPS control daemon, when MPS is on: started after the first poll (its
        # defaults follow the slicing), supervised, and sent quit on every exit path.
        self.mps = MpsControlDaemon(cfg.mps) if cfg.mps.enabled else None
        self.reload_metrics = ReloadMetrics(
            self.metrics.registry, settings.node_name, settings.config_hash
        )
        # Set by the plugin's runner; setting it ends the running life cycle (see replace_plugin).
        self._plugin_stop = asyncio.Event()
        self.http: HttpServer | None = None
        if settings.metrics_address:
            self.http = HttpServer(
                settings.metrics_address,
                self.metrics,
                lambda: self.poller.snapshot,
                self.healthz,
            )

    async def apply_config(self, config: Config) -> None:
        """Apply a new config without a restart: the one entry point of a live reload."""
        await apply_config(self, config)

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

    async def replace_plugin(self, resource_name: str) -> None:
        """Serve and register the plugin under `resource_name` instead: the running life cycle
        ends (closing its server, removing its socket) and the runner starts the new one."""
        old = self.lifecycle
        self.lifecycle = PluginLifecycle(
            self.service, plugin_dir=self.settings.device_plugin_dir, resource_name=resource_name
        )
        self.lifecycle.stats = old.stats
        self._plugin_stop.set()

    async def _serve_plugin(self, stop: asyncio.Event) -> None:
        """Run the plugin's life cycle until `stop`; a new one after replace_plugin."""
        while not stop.is_set():
            self._plugin_stop = plugin_stop = asyncio.Event()
            relay = asyncio.ensure_future(stop.wait())
            relay.add_done_callback(functools.partial(_set_on_done, plugin_stop))
            try:
                await self.lifecycle.run(plugin_stop)
            finally:
                relay.cancel()

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
        stats = self.lifecycle.stats
        return DaemonHealth(
            registered=self.lifecycle.registered,
            unregistered_since_s=self.lifecycle.unregistered_since_s,
            registrations_total=stats.registrations,
            registration_failures_total=stats.registration_failures,
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
                tasks.create_task(self._serve_plugin(stop), name="plugin")
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
                    mps, inventory = self.mps, self.inventory
                    tasks.create_task(
                        mps.run(stop, lambda: mps_defaults(inventory.value.plans)), name="mps"
                    )
        finally:
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


async def serve(
    settings: DaemonSettings, stop: asyncio.Event, hangup: asyncio.Event | None = None
) -> None:
    """Open the backend, run the daemon until `stop`, and release the backend on every path.
    `hangup` (SIGHUP) reloads the config."""
    backend = open_backend(settings.backend, settings.config)
    try:
        await Daemon(settings, backend).run(stop, hangup)
    finally:
        backend.close()
