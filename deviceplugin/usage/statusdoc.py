"""The /status document (docs/design.md §5). Pure: no I/O.

`snapshot_to_json` turns a `NodeSnapshot` into plain JSON data; `statusview` draws that data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from deviceplugin.limitsview import MemoryLimitsView
from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    DraDevice,
    EnforcementCount,
    GpuUsage,
    MpsStatus,
    NodeSnapshot,
    ProcessSample,
)
from deviceplugin.usage.memorydoc import (
    container_memory_fields,
    gpu_memory_fields,
    memory_limits_section,
)
from deviceplugin.usage.mpsstatus import container_mps, mps_health


def rfc3339(epoch_s: float) -> str:
    """Wall-clock seconds as RFC 3339 UTC, to the second ("2024-05-01T12:00:00Z")."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _num(value: float | None) -> float | None:
    """A float JSON can carry: NaN and infinities become null."""
    if value is None or not math.isfinite(value):
        return None
    return value


def _process(p: ProcessSample) -> dict[str, Any]:
    return {
        "pid": p.pid,
        "used_memory_bytes": p.used_memory_bytes,
        "sm_util_percent": _num(p.sm_util_percent),
    }


def _health(h: DaemonHealth, taken_at_s: float) -> dict[str, Any]:
    unregistered = h.unregistered_since_wall_s > 0 and not h.registered
    return {
        "registered": h.registered,
        # Seconds since the plugin was last registered, when the snapshot was taken; 0 while it is.
        "unregistered_since_s": (
            round(max(0.0, taken_at_s - h.unregistered_since_wall_s), 3) if unregistered else 0.0
        ),
        "unregistered_since": rfc3339(h.unregistered_since_wall_s) if unregistered else None,
        "registrations_total": h.registrations_total,
        "registration_failures_total": h.registration_failures_total,
        "last_poll_success": rfc3339(h.last_poll_success_s) if h.last_poll_success_s > 0 else None,
        "last_poll_success_s": h.last_poll_success_s,
        "poll_failures_consecutive": h.poll_failures_consecutive,
        "poll_interval_s": h.poll_interval_s,
        "polling_idle": h.polling_idle,
        "pod_resources_ok": h.pod_resources_ok,
        "mps": mps_health(h.mps),
    }


def _claims_on(allocations: Iterable[AllocationRecord]) -> dict[str, list[dict[str, Any]]]:
    """Per GPU UUID, the claims (allocations) holding it and what each was granted there."""
    on: dict[str, list[dict[str, Any]]] = {}
    for a in allocations:
        for g in a.grants:
            on.setdefault(g.gpu_uuid, []).append(
                {
                    "claim": a.claim,
                    "allocation_id": a.allocation_id,
                    "namespace": a.namespace,
                    "pod": a.pod,
                    "container": a.container,
                    "memory_bytes": g.request_bytes,
                    "memory_limit_bytes": g.memory_limit_bytes,
                    "compute_ratio": _num(g.compute_share_ratio),
                }
            )
    return on


def _dra(device: DraDevice | None, claims: list[dict[str, Any]]) -> dict[str, Any] | None:
    """DRA mode: what the device the driver publishes has given out and has left."""
    if device is None:
        return None
    return {
        "device": device.name,
        "memory_claimed_bytes": device.memory_claimed_bytes,
        "memory_free_bytes": device.memory_free_bytes,
        "compute_claimed_ratio": _num(device.compute_claimed_ratio),
        "compute_free_ratio": _num(device.compute_free_ratio),
        "full": device.full,
        "claims": claims,
    }


def _gpu(
    g: GpuUsage,
    dra_mode: bool = False,
    claims: list[dict[str, Any]] | None = None,
    memory: MemoryLimitsView | None = None,
) -> dict[str, Any]:
    info = g.info
    pods = dict(g.unattributed_pods)
    return {
        "uuid": info.uuid,
        "index": info.index,
        "model": info.name,
        "minor": info.minor,
        "numa_node": info.numa_node,
        "pci_bus_id": info.pci_bus_id,
        "mig_enabled": info.mig_enabled,
        # A MIG device: its parent GPU, profile and instance IDs (null for a full GPU). NVML
        # measures no utilisation per MIG device, so its compute share is not enforced.
        "parent_gpu_uuid": info.parent_uuid or None,
        "mig_profile": info.mig_profile or None,
        "gpu_instance_id": info.gpu_instance_id,
        "compute_instance_id": info.compute_instance_id,
        "compute_enforced": not info.is_mig_device,
        "healthy": g.reading.healthy,
        "health_reason": g.reading.health_reason,
        "misattributed_processes": len(g.misattributed),
        "unhealthy_transitions": g.reading.unhealthy_transitions,
        "xid_errors": {str(xid): count for xid, count in g.reading.xid_errors},
        "memory_total_bytes": info.memory_total_bytes,
        "memory_used_bytes": g.reading.memory_used_bytes,
        # How its memory is enforced: by its driver (driver-dmem|driver-misc) or poll, and why.
        **gpu_memory_fields(memory or MemoryLimitsView(), info.uuid),
        "sm_utilization_ratio": _num(g.sm_utilization_ratio),
        # Device-plugin mode: its slices by state; null in DRA mode, which has no slices.
        "slices": None
        if dra_mode
        else {
            "total": g.slices_total,
            "allocated": g.slices_allocated,
            "free": g.slices_free,
            "unhealthy": g.slices_unhealthy,
            "unconfirmed": g.slices_unconfirmed,
        },
        # DRA mode: its device's claimed and free memory and compute, and the claims on it;
        # null in device-plugin mode and for a GPU the driver publishes no device of.
        "dra": _dra(g.dra, claims or []) if dra_mode else None,
        "unattributed": [_unattributed(p, pods) for p in g.unattributed],
    }


def _unattributed(p: ProcessSample, pods: dict[int, str]) -> dict[str, Any]:
    """An unattributed process, with the UID of the pod it runs in when it runs in one."""
    shown = _process(p)
    if p.pid in pods:
        shown["pod_uid"] = pods[p.pid]
    return shown


def _container(
    c: ContainerUsage,
    mig_devices: frozenset[str] = frozenset(),
    mps: MpsStatus | None = None,
    memory: MemoryLimitsView | None = None,
) -> dict[str, Any]:
    on_mig = c.gpu_uuid in mig_devices
    return {
        "allocation_id": c.allocation_id,
        "namespace": c.namespace,
        "pod": c.pod,
        "container": c.container,
        "gpu_uuid": c.gpu_uuid,
        "gpu_index": c.gpu_index,
        "slices": c.slices,
        "memory_used_bytes": c.memory_used_bytes,
        "memory_limit_bytes": c.memory_limit_bytes,
        # Its request, who holds it to its limit and since when, the driver's count of its use.
        **container_memory_fields(memory or MemoryLimitsView(), c),
        # None on a MIG device: NVML has no utilisation there, and none is made up.
        "sm_utilization_ratio": None if on_mig else _num(c.sm_utilization_ratio),
        "compute_share_ratio": _num(c.compute_share_ratio),
        "entitlement_ratio": _num(c.entitlement_ratio),
        "compute_enforced": not on_mig,
        "throttled": c.duty_cycle_ratio is not None,
        "duty_cycle_ratio": _num(c.duty_cycle_ratio),
        "throttled_seconds_total": _num(c.throttled_seconds_total),
        "processes": [_process(p) for p in c.processes],
        # Its MPS v3 namespace and caps (null without one).
        "mps": container_mps(c.allocation_id, (p.pid for p in c.processes), mps),
    }


def _allocation(a: AllocationRecord) -> dict[str, Any]:
    return {
        "allocation_id": a.allocation_id,
        "namespace": a.namespace,
        "pod": a.pod,
        "container": a.container,
        "slice_ids": list(a.slice_ids),
        # What it may use per GPU, fixed when it was made (its environment's figures; a DRA
        # claim's consumed capacity): never changed by a reload.
        "grants": [
            {
                "gpu_uuid": g.gpu_uuid,
                "memory_limit_bytes": g.memory_limit_bytes,
                "memory_request_bytes": g.request_bytes,
                "compute_share_ratio": _num(g.compute_share_ratio),
                "slices": g.slices,
            }
            for g in a.grants
        ],
        # The resource it was made under; `retired`: a name this node no longer serves (renamed
        # by a reload), held until the kubelet frees it.
        "resource_name": a.resource_name or None,
        "retired": a.retired_resource,
        # A finished init container's, whose devices the pod still holds.
        "init_container": a.init_container,
        # Where it came from (device-plugin | dra) and, for a DRA claim, its namespace/name.
        "source": a.source,
        "claim": a.claim,
        "allocated_at": rfc3339(a.allocated_at_s) if a.allocated_at_s > 0 else None,
        "allocated_at_s": a.allocated_at_s,
    }


def _enforcement(e: EnforcementCount) -> dict[str, Any]:
    return {
        "allocation_id": e.allocation_id,
        "namespace": e.namespace,
        "pod": e.pod,
        "container": e.container,
        "gpu_uuid": e.gpu_uuid,
        "kind": e.kind,
        "action": e.action,
        "count": e.count,
    }


def snapshot_to_json(snapshot: NodeSnapshot) -> dict[str, Any]:
    """The /status document: plain JSON data with a fixed key order."""
    mig_devices = frozenset(g.info.uuid for g in snapshot.gpus if g.info.is_mig_device)
    dra_mode = snapshot.kubelet_api == SOURCE_DRA
    claims = _claims_on(snapshot.allocations) if dra_mode else {}
    return {
        "node": snapshot.node_name,
        # How the kubelet is served: device-plugin (slices) or dra (devices and claims).
        "kubelet_api": snapshot.kubelet_api,
        "taken_at": rfc3339(snapshot.taken_at_s),
        "taken_at_s": snapshot.taken_at_s,
        "stale": snapshot.stale,
        "health": _health(snapshot.health, snapshot.taken_at_s),
        "gpus": [
            _gpu(g, dra_mode, claims.get(g.info.uuid), snapshot.memory_limits)
            for g in snapshot.gpus
        ],
        "containers": [
            _container(c, mig_devices, snapshot.health.mps, snapshot.memory_limits)
            for c in snapshot.containers
        ],
        "allocations": [_allocation(a) for a in snapshot.allocations],
        "enforcement": [_enforcement(e) for e in snapshot.enforcement],
        # The memory limits the driver enforces (docs/design.md §15).
        "memory_limits": memory_limits_section(snapshot.memory_limits),
    }
