"""What the driver enforces of GPU memory, as /status, the view and the metrics show it
(docs/design.md §15): frozen values the memory-limits part publishes whole and the snapshot
carries. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuMemoryEnforcement:
    """How a GPU's memory is enforced (docs/design.md §15): `driver-dmem` or `driver-misc` (its
    driver holds each container's cgroup to its limit), or `poll` with the cause and the reason
    (the poller holds it, §4)."""

    gpu_uuid: str
    mode: str
    cause: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ContainerMemoryLimit:
    """What the driver holds for one container's own cgroup on one GPU: the sum of the grants
    its hooks named (`grants`: allocation IDs), as soft (request) and hard (limit) bytes, since
    when (`set_at_s`, wall clock; None while the set is in flight), and what the driver counts
    as used by the cgroup (None where not read)."""

    gpu_uuid: str
    cgroup: str
    pod_uid: str
    container_id: str
    grants: tuple[str, ...]
    mode: str
    soft_bytes: int
    hard_bytes: int
    set_at_s: float | None
    driver_used_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryLimitsView:
    """The memory limits the driver enforces, as /status and the metrics show them: per GPU how
    its memory is enforced, per container cgroup and GPU its limit, and the count of each
    action on a limit (set, cleared, kept, repaired, refused, failed). `served`: whether the
    runtime hook's socket is served; `why_not` says why not."""

    gpus: tuple[GpuMemoryEnforcement, ...] = ()
    limits: tuple[ContainerMemoryLimit, ...] = ()
    actions: tuple[tuple[str, int], ...] = ()
    served: bool = False
    why_not: str = "the daemon does not apply memory limits"

    def gpu(self, uuid: str) -> GpuMemoryEnforcement:
        for g in self.gpus:
            if g.gpu_uuid == uuid:
                return g
        return GpuMemoryEnforcement(uuid, "poll", "", self.why_not or "not known")

    def of_allocation(self, allocation_id: str, gpu_uuid: str) -> tuple[ContainerMemoryLimit, ...]:
        """The container cgroups limited on the GPU under this allocation."""
        return tuple(
            limit
            for limit in self.limits
            if limit.gpu_uuid == gpu_uuid and allocation_id in limit.grants
        )
