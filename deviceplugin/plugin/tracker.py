"""The allocation tracker: keeps the record of allocations in step with the kubelet's
pod-resources API, so that allocations made before a restart are known again and every
container's series carries its pod's name.

Pod-resources lists the pods the kubelet's pod manager knows. Right after a kubelet restart that
is none, until the kubelet has had its pods from the API server (seconds; longer when the API
server is slow), while its device checkpoint still names every allocation. So an answer is not
taken as pods leaving while the kubelet *resyncs*: from a restart (the pod-resources socket was
re-created) or a first answer that lists no pod while the checkpoint names allocations of ours,
until an answer lists a pod again or `resync_grace_s` has passed, what the checkpoint names is
kept. While pod-resources does not answer at all (a daemon restarted before the kubelet's API is
back), the allocations the checkpoint names are recovered from it, so that they are enforced.
The tracker keeps asking while it holds any allocation or the checkpoint names one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

import grpc

from deviceplugin.kubelet.checkpoint import DeviceCheckpoint
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.model import AllocationRecord, allocation_id
from deviceplugin.state import AllocationBook

log = logging.getLogger(__name__)

POD_RESOURCES_INTERVAL_S = 10.0
# How long after a kubelet restart an answer that lists no pod is not taken as the pods leaving.
RESYNC_GRACE_S = 60.0


def _no_checkpoint() -> DeviceCheckpoint:
    return DeviceCheckpoint.unreadable("no checkpoint given")


def checkpoint_records(checkpoint: DeviceCheckpoint, now_s: float) -> list[AllocationRecord]:
    """The allocations the kubelet's checkpoint names, one record each (no pod names: the
    checkpoint has the pod's UID only)."""
    records: dict[str, AllocationRecord] = {}
    for entry in checkpoint.entries:
        if entry.allocation_id not in records:
            records[entry.allocation_id] = AllocationRecord(
                entry.allocation_id,
                entry.device_ids,
                now_s,
                container=entry.container,
                resource_name=entry.resource_name,
            )
    return list(records.values())


def init_container_records(
    checkpoint: DeviceCheckpoint, live: Collection[AllocationRecord], now_s: float
) -> tuple[list[AllocationRecord], frozenset[str]]:
    """The allocations of a listed pod's containers that pod-resources does not list: its init
    containers', which the kubelet keeps in its checkpoint for as long as the pod lives.

    Pod-resources lists a pod's regular containers only, and has no pod UID; the checkpoint has
    the UID and every container. A pod is known by name once one of its checkpoint entries is
    an allocation pod-resources lists. Each other entry of that pod is then either held still,
    named by the pod and the init container (the kubelet keeps those devices for the pod, and
    gives them to no other pod), or, when every one of its devices went on to a listed
    container of the pod (the kubelet reuses an init container's devices), released: its slices
    are counted under the container that holds them now. Returns (named records, released
    allocation IDs)."""
    listed = {r.allocation_id: r for r in live}
    if not checkpoint.entries or not listed:
        return [], frozenset()
    pods: dict[str, AllocationRecord] = {}
    devices_of_pod: dict[str, set[str]] = {}
    for entry in checkpoint.entries:
        record = listed.get(entry.allocation_id)
        if record is not None and record.pod:
            pods.setdefault(entry.pod_uid, record)
            devices_of_pod.setdefault(entry.pod_uid, set()).update(record.slice_ids)
    named: dict[str, AllocationRecord] = {}
    released: set[str] = set()
    for entry in checkpoint.entries:
        pod = pods.get(entry.pod_uid)
        if pod is None or entry.allocation_id in listed or entry.allocation_id in named:
            continue
        if devices_of_pod[entry.pod_uid].issuperset(entry.device_ids):
            released.add(entry.allocation_id)
            continue
        named[entry.allocation_id] = AllocationRecord(
            entry.allocation_id,
            entry.device_ids,
            now_s,
            namespace=pod.namespace,
            pod=pod.pod,
            container=entry.container,
            resource_name=entry.resource_name,
            init_container=True,
        )
    return list(named.values()), frozenset(released - set(named))


class AllocationTracker:
    """Keeps the allocation record in step with the kubelet's pod-resources API.

    The allocation ID is derived from the slice IDs, so what the kubelet reports is enough to
    know every allocation made before this daemon (re)started, and who holds it. Asked again
    every `interval_s` while it holds any allocation, the checkpoint names one, or the last ask
    failed, and at once (at most every `min_gap_s`) after an Allocate, when a GPU process carries
    an allocation this daemon does not know, or when a container has no name yet. An allocation
    the kubelet listed and no longer lists (its pod is gone) is dropped, except while the kubelet
    resyncs (see the module's docstring); one it never listed is dropped `grace_s` after it was
    handed out."""

    def __init__(
        self,
        book: AllocationBook,
        socket: Path,
        resource_name: str | Callable[[], Collection[str]],
        *,
        interval_s: float = POD_RESOURCES_INTERVAL_S,
        min_gap_s: float = 0.25,
        grace_s: float = 60.0,
        checkpoint: Callable[[], DeviceCheckpoint] = _no_checkpoint,
        resync_grace_s: float = RESYNC_GRACE_S,
        adopt: Callable[[str, tuple[str, ...]], bool] = lambda resource, device_ids: False,
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
        self._checkpoint = checkpoint
        self._resync_grace_s = resync_grace_s
        # Whether allocations under a name not in `resource_name` are ours all the same.
        self._adopt = adopt
        # The pod-resources socket that gave the last answer: another one is another kubelet.
        self._socket_identity: tuple[int, int, int] | None = None
        # Monotonic time since which the kubelet resyncs its pods; None when it does not.
        self.resyncing_since: float | None = None
        self.ok = False
        self.refreshes = 0
        self.recovered = 0
        # Whether `prime` had an answer: `run` then starts with a wait, not with a second ask.
        self._primed = False

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._socket)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    async def refresh(self) -> None:
        """Ask pod-resources once; raises grpc.aio.AioRpcError when it does not answer."""
        identity = self._identity()
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
                resource_name=c.resource_name,
            )
            for c in containers
            if c.resource_name in resources or self._adopt(c.resource_name, c.device_ids)
        ]
        checkpoint = self._ours(self._checkpoint(), resources)
        finished, released = init_container_records(checkpoint, live, now)
        live.extend(finished)
        restarted = (
            identity is not None
            and self._socket_identity is not None
            and identity != self._socket_identity
        )
        if identity is not None:
            self._socket_identity = identity
        first = self.refreshes == 0 or not self.ok
        if (
            self.resyncing_since is None
            and not containers
            and checkpoint.entries
            and (restarted or first)
        ):
            self.resyncing_since = time.monotonic()
            log.info(
                "pod-resources lists no pod while the kubelet's checkpoint names %d "
                "allocations (%s); keeping them until it lists its pods again",
                len(checkpoint.entries),
                "kubelet restart" if restarted else "kubelet starting",
            )
        keep: frozenset[str] = frozenset()
        if self.resyncing_since is not None:
            waited = time.monotonic() - self.resyncing_since
            if containers or waited > self._resync_grace_s:
                log.info(
                    "the kubelet lists its pods again waited_s=%.1f pods_listed=%s",
                    waited,
                    bool(containers),
                )
                self.resyncing_since = None
            else:
                records = checkpoint_records(checkpoint, now)
                self._recover(records)
                keep = frozenset(r.allocation_id for r in records)
        added, dropped = self._book.sync(
            live, now_s=now, grace_s=self._grace_s, keep=keep, release=released - keep
        )
        self.refreshes += 1
        if added or dropped or self.refreshes == 1:
            log.info(
                "allocations in step with pod-resources live=%d added=%d dropped=%d kept=%d",
                len(live),
                added,
                dropped,
                len(keep),
            )

    def _recover(self, records: list[AllocationRecord]) -> int:
        added = self._book.recovered(records)
        if added:
            self.recovered += added
            log.info("allocations recovered from the kubelet's checkpoint added=%d", added)
        return added

    def _ours(
        self, checkpoint: DeviceCheckpoint, resources: Collection[str] | None = None
    ) -> DeviceCheckpoint:
        """The checkpoint's entries of our resources: a served or retired name, or another name
        whose devices are all slices of this node (a rename before a restart of this daemon)."""
        names = self._resources() if resources is None else resources
        entries = tuple(
            e
            for e in checkpoint.entries
            if e.resource_name in names or self._adopt(e.resource_name, e.device_ids)
        )
        return (
            checkpoint if len(entries) == len(checkpoint.entries) else DeviceCheckpoint.of(entries)
        )

    def recover_from_checkpoint(self) -> int:
        """Pod-resources does not answer: know (and so enforce) what the kubelet's checkpoint
        names. Returns how many allocations were added to the book."""
        return self._recover(checkpoint_records(self._ours(self._checkpoint()), time.time()))

    async def prime(self) -> None:
        """Ask once at start, before the plugins serve: what is held, from pod-resources, or from
        the checkpoint when pod-resources does not answer (then `run` asks again at once)."""
        try:
            await self.refresh()
            self.ok = self._primed = True
        except grpc.aio.AioRpcError as e:
            log.info(
                "pod-resources API not answering at start; asking again shortly error=%s",
                e.code().name,
            )
            self.recover_from_checkpoint()

    def _may_hold(self) -> bool:
        """Whether anything may be held: the book holds an allocation, the kubelet resyncs, or
        its checkpoint names one."""
        return (
            bool(len(self._book))
            or self.resyncing_since is not None
            or bool(self._ours(self._checkpoint()).entries)
        )

    async def run(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        try:
            await self._run(stop, wake)
        finally:
            await self._client.close()

    async def _run(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        primed, self._primed = self._primed, False
        while not stop.is_set():
            wake.clear()
            try:
                if primed:
                    primed = False  # asked a moment ago
                else:
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
                self.recover_from_checkpoint()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._min_gap_s)
            if stop.is_set():
                return
            waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())}
            # With nothing that may be held there is nothing to ask about until an Allocate or a
            # process carrying an unknown allocation (both set `wake`).
            idle = self.ok and not self._may_hold()
            try:
                await asyncio.wait(
                    waiters,
                    timeout=None if idle else self._interval_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
