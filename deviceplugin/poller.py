"""The poll loop: one tick reads the GPU backend in a worker thread (never on the event loop),
turns the reading into the slice inventory and the usage snapshot, hands the snapshot to the
enforcer, and publishes both. ListAndWatch streams wake on an inventory change; the exporter and
/status read the latest snapshot. A backend that stops answering leaves the last device list in
force and stale snapshots published.

While no slice is allocated and the GPUs run no process there is nothing to attribute or
enforce: the loop then polls every `idlePollInterval` (5 s by default) instead of every
`pollInterval`, and an Allocate ends the wait at once.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from deviceplugin.config import Config
from deviceplugin.dra.slices import device_name
from deviceplugin.errors import BackendError
from deviceplugin.frontend import KubeletFrontend
from deviceplugin.gpu.backend import GpuBackend, no_wake
from deviceplugin.incremental import InventoryCache
from deviceplugin.kubelet.limits import DeviceListTooLargeError, device_list_problem
from deviceplugin.limitsview import MemoryLimitsView
from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    GpuReading,
    Inventory,
    NodeSnapshot,
)
from deviceplugin.slicing import format_bytes, keep_held, plan_gpus
from deviceplugin.state import AllocationBook, Published
from deviceplugin.usage.attribution import AttributionEvidence, SnapshotBuilder, mark_stale
from deviceplugin.usage.procs import AllocationResolver

log = logging.getLogger(__name__)

T = TypeVar("T")


# What attribution checks a claimed allocation against: in DRA mode (True), the claims.
EVIDENCE = {False: "the kubelet's device checkpoint", True: "the prepared claims' pods"}


def describe_inventory_change(old: Inventory, new: Inventory, *, dra: bool = False) -> list[str]:
    """Human lines for what changed between two inventories: GPUs and their slicing, or in DRA
    mode (`dra`) the devices they are published as. Health: `describe_health_change`."""
    lines: list[str] = []
    old_plans = {p.gpu.uuid: p for p in old.plans}
    for uuid in old_plans.keys() - {p.gpu.uuid for p in new.plans}:
        lines.append(f"gpu removed uuid={uuid}")
    for plan in new.plans:
        if old_plans.get(plan.gpu.uuid) == plan:
            continue
        gpu, reason = plan.gpu, plan.excluded_reason
        if reason and dra:
            lines.append(f"gpu not published index={gpu.index} uuid={gpu.uuid} reason={reason!r}")
        elif reason:
            lines.append(f"gpu not sliced index={gpu.index} uuid={gpu.uuid} reason={reason!r}")
        elif dra:
            lines.append(
                f"gpu published as DRA device {device_name(plan)} index={gpu.index} "
                f"uuid={gpu.uuid} model={gpu.name!r} memory={format_bytes(gpu.memory_total_bytes)}"
            )
        else:
            lines.append(
                f"gpu sliced index={gpu.index} uuid={gpu.uuid} model={gpu.name!r} "
                f"resource={plan.resource_name} slices={plan.replicas} "
                f"memory_per_slice={format_bytes(plan.memory_per_slice_bytes)} "
                f"compute_share={plan.compute_share_ratio:.3f}"
            )
    return lines


def describe_health_change(old: Mapping[str, bool], readings: Iterable[GpuReading]) -> list[str]:
    """One line for each GPU (or MIG device) whose health changed since `old` (health by UUID;
    a GPU not in it counts as healthy): index, UUID and the backend's reason (the Xid)."""
    lines: list[str] = []
    for gpu in readings:
        info = gpu.info
        if gpu.healthy == old.get(info.uuid, True):
            continue
        if gpu.healthy:
            lines.append(f"gpu healthy again index={info.index} uuid={info.uuid}")
        else:
            reason = gpu.health_reason or "unhealthy"
            lines.append(f"gpu unhealthy index={info.index} uuid={info.uuid} reason={reason!r}")
    return lines


def idle_interval_s(config: Config) -> float:
    """How long the poll loop waits while idle: `idlePollInterval`, never below `pollInterval`."""
    enforcement = config.enforcement
    return max(enforcement.idle_poll_interval_s, enforcement.poll_interval_s)


class DaemonWorker:
    """One daemon thread that runs submitted calls in order.

    Unlike a ThreadPoolExecutor's threads, which the interpreter joins at exit, a daemon thread
    never keeps the process alive: a call hung in the GPU driver or on a stuck /proc read must
    not stop the daemon from exiting once it has cleaned up."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any] | None, Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, call))
        return future

    def run_for(self, loop: asyncio.AbstractEventLoop, call: Callable[[], T]) -> asyncio.Future[T]:
        """Like `submit`, for a caller on `loop`: the outcome comes back as one callback on the
        loop, with no concurrent Future to lock, notify and copy from in between (the poll does
        this twice a second, idle or not)."""
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            if future.cancelled():  # read off the loop: at worst, one call made for nothing
                return
            settle: Callable[[], None]
            try:
                settle = functools.partial(_set_result, future, call())
            except BaseException as e:  # noqa: BLE001 (handed to whoever awaits the future)
                settle = functools.partial(_set_exception, future, e)
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody awaits it
                    loop.call_soon_threadsafe(settle)

        self._queue.put((None, run))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if future is None:
                call()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 (handed to whoever awaits the future)
                future.set_exception(e)

    def shutdown(self) -> None:
        """Finish the call under way (if it ever returns), then stop; does not wait."""
        self._queue.put(None)


def _wake_from_any_thread(loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
        loop.call_soon_threadsafe(wake.set)


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


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
        frontend: KubeletFrontend,
        health: Callable[[], DaemonHealth] = DaemonHealth,
        resolver: AllocationResolver | None = None,
        enforce: Callable[[NodeSnapshot], NodeSnapshot] = lambda snapshot: snapshot,
        on_poll_duration: Callable[[float], None] = lambda seconds: None,
        timeout_s: float | None = None,
        trust_host_processes: bool = False,
        names_wanted: asyncio.Event | None = None,
        memory_limits: Callable[[], MemoryLimitsView] = MemoryLimitsView,
    ) -> None:
        self._backend = backend
        self._config = config
        self._inventory = inventory
        self._book = book
        self._health = health
        # The memory limits the driver enforces, as the memory-limits part last saw them.
        self._memory_limits = memory_limits
        # `is None`, not `or`: a resolver that holds no PID yet has a length of 0.
        self._resolver = resolver if resolver is not None else AllocationResolver()
        # Whether a container of the last snapshot checked has no name yet, and that snapshot's
        # containers.
        self._unnamed = False
        self._unnamed_checked: tuple[ContainerUsage, ...] = ()
        self._builder_node = node_name
        self._builder = SnapshotBuilder(node_name, config.enforcement.compute.window_s)
        # The inventory is rebuilt only when a GPU's facts or health, or the slicing, change.
        self._inventories = InventoryCache()
        # The device list's size check, kept with what it was computed from.
        self._list_check_key: object = None
        self._list_check_problem: str | None = None
        # The kubelet's side: what the poll publishes of the inventory it built, who holds which
        # allocation (the kubelet's device checkpoint, or in DRA mode the prepared claims and
        # their pods), and where the published inventory goes.
        self._frontend = frontend
        self._dra = frontend.kind == SOURCE_DRA
        self._checkpoint_reason: str | None = None
        # Each GPU's health at the last poll, by UUID: a change is logged once.
        self._healthy: dict[str, bool] = {}
        self._trust_host_processes = trust_host_processes
        self._enforce = enforce
        self._on_poll_duration = on_poll_duration
        self._interval_s = config.enforcement.poll_interval_s
        self._idle_interval_s = idle_interval_s(config)
        # True after a poll that saw no GPU process while no slice was allocated: the next one
        # comes after the idle interval (an Allocate, a reload or a failure ends that).
        self.idle = False
        self.timeout_s = timeout_s if timeout_s is not None else max(5.0, 4 * self._interval_s)
        self._worker = DaemonWorker("vgpu-poll")
        # Stale snapshots reach the enforcer through a worker of their own: the poll worker may
        # be the one that is stuck.
        self._stale_worker = DaemonWorker("vgpu-stale")
        self._pending: asyncio.Future[Tick] | None = None
        self._previous_reading_s: float | None = None
        self.snapshot: NodeSnapshot | None = None
        # Set when pod-resources should be asked at once (the frontend waits on it).
        self.names_wanted = names_wanted if names_wanted is not None else asyncio.Event()
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
        # Checked again only when the GPUs' facts or the slicing change (idle polls: never).
        infos = [g.info for g in reading.gpus]
        key = (cfg.slicing, cfg.mig, cfg.resource_name, infos)
        if key != self._list_check_key:
            self._list_check_problem = device_list_problem(
                plan_gpus(infos, cfg.slicing, mig=cfg.mig, resource_name=cfg.resource_name),
                cfg.slicing,
            )
            self._list_check_key = key
        problem = self._list_check_problem
        if problem is not None:
            raise DeviceListTooLargeError(problem)
        # Held slices that a new plan or a MIG layout change dropped stay, Unhealthy, until freed.
        built = self._inventories.build(
            reading, cfg.slicing, mig=cfg.mig, resource_name=cfg.resource_name
        )
        built = self._frontend.view(built)
        inventory = keep_held(
            self._inventory.value,
            built,
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
            # DRA mode: the snapshot speaks devices and claims, with the current policies.
            dra=cfg.dra if self._dra else None,
        )
        self._previous_reading_s = now_s
        duration_s = time.perf_counter() - started
        return Tick(inventory, self._enforce(snapshot), unknown, duration_s)

    def refuses(self, config: Config) -> list[str]:
        """Why `config`'s slicing plan cannot be polled on this node's GPUs (its device list
        would not fit in one kubelet message); empty when it fits or no GPU is known yet."""
        gpus = [plan.gpu for plan in self._inventory.value.plans]
        plans = plan_gpus(gpus, config.slicing, mig=config.mig, resource_name=config.resource_name)
        problem = device_list_problem(plans, config.slicing)
        return [] if problem is None else [problem]

    async def reconfigure(self, old: Config, config: Config) -> None:
        """Poll with a new config from the next tick on, at once (a live reload): the new plan
        reaches the kubelet now, and the poll reconciles the resource set with it."""
        self._config = config
        self._interval_s = config.enforcement.poll_interval_s
        self._idle_interval_s = idle_interval_s(config)
        self.timeout_s = max(5.0, 4 * self._interval_s)
        if config.enforcement.compute.window_s != old.enforcement.compute.window_s:
            self._builder = SnapshotBuilder(self._builder_node, config.enforcement.compute.window_s)
        self.wake.set()

    def _evidence(self) -> AttributionEvidence | None:
        """What a process's claimed allocation is checked against: the kubelet's device
        checkpoint (which pod holds which allocation) and the process's pod and container
        cgroups. A claim from a process in no pod cgroup is refused unless the settings trust
        host processes (demo, tests). Without a readable checkpoint, claims stand as they are."""
        checkpoint = self._frontend.evidence()
        if checkpoint.reason != self._checkpoint_reason:
            first = self._checkpoint_reason is None
            self._checkpoint_reason = checkpoint.reason
            if checkpoint.readable:
                log.info("verifying attribution against %s", EVIDENCE[self._dra])
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
            container_of=self._resolver.container_of,
            containers_known=self._resolver.containers_known,
            version=self._resolver.generation,
        )

    def container_now(self, pid: int) -> str | None:
        """The pod container cgroup `pid` is in now, read afresh (for a check before a signal)."""
        return self._resolver.container_now(pid)

    @property
    def interval_s(self) -> float:
        """How long the loop waits for the next poll now."""
        return self._idle_interval_s if self.idle else self._interval_s

    def allocated(self) -> None:
        """An Allocate was answered: ask pod-resources for the container's name soon, and end an
        idle wait, so that the container is measured from its first process on."""
        self.names_wanted.set()
        if self.idle:
            self.wake.set()

    def submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `call` on the poll worker, between two ticks."""
        return self._worker.submit(call)

    async def poll_once(self) -> None:
        """One poll; raises BackendError or TimeoutError when the backend does not answer."""
        if self._pending is None or self._pending.done():
            allocations = tuple(self._book)
            self._pending = self._worker.run_for(
                asyncio.get_running_loop(), functools.partial(self._tick, allocations)
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
            for line in describe_inventory_change(old, tick.inventory, dra=self._dra):
                (log.warning if "removed" in line else log.info)(line)
        readings = [gpu.reading for gpu in tick.snapshot.gpus]
        for line in describe_health_change(self._healthy, readings):
            (log.warning if "unhealthy" in line else log.info)(line)
        self._healthy = {r.info.uuid: r.healthy for r in readings}
        self._frontend.publish(tick.inventory)
        self.last_success_wall_s = tick.snapshot.taken_at_s
        self.failures = 0
        # The book as it is now: an Allocate answered while the tick ran counts (its wake-up
        # came while the loop was not idle yet).
        idle = not len(self._book) and not any(gpu.reading.processes for gpu in tick.snapshot.gpus)
        if idle != self.idle:
            self.idle = idle
            log.debug(
                "polling every %gs: %s",
                self.interval_s,
                "no slice allocated and no GPU process" if idle else "slices or processes in use",
            )
        self.snapshot = replace(
            tick.snapshot, health=self._health(), memory_limits=self._memory_limits()
        )
        self._on_poll_duration(tick.duration_s)
        # Ask pod-resources again when processes carry an allocation this daemon does not know
        # (made before it started) or a container has no name yet (allocated since the last ask).
        containers = tick.snapshot.containers
        if containers is not self._unnamed_checked:  # (the same tuple while nothing changed)
            self._unnamed = any(not c.pod for c in containers)
            self._unnamed_checked = containers
        if tick.unknown_allocations or self._unnamed:
            self.names_wanted.set()

    async def run(self, stop: asyncio.Event) -> None:
        # One waiter on `stop` for the whole run and one on `wake` until it fires: a tick that
        # only times out creates no task.
        stopped = asyncio.ensure_future(stop.wait())
        woken = asyncio.ensure_future(self.wake.wait())
        self._backend.set_wake(
            functools.partial(_wake_from_any_thread, asyncio.get_running_loop(), self.wake)
        )
        try:
            while not stop.is_set():
                if woken.done():
                    woken = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait(
                    (stopped, woken),
                    timeout=self.interval_s,
                    return_when=asyncio.FIRST_COMPLETED,
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
                    self.idle = False  # retried at the poll interval
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
            self._backend.set_wake(no_wake)
            stopped.cancel()
            woken.cancel()
            self._worker.submit(self._resolver.close)  # after the tick under way, if any
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
