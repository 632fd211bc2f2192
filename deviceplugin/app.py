"""The composition root: builds the daemon from its settings, owns its tasks and its shutdown.

One poll loop reads the GPU backend (in a worker thread, never on the event loop), turns the
reading into the slice inventory and publishes it; ListAndWatch streams wake on every change. The
plugin life cycle keeps the gRPC server registered with the kubelet. A part that fails for good
ends the TaskGroup, and the daemon exits non-zero so the DaemonSet restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deviceplugin.config import Config
from deviceplugin.errors import BackendError
from deviceplugin.gpu.backend import GpuBackend
from deviceplugin.model import AllocationRecord, Inventory, NodeReading, allocation_id
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.podresources import list_container_devices
from deviceplugin.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.slicing import build_inventory, format_bytes
from deviceplugin.state import AllocationBook, Published

log = logging.getLogger(__name__)

POD_RESOURCES_RETRY_S = 10.0


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


def open_backend(spec: str) -> GpuBackend:
    """`fake:PATH` or `nvml`. Raises BackendError with what to do instead."""
    if spec.startswith("fake:"):
        from deviceplugin.gpu.fake import FakeBackend  # noqa: PLC0415 (only the chosen backend)

        path = spec.removeprefix("fake:")
        if not path:
            raise BackendError("--backend fake:PATH needs the path of a state file")
        return FakeBackend(Path(path))
    if spec == "nvml":
        raise BackendError(
            "the nvml backend is not part of this build yet; "
            "use --backend fake:PATH to run on fake GPUs"
        )
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


class Poller:
    """Polls the backend every interval in a worker thread and publishes the inventory."""

    def __init__(
        self,
        backend: GpuBackend,
        config: Config,
        inventory: Published[Inventory],
        *,
        timeout_s: float | None = None,
        on_reading: Callable[[NodeReading], None] = lambda reading: None,
    ) -> None:
        self._backend = backend
        self._config = config
        self._inventory = inventory
        self._interval_s = config.enforcement.poll_interval_s
        self._timeout_s = timeout_s if timeout_s is not None else max(5.0, 4 * self._interval_s)
        self._on_reading = on_reading
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vgpu-poll")
        self._pending: asyncio.Future[NodeReading] | None = None
        self.failures = 0
        self.last_success_s = 0.0

    async def poll_once(self) -> None:
        """One poll; raises BackendError or TimeoutError when the backend does not answer."""
        if self._pending is None or self._pending.done():
            loop = asyncio.get_running_loop()
            self._pending = loop.run_in_executor(self._executor, self._backend.poll)
        # A hung call keeps its worker; the next tick waits on the same call, never stacks more.
        reading = await asyncio.wait_for(asyncio.shield(self._pending), self._timeout_s)
        self._pending = None
        inventory = build_inventory(reading, self._config.slicing)
        old = self._inventory.value
        if self._inventory.set(inventory):
            for line in describe_inventory_change(old, inventory):
                (log.warning if "unhealthy" in line or "removed" in line else log.info)(line)
        self.last_success_s = time.monotonic()
        self._on_reading(reading)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._interval_s)
                if stop.is_set():
                    return
                try:
                    await self.poll_once()
                    if self.failures:
                        log.info("polling recovered after_failures=%d", self.failures)
                    self.failures = 0
                except (BackendError, TimeoutError) as e:
                    self.failures += 1
                    level = logging.ERROR if self.failures == 1 else logging.DEBUG
                    log.log(
                        level,
                        "poll failed; keeping the last device list error=%r consecutive=%d",
                        str(e) or type(e).__name__,
                        self.failures,
                    )
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)


async def recover_allocations(
    book: AllocationBook,
    socket: Path,
    resource_name: str,
    stop: asyncio.Event,
    *,
    retry_s: float = POD_RESOURCES_RETRY_S,
) -> None:
    """Rebuild the allocation record from the kubelet's pod-resources API, once it answers.

    The allocation ID is derived from the slice IDs, so what the kubelet reports is enough to
    know every allocation made before this daemon (re)started, and who holds it."""
    attempts = 0
    while not stop.is_set():
        attempts += 1
        try:
            containers = await list_container_devices(socket)
        except grpc.aio.AioRpcError as e:
            if attempts == 1:
                log.warning(
                    "pod-resources API not answering; allocations made before this start will be "
                    "recovered when it does socket=%s error=%s",
                    socket,
                    e.code().name,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)
            continue
        now = time.time()
        count = 0
        for c in containers:
            if c.resource_name != resource_name:
                continue
            book.record(
                AllocationRecord(
                    allocation_id(c.device_ids),
                    tuple(sorted(c.device_ids)),
                    now,
                    namespace=c.namespace,
                    pod=c.pod,
                    container=c.container,
                )
            )
            count += 1
        log.info("recovered allocations from pod-resources count=%d", count)
        return


class Daemon:
    """The running daemon's parts, for `serve`, the demo and the black-box tests."""

    def __init__(self, settings: DaemonSettings, backend: GpuBackend) -> None:
        self.settings = settings
        self.backend = backend
        self.inventory: Published[Inventory] = Published(Inventory())
        self.book = AllocationBook()
        self.poller = Poller(backend, settings.config, self.inventory)
        # The service and the life cycle refer to each other; the lambdas resolve the life cycle
        # when they are called, after it exists.
        self.service = DevicePluginService(
            settings.config,
            self.inventory,
            self.book,
            generation=lambda: self.lifecycle.generation(),  # noqa: PLW0108
            on_stream_end=lambda generation: self.lifecycle.stream_ended(generation),  # noqa: PLW0108
        )
        self.lifecycle = PluginLifecycle(
            self.service,
            plugin_dir=settings.device_plugin_dir,
            resource_name=settings.config.resource_name,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set. The first poll must succeed: nothing can be served before."""
        cfg = self.settings.config
        log.info(
            "starting vgpu device plugin backend=%s resource=%s device_plugin_dir=%s",
            self.backend.name,
            cfg.resource_name,
            self.settings.device_plugin_dir,
        )
        for warning in cfg.warnings:
            log.warning("config: %s", warning)
        await self.poller.poll_once()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.poller.run(stop), name="poll")
            tasks.create_task(self.lifecycle.run(stop), name="plugin")
            tasks.create_task(
                recover_allocations(
                    self.book, self.settings.pod_resources_socket, cfg.resource_name, stop
                ),
                name="recover-allocations",
            )
        log.info("stopped")


async def serve(settings: DaemonSettings, stop: asyncio.Event) -> None:
    """Open the backend, run the daemon until `stop`, and release the backend on every path."""
    backend = open_backend(settings.backend)
    try:
        await Daemon(settings, backend).run(stop)
    finally:
        backend.close()
