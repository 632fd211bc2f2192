"""GPU memory limits the driver enforces (docs/design.md §15) as an optional part: the record,
the book, the hook's socket, the reconciler and what they publish.

On with `--memory-limits on` (the default). At start the record left by an earlier daemon is
read; once the frontend knows who holds what, it is reconciled (a daemon killed outright leaves
limits behind). Then, every `refresh_s`: each GPU's enforcement is read from the backend (a GPU
the latest poll found unhealthy, and a MIG device, are polled); the GPUs whose driver enforces
memory are handed to `LimitHooks`, from which Allocate and Prepare name the hook in their CDI
specs; the socket is served from the first such GPU on (so that a node whose GPUs are all
polled serves none); the driver's use of each limited cgroup is read; device-plugin allocations
that went have their specs removed; and the view (/status, the metrics, the node labels) is
replaced whole. The reconciler clears each limit as its container goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from deviceplugin.config import Config
from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.backend import PartitionBackend
from deviceplugin.limitsview import MemoryLimitsView
from deviceplugin.memlimits.apply import LimitApplier
from deviceplugin.memlimits.book import LimitBook
from deviceplugin.memlimits.cdihook import AllocationSpecs, LimitHooks
from deviceplugin.memlimits.hookserver import HookServer
from deviceplugin.memlimits.reconcile import LimitReconciler
from deviceplugin.memlimits.record import LimitRecord
from deviceplugin.memlimits.settings import MemoryLimitSettings
from deviceplugin.memlimits.source import LimitSource
from deviceplugin.memlimits.view import effective_support, enforced_gpus, limits_view
from deviceplugin.model import NodeSnapshot
from deviceplugin.partitions import PartitionMode, PartitionSupport
from deviceplugin.state import Published
from deviceplugin.usage.cgroups import KubeletTree

log = logging.getLogger("deviceplugin.memlimits")

REFRESH_S = 2.0
OFF = "memory limits are off (serve --memory-limits off): every GPU's memory is polled"
NO_GPU = "no GPU's driver partitions memory: every GPU's memory is polled"
POLL = "poll"


def node_enforcement(support: Mapping[str, PartitionSupport]) -> str:
    """`driver` when every GPU's driver enforces memory, `poll` when none does (or there is no
    GPU), `mixed` between."""
    enforced = [s.mode is not PartitionMode.POLL for s in support.values()]
    if enforced and all(enforced):
        return "driver"
    return "mixed" if any(enforced) else POLL


class MemoryLimitsPart:
    """An `optional.OptionalPart`: see the module docstring. `source` gives the frontend's
    LimitSource (asked once the part runs); `specs` (device plugins: the allocations' hook
    specs) are removed once `live` (the book's allocation IDs) no longer has them."""

    name = "memory-limits"

    def __init__(
        self,
        settings: MemoryLimitSettings | None,
        *,
        backend: PartitionBackend,
        state_dir: Path,
        cgroup_mount: Path,
        tree: Callable[[], KubeletTree],
        source: Callable[[], LimitSource],
        hooks: LimitHooks,
        snapshot: Callable[[], NodeSnapshot | None],
        specs: AllocationSpecs | None = None,
        live: Callable[[], Collection[str]] = frozenset,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.settings = settings
        self.hooks = hooks
        self._backend = backend
        self._tree = tree
        self._source = source
        self._snapshot = snapshot
        self._live = live
        self._refresh_s = refresh_s
        self.record = LimitRecord(state_dir)
        self.book = LimitBook(backend, self.record, cgroup_mount=cgroup_mount)
        self.specs = specs
        self.server: HookServer | None = None
        self.support: Mapping[str, PartitionSupport] = {}
        self.view = MemoryLimitsView(why_not=OFF if settings is None else NO_GPU)
        # The node's summary for its node label: driver, poll or mixed (node_enforcement).
        self.enforcement: Published[str] = Published(POLL)
        self._used: dict[tuple[str, str], int] = {}

    @property
    def active(self) -> bool:
        return self.settings is not None

    async def start(self) -> None:
        """Read the record an earlier daemon left (reconciled once the part runs)."""
        if self.settings is not None:
            await asyncio.to_thread(self.record.load)
            await self.refresh()

    async def run(self, stop: asyncio.Event) -> None:
        settings = self.settings
        if settings is None:
            return
        source = self._source()
        reconciler = LimitReconciler(self.book, source)
        await reconciler.reconcile_at_start()
        applier = LimitApplier(self.book, source, self._tree())
        server = HookServer(settings.socket, applier)
        try:
            async with asyncio.TaskGroup() as tasks:
                watch = tasks.create_task(reconciler.run(), name="memory-limit-reconcile")
                await self._refresh_until(stop, server)
                watch.cancel()
        finally:
            await server.close()
            self.server = None

    async def _refresh_until(self, stop: asyncio.Event, server: HookServer) -> None:
        while not stop.is_set():
            await self.refresh()
            if self.hooks.enforced and self.server is None:
                await server.start()
                self.server = server
                self._publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._refresh_s)

    async def refresh(self) -> None:
        """Each GPU's enforcement, the driver's use of each limited cgroup, the specs of gone
        allocations, and the view."""
        try:
            support = await self.book.call(
                "reading the GPUs' memory partitions", self._backend.memory_partitioning
            )
        except (MemoryLimitError, OSError) as e:
            log.warning("memory partitions not read; keeping the last error=%s", e)
            support = self.support
        snapshot = self._snapshot()
        readings = [g.reading for g in snapshot.gpus] if snapshot is not None else []
        effective = effective_support(support, readings) if readings else dict(support)
        self._log_changes(effective)
        self.support = effective
        self.enforcement.set(node_enforcement(effective))
        self.hooks.enforced = enforced_gpus(effective)
        await self._read_use()
        if self.specs is not None:
            await self._prune(self.specs, self._live)
        self._publish()

    def _log_changes(self, support: Mapping[str, PartitionSupport]) -> None:
        for uuid, now in sorted(support.items()):
            if self.support.get(uuid) != now:
                log.info("gpu memory enforcement gpu=%s enforcement=%s", uuid, now.describe())

    async def _read_use(self) -> None:
        """What the driver counts as used by each limited cgroup on each GPU."""
        used: dict[tuple[str, str], int] = {}
        for leaf in self.record:
            for applied in leaf.applied:
                if applied.set_at_s is None:
                    continue
                try:
                    limits = await self.book.call(
                        f"reading the memory use of {leaf.cgroup}",
                        self._backend.get_memory_limits,
                        applied.gpu_uuid,
                        leaf.cgroup,
                    )
                except MemoryLimitError:
                    continue  # gone meanwhile, or the driver does not say
                if limits is not None and limits.used_bytes is not None:
                    used[(leaf.cgroup, applied.gpu_uuid)] = limits.used_bytes
        self._used = used

    @staticmethod
    async def _prune(specs: AllocationSpecs, live: Callable[[], Collection[str]]) -> None:
        """Remove the specs of allocations that went: those written before this look whose
        allocation the book no longer holds."""
        written = await asyncio.to_thread(specs.written)
        gone = set(written) - set(live())
        if gone:
            await asyncio.to_thread(specs.remove, gone)

    def _publish(self) -> None:
        served = self.server is not None
        why_not = "" if served else (OFF if self.settings is None else NO_GPU)
        self.view = limits_view(
            self.support, self.record, self._used, self.book.counts, served=served, why_not=why_not
        )

    def affected(self, old: Config, new: Config) -> bool:
        return False

    async def replace(self, new: Config) -> None:
        """Nothing follows the config: limits follow the grants, made at Allocate and Prepare."""

    def close(self) -> None:
        """The socket goes with the daemon (a hook then fails, saying the daemon is down)."""
        if self.settings is not None and self.server is not None:
            with contextlib.suppress(FileNotFoundError):
                self.settings.socket.unlink()
