"""What the allocations give a container's GPU memory, as the hook's applier asks it
(docs/design.md §15.3): the seam each frontend implements (`plugin` from the allocation book and
the kubelet's checkpoint, `dra` from its prepared claims). It imports nothing of the daemon's
parts, so that a frontend that must not know them (the DRA driver) can implement it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from deviceplugin.partitions import GpuLimit


class LimitRefusedError(Exception):
    """The source gives the container nothing under that grant; the message says why."""


class LimitSource(Protocol):
    """What the allocations say. Called on the event loop: what blocks (a file read, the API
    server) is awaited off it."""

    async def limits_for(self, grant_id: str, pod_uid: str) -> Mapping[str, GpuLimit]:
        """Per GPU UUID, the memory the grant gives a container of pod `pod_uid`: soft its
        request, hard its limit. Raises LimitRefusedError when the grant is unknown or held by
        another pod."""
        ...

    async def still_holds(self, grant_id: str, pod_uid: str) -> bool:
        """Whether the pod still holds the grant (asked at start of what an earlier daemon
        set)."""
        ...
