"""Clearing the memory limits of containers that go, and repairing what a removed leaf leaked
(docs/design.md §15).

Each recorded leaf is in one of three states, read from its `cgroup.events` (never through a
symbolic link): running (`populated 1`), exited (`populated 0`: its processes are gone, the runtime
is about to remove it), or gone (its directory is). The reconciler acts on it:
- exited: clear its limits on every GPU (soft 0 first, then hard MAX) while the cgroup still
  exists, then forget it;
- gone: on dmem a leaf removed with a soft limit left that reservation in every ancestor's
  `dmem.min`: each ancestor up to the kubelet's top cgroup of pods, nearest first, is read back
  and, where its soft limit exceeds the soft limits the record still holds below it, set back to
  that sum (the change propagates upward, as any set does); on misc the driver dropped the limit
  with the cgroup. Then it is forgotten;
- running: kept, except at start, when a leaf whose container no longer holds a grant (the
  LimitSource says) is cleared.
It watches the recorded leaves' `cgroup.events` with inotify (the kernel notifies a change of
`populated`), and sweeps every leaf every `sweep_interval_s` besides (a removed directory is not
notified). Nothing is set outside the kubelet's top cgroup of pods; a call that fails is logged,
counted and tried again at the next sweep (a repair is tried once).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from pathlib import Path

from asyncinotify import Inotify, Mask, Watch

from deviceplugin.errors import MemoryLimitError
from deviceplugin.memlimits.book import LimitBook
from deviceplugin.memlimits.record import AppliedLimit, LeafRecord
from deviceplugin.memlimits.source import LimitSource
from deviceplugin.partitions import PartitionMode, cgroup_ancestors
from deviceplugin.safefs import open_directory
from deviceplugin.usage.cgroups import PodContainer

log = logging.getLogger(__name__)

DEFAULT_SWEEP_INTERVAL_S = 2.0
_MAX_EVENTS_BYTES = 4096


class LeafState(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    GONE = "gone"


def leaf_state(mount: Path, cgroup: str) -> LeafState:
    """Whether a container's cgroup still has processes, has none, or is gone."""
    try:
        directory = open_directory(f"{mount}{cgroup}", create=False)
    except FileNotFoundError:
        return LeafState.GONE
    except OSError:
        return LeafState.GONE  # a symlink or a file where the cgroup was: not ours any more
    try:
        fd = os.open("cgroup.events", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory.fd)
        with os.fdopen(fd, "rb") as f:
            content = f.read(_MAX_EVENTS_BYTES)
    except FileNotFoundError:
        return LeafState.GONE  # removed between the two opens
    except OSError:
        return LeafState.RUNNING  # cannot tell: keep it
    finally:
        os.close(directory.fd)
    for line in content.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return LeafState.RUNNING if value.strip() == "1" else LeafState.EXITED
    return LeafState.RUNNING


def _within(cgroup: str, top: str) -> bool:
    return cgroup == top or cgroup.startswith(top + "/")


class LimitReconciler:
    """Keeps the record and the driver's limits in step with the containers; see the module
    docstring."""

    def __init__(
        self,
        book: LimitBook,
        source: LimitSource,
        *,
        sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
    ) -> None:
        self.book = book
        self.source = source
        self.sweep_interval_s = sweep_interval_s

    def state(self, leaf: LeafRecord) -> LeafState:
        return leaf_state(self.book.cgroup_mount, leaf.cgroup)

    async def reconcile_at_start(self) -> None:
        """What an earlier daemon left: see the module docstring. Call once the source knows
        the allocations."""
        async with self.book.lock:
            for leaf in self.book.record:
                state = self.state(leaf)
                if state is LeafState.RUNNING:
                    pod = leaf.pod_uid
                    held = all(
                        [await self.source.still_holds(g.grant_id, pod) for g in leaf.grants]
                    )
                    if held:
                        self._leaf_action("kept", leaf, "its container still holds it")
                        continue
                    state = LeafState.EXITED
                await self._settle(leaf, state)

    async def sweep(self) -> None:
        """Act on every recorded leaf that exited or is gone."""
        async with self.book.lock:
            for leaf in self.book.record:
                state = self.state(leaf)
                if state is not LeafState.RUNNING:
                    await self._settle(leaf, state)

    async def _settle(self, leaf: LeafRecord, state: LeafState) -> None:
        if state is LeafState.EXITED:
            try:
                await self._clear(leaf)
                return
            except MemoryLimitError:
                if self.state(leaf) is not LeafState.GONE:
                    return  # logged; tried again at the next sweep
        await self._gone(leaf)

    async def _clear(self, leaf: LeafRecord) -> None:
        for applied in leaf.applied:
            try:
                await self.book.call(
                    f"clearing the memory limit of {leaf.cgroup} on {applied.gpu_uuid}",
                    self.book.backend.clear_memory_limits,
                    applied.gpu_uuid,
                    leaf.cgroup,
                )
            except MemoryLimitError as e:
                self._leaf_action("failed", leaf, f"clearing it failed: {e}", applied)
                raise
            self._leaf_action("cleared", leaf, "its container exited", applied)
        self.book.record.remove(leaf.cgroup)
        self.book.save()

    async def _gone(self, leaf: LeafRecord) -> None:
        """Forget a removed leaf; on dmem, repair the reservation it left in its ancestors."""
        self.book.record.remove(leaf.cgroup)
        self.book.save()
        for applied in leaf.applied:
            if applied.mode is PartitionMode.DMEM and applied.limit.soft_bytes:
                await self._repair(leaf, applied)
        log.info("memory-limit leaf gone cgroup=%s", leaf.cgroup)

    async def _repair(self, leaf: LeafRecord, applied: AppliedLimit) -> None:
        backend, uuid = self.book.backend, applied.gpu_uuid
        for ancestor in cgroup_ancestors(leaf.cgroup):
            if not _within(ancestor, leaf.pods_root):
                break  # nothing is set outside the pods' cgroups
            if leaf_state(self.book.cgroup_mount, ancestor) is LeafState.GONE:
                continue
            try:
                current = await self.book.call(
                    f"reading {ancestor} on {uuid}", backend.get_memory_limits, uuid, ancestor
                )
                expected = self.book.record.soft_below(ancestor, uuid)
                if current is None or current.soft_bytes <= expected:
                    continue
                await self.book.call(
                    f"repairing {ancestor} on {uuid}",
                    backend.set_memory_limits,
                    uuid,
                    ancestor,
                    expected,
                    current.hard_bytes,
                )
            except MemoryLimitError as e:
                self._leaf_action("failed", leaf, f"repairing {ancestor} failed: {e}", applied)
                continue
            self.book.action(
                "repaired",
                "memory reservation repaired",
                cgroup=ancestor,
                gpu=uuid,
                soft_bytes_before=current.soft_bytes,
                soft_bytes=expected,
                removed_leaf=leaf.cgroup,
            )

    def _leaf_action(
        self, action: str, leaf: LeafRecord, why: str, applied: AppliedLimit | None = None
    ) -> None:
        container = PodContainer(leaf.pod_uid, leaf.container_id, leaf.cgroup)
        gpu = applied.gpu_uuid if applied else None
        limit = applied.limit if applied else None
        self.book.container_action(action, container, gpu, limit, reason=repr(why))

    # -- the watch -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch and sweep until cancelled. inotify where it can be had, sweeps alone otherwise."""
        try:
            inotify: Inotify | None = Inotify()
        except OSError as e:
            log.warning("inotify unavailable; sweeping memory limits only reason=%r", str(e))
            inotify = None
        watches: dict[str, Watch] = {}
        try:
            while True:
                if inotify is not None:
                    self._sync_watches(inotify, watches)
                await self._wait(inotify)
                await self.sweep()
        finally:
            if inotify is not None:
                inotify.close()

    def _sync_watches(self, inotify: Inotify, watches: dict[str, Watch]) -> None:
        recorded = {leaf.cgroup for leaf in self.book.record}
        for cgroup in [c for c in watches if c not in recorded]:
            with contextlib.suppress(OSError, KeyError, ValueError):
                inotify.rm_watch(watches.pop(cgroup))
        for cgroup in recorded - watches.keys():
            with contextlib.suppress(OSError):
                events = Path(f"{self.book.cgroup_mount}{cgroup}") / "cgroup.events"
                watches[cgroup] = inotify.add_watch(events, Mask.MODIFY)

    async def _wait(self, inotify: Inotify | None) -> None:
        """Until a watched leaf changes, the record does, or the sweep interval passes."""
        waiters: list[asyncio.Future[object]] = [asyncio.ensure_future(self.book.changed.wait())]
        if inotify is not None:
            waiters.append(asyncio.ensure_future(inotify.get()))
        try:
            await asyncio.wait(
                waiters, timeout=self.sweep_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            self.book.changed.clear()
