"""What /status, the metrics, the view and the node labels show of the memory limits the driver
enforces (docs/design.md §5, §15): per GPU how its memory is enforced, per container cgroup and
GPU its limit and what the driver counts as its use, and the count of each action (pure).

A GPU's enforcement is its backend's answer (`PartitionBackend.memory_partitioning`), but that a
GPU the latest poll found unhealthy is polled (its driver may not answer a set: a container
would fail to start), and so is every MIG device (the driver partitions none) and every GPU the
backend does not list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deviceplugin.limitsview import ContainerMemoryLimit, GpuMemoryEnforcement, MemoryLimitsView
from deviceplugin.memlimits.record import LeafRecord
from deviceplugin.model import (
    GpuReading,
)
from deviceplugin.partitions import PartitionSupport, PollCause, polled


def effective_support(
    support: Mapping[str, PartitionSupport], readings: Iterable[GpuReading]
) -> dict[str, PartitionSupport]:
    """Per GPU (and MIG device) of the latest poll, how its memory is enforced now."""
    found: dict[str, PartitionSupport] = {}
    for reading in readings:
        uuid = reading.info.uuid
        if reading.info.is_mig_device:
            found[uuid] = polled(
                PollCause.MIG, "a MIG device: the driver partitions no MIG device's memory"
            )
        elif not reading.healthy:
            found[uuid] = polled(
                PollCause.UNHEALTHY,
                f"the GPU is unhealthy ({reading.health_reason or 'no reason given'})",
            )
        else:
            found[uuid] = support.get(uuid) or polled(
                PollCause.NO_PARTITIONS, "the GPU backend does not list this GPU's partitions"
            )
    return found


def enforced_gpus(support: Mapping[str, PartitionSupport]) -> frozenset[str]:
    return frozenset(uuid for uuid, s in support.items() if s.enforced)


def gpu_enforcement(support: Mapping[str, PartitionSupport]) -> tuple[GpuMemoryEnforcement, ...]:
    return tuple(
        GpuMemoryEnforcement(uuid, s.mode.value, s.cause.value, s.reason)
        for uuid, s in sorted(support.items())
    )


def container_limits(
    leaves: Iterable[LeafRecord], used: Mapping[tuple[str, str], int]
) -> tuple[ContainerMemoryLimit, ...]:
    """Every recorded leaf's limit per GPU (`used`: what the driver counts per (cgroup, GPU))."""
    found: list[ContainerMemoryLimit] = []
    for leaf in leaves:
        for applied in leaf.applied:
            uuid = applied.gpu_uuid
            found.append(
                ContainerMemoryLimit(
                    gpu_uuid=uuid,
                    cgroup=leaf.cgroup,
                    pod_uid=leaf.pod_uid,
                    container_id=leaf.container_id,
                    grants=tuple(
                        g.grant_id for g in leaf.grants if any(u == uuid for u, _ in g.gpus)
                    ),
                    mode=applied.mode.value,
                    soft_bytes=applied.limit.soft_bytes,
                    hard_bytes=applied.limit.hard_bytes,
                    set_at_s=applied.set_at_s,
                    driver_used_bytes=used.get((leaf.cgroup, uuid)),
                )
            )
    found.sort(key=lambda c: (c.gpu_uuid, c.cgroup))
    return tuple(found)


def limits_view(
    support: Mapping[str, PartitionSupport],
    leaves: Iterable[LeafRecord],
    used: Mapping[tuple[str, str], int],
    counts: Mapping[str, int],
    *,
    served: bool,
    why_not: str,
) -> MemoryLimitsView:
    return MemoryLimitsView(
        gpus=gpu_enforcement(support),
        limits=container_limits(leaves, used),
        actions=tuple(sorted(counts.items())),
        served=served,
        why_not=why_not,
    )
