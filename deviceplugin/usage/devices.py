"""Pure: DRA mode's devices in the snapshot (docs/design.md §5). Per device the node's
ResourceSlice publishes (every GPU and MIG device the plan covers), what the prepared claims
consumed of it (the sums of their grants there) and what is left: the figures that explain why
a claim does not fit, where the scheduler counts the same consumed capacity against the same
device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deviceplugin.config import DraConfig
from deviceplugin.model import AllocationRecord, DraDevice, GpuPlan, dra_device_name

# Ratios are sums of whole or fractional percents over 100: rounded here so that 0.3 + 0.25
# claimed leaves 0.45 free, not 0.44999999999999996.
_DIGITS = 9


def dra_devices(
    plans: Sequence[GpuPlan], allocations: Iterable[AllocationRecord], policy: DraConfig
) -> dict[str, DraDevice]:
    """Each published device by its UUID: memory and compute claimed, free, the number of
    claims holding it, and whether a claim of the policy's minimum still fits."""
    memory: dict[str, int] = {}
    compute: dict[str, float] = {}
    claims: dict[str, int] = {}
    for record in allocations:
        for grant in record.grants:
            uuid = grant.gpu_uuid
            # What the scheduler accounted: the memory consumed (a limit above it is burst).
            memory[uuid] = memory.get(uuid, 0) + grant.request_bytes
            compute[uuid] = compute.get(uuid, 0.0) + grant.compute_share_ratio
            claims[uuid] = claims.get(uuid, 0) + 1
    devices: dict[str, DraDevice] = {}
    for plan in plans:
        if not plan.sliced:
            continue
        uuid = plan.gpu.uuid
        claimed_memory = memory.get(uuid, 0)
        claimed_compute = round(compute.get(uuid, 0.0), _DIGITS)
        free_memory = max(plan.gpu.memory_total_bytes - claimed_memory, 0)
        free_compute = round(max(1.0 - claimed_compute, 0.0), _DIGITS)
        devices[uuid] = DraDevice(
            name=dra_device_name(plan.gpu),
            memory_claimed_bytes=claimed_memory,
            memory_free_bytes=free_memory,
            compute_claimed_ratio=claimed_compute,
            compute_free_ratio=free_compute,
            claims=claims.get(uuid, 0),
            full=free_memory < policy.memory_min_bytes
            or round(free_compute * 100, 6) < policy.compute_min,
        )
    return devices
