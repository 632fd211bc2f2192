"""What a device-plugin allocation gives a container's memory (a `LimitSource`, docs/design.md
§15.3): the allocation book's grants, held by the pod the kubelet's device checkpoint gives the
allocation to. The checkpoint is the kubelet's (written before it creates the container, root's
only): a grant ID that no allocation has, or that the checkpoint gives to another pod, is
refused. Nothing comes from the container's environment or annotations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from deviceplugin.memlimits.source import LimitRefusedError
from deviceplugin.model import DeviceGrant
from deviceplugin.owners import AllocationOwners
from deviceplugin.partitions import GpuLimit
from deviceplugin.state import AllocationBook


def grant_limits(grants: tuple[DeviceGrant, ...]) -> dict[str, GpuLimit]:
    """Per GPU, the soft (request) and hard (limit) bytes of an allocation's grants."""
    found: dict[str, GpuLimit] = {}
    for grant in grants:
        limit = GpuLimit(grant.request_bytes, grant.memory_limit_bytes)
        before = found.get(grant.gpu_uuid)
        found[grant.gpu_uuid] = limit if before is None else before + limit
    return found


class AllocationSource:
    """The device-plugin side's LimitSource. `owners` reads the kubelet's device checkpoint (a
    reader of its own: it is called off the event loop)."""

    def __init__(self, book: AllocationBook, owners: Callable[[], AllocationOwners]) -> None:
        self._book = book
        self._owners = owners

    async def _pods(self, grant_id: str) -> frozenset[str]:
        owners = await asyncio.to_thread(self._owners)
        if not owners.readable:
            raise LimitRefusedError(
                f"the kubelet's device checkpoint cannot be read ({owners.reason}): who holds "
                "it is not known"
            )
        return owners.owners.get(grant_id, frozenset())

    async def limits_for(self, grant_id: str, pod_uid: str) -> Mapping[str, GpuLimit]:
        record = self._book.get(grant_id)
        if record is None:
            raise LimitRefusedError("no allocation has this ID on this node")
        if not record.grants:
            raise LimitRefusedError("the allocation's grants are not known yet")
        pods = await self._pods(grant_id)
        if pod_uid not in pods:
            holders = ", ".join(sorted(pods)) or "no pod"
            raise LimitRefusedError(
                f"pod {pod_uid} does not hold it (the kubelet's checkpoint gives it to {holders})"
            )
        return grant_limits(record.grants)

    async def still_holds(self, grant_id: str, pod_uid: str) -> bool:
        if self._book.get(grant_id) is None:
            return False
        try:
            return pod_uid in await self._pods(grant_id)
        except LimitRefusedError:
            return True  # not known: kept (the sweep clears it once its container exits)
