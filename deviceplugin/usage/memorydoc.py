"""The memory limits the driver enforces, in the /status document (docs/design.md §5, §15).
Pure: no I/O.

Per GPU, how its memory is enforced (`memory_enforcement`: driver-dmem, driver-misc or poll,
with the cause and reason of a poll); per container and GPU, its request, who enforces its limit
(`memory_enforced_by`: the driver's mode once its hook set the limit on its cgroup, else poll),
since when (`memory_limit_set_at`, RFC 3339 to the microsecond) and what the driver counts as its
use; and the node's `memory_limits`: whether the hook is served, every limited cgroup, the count
of each action.
"""

from __future__ import annotations

from typing import Any

from deviceplugin.limitsview import ContainerMemoryLimit, MemoryLimitsView
from deviceplugin.model import ContainerUsage
from deviceplugin.partitions import rfc3339

POLL = "poll"


def gpu_memory_fields(view: MemoryLimitsView, uuid: str) -> dict[str, Any]:
    enforcement = view.gpu(uuid)
    return {
        "memory_enforcement": enforcement.mode,
        "memory_enforcement_cause": enforcement.cause or None,
        "memory_enforcement_reason": enforcement.reason or None,
    }


def enforced_by(limits: tuple[ContainerMemoryLimit, ...]) -> str:
    """The driver's mode when every cgroup of the container holding it has its limit set,
    else poll (no hook ran, or a set is in flight)."""
    if not limits or any(limit.set_at_s is None for limit in limits):
        return POLL
    modes = {limit.mode for limit in limits}
    return modes.pop() if len(modes) == 1 else POLL


def container_memory_fields(view: MemoryLimitsView, c: ContainerUsage) -> dict[str, Any]:
    limits = view.of_allocation(c.allocation_id, c.gpu_uuid)
    by = enforced_by(limits)
    set_at = max((limit.set_at_s or 0.0 for limit in limits), default=0.0) if by != POLL else 0.0
    used = [limit.driver_used_bytes for limit in limits if limit.driver_used_bytes is not None]
    return {
        "memory_request_bytes": (
            c.memory_limit_bytes if c.memory_request_bytes is None else c.memory_request_bytes
        ),
        "memory_enforced_by": by,
        "memory_limit_set_at": rfc3339(set_at) if set_at > 0 else None,
        "memory_driver_used_bytes": sum(used) if used and by != POLL else None,
    }


def _limit(limit: ContainerMemoryLimit) -> dict[str, Any]:
    return {
        "cgroup": limit.cgroup,
        "pod_uid": limit.pod_uid,
        "container_id": limit.container_id,
        "gpu_uuid": limit.gpu_uuid,
        "allocation_ids": list(limit.grants),
        "mode": limit.mode,
        "soft_bytes": limit.soft_bytes,
        "hard_bytes": limit.hard_bytes,
        "set_at": rfc3339(limit.set_at_s) if limit.set_at_s is not None else None,
        "set_at_s": limit.set_at_s,
        "driver_used_bytes": limit.driver_used_bytes,
    }


def memory_limits_section(view: MemoryLimitsView) -> dict[str, Any]:
    return {
        "served": view.served,
        "why_not": view.why_not or None,
        "actions": dict(view.actions),
        "limits": [_limit(limit) for limit in view.limits],
    }
