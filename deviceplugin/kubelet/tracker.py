"""The allocation tracker: keeps the record of allocations in step with the kubelet's
pod-resources API, so that allocations made before a restart are known again and every
container's series carries its pod's name."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

import grpc

from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.model import AllocationRecord, allocation_id
from deviceplugin.state import AllocationBook

log = logging.getLogger(__name__)

POD_RESOURCES_INTERVAL_S = 10.0


class AllocationTracker:
    """Keeps the allocation record in step with the kubelet's pod-resources API.

    The allocation ID is derived from the slice IDs, so what the kubelet reports is enough to
    know every allocation made before this daemon (re)started, and who holds it. Asked again
    every `interval_s` while it holds any allocation (or the last ask failed), and at once (at
    most every `min_gap_s`) after an Allocate, when a GPU process carries an allocation this
    daemon does not know, or when a container has no name yet. An allocation the kubelet
    listed and no longer lists (its pod is gone) is dropped; one it never listed is dropped
    `grace_s` after it was handed out."""

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
            # With no allocation to name or drop there is nothing to ask about until an Allocate
            # or a process carrying an unknown allocation (both set `wake`).
            idle = self.ok and not len(self._book)
            try:
                await asyncio.wait(
                    waiters,
                    timeout=None if idle else self._interval_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
