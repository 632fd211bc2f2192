"""What a prepared claim gives a container's memory (a `LimitSource`, docs/design.md §15.3): the
memory it consumed (its request) and its limit per GPU, for a container in a pod the claim is
reserved for. A pod that joined a claim prepared before (a claim shared by pods: the kubelet
prepares it once) is not in the claim as it was prepared: the claim is read again from the API
server, and the pod accepted when its `reservedFor` names it now. Nothing comes from the
container's environment or annotations.
"""

from __future__ import annotations

from collections.abc import Mapping

from deviceplugin.dra.claims import PreparedClaim
from deviceplugin.dra.driver import DraDriver
from deviceplugin.memlimits.source import LimitRefusedError
from deviceplugin.owners import normalize_pod_uid
from deviceplugin.partitions import GpuLimit


def claim_limits(claim: PreparedClaim) -> dict[str, GpuLimit]:
    """Per GPU, soft = the memory the claim consumed, hard = its limit."""
    return {
        uuid: GpuLimit(request, limit) for uuid, (request, limit) in claim.limits_per_gpu().items()
    }


def _pods(claim: PreparedClaim) -> frozenset[str]:
    return frozenset(normalize_pod_uid(uid) for _, uid in claim.pods)


class ClaimSource:
    """The DRA side's LimitSource: the driver's prepared claims, by allocation ID."""

    def __init__(self, driver: DraDriver) -> None:
        self._driver = driver

    def _claim(self, grant_id: str) -> PreparedClaim | None:
        return next((c for c in self._driver.claims if c.allocation_id == grant_id), None)

    async def _reserved(self, grant_id: str, pod_uid: str, *, reread: bool) -> PreparedClaim:
        claim = self._claim(grant_id)
        if claim is None:
            raise LimitRefusedError("no claim prepared on this node has this allocation ID")
        if pod_uid in _pods(claim):
            return claim
        if reread and await self._driver.reread_claim(claim, pod_uid):
            return await self._reserved(grant_id, pod_uid, reread=False)
        raise LimitRefusedError(
            f"claim {claim.namespace}/{claim.name} is not reserved for pod {pod_uid}"
        )

    async def limits_for(self, grant_id: str, pod_uid: str) -> Mapping[str, GpuLimit]:
        return claim_limits(await self._reserved(grant_id, pod_uid, reread=True))

    async def still_holds(self, grant_id: str, pod_uid: str) -> bool:
        claim = self._claim(grant_id)
        return claim is not None and pod_uid in _pods(claim)
