"""The snapshot collector (docs/design.md §5, a contract): every metric family derived from the
latest `NodeSnapshot`, built afresh on each scrape, and the labels they carry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deviceplugin.model import (
    SOURCE_DRA,
    ContainerUsage,
    EnforcementCount,
    GpuInfo,
    NodeSnapshot,
    ProcessSample,
)
from deviceplugin.usage.memorymetrics import memory_limit_families
from deviceplugin.usage.mpsmetrics import container_mps_families, mps_families

# A MIG device is a GPU of its own (gpu_uuid is its MIG UUID, gpu_index its GPU's index); its
# series also name its parent GPU, profile and instance IDs, all "" on a full GPU's series.
MIG_LABELS = ("parent_gpu_uuid", "mig_profile", "gpu_instance_id", "compute_instance_id")
GPU_LABELS = ("node", "gpu_uuid", "gpu_index", *MIG_LABELS)
GPU_INFO_LABELS = (*GPU_LABELS, "model", "minor", "numa_node", "pci_bus_id")
SLICE_LABELS = (*GPU_LABELS, "state")
# DRA mode's device series: a GPU's labels and the device's name in the ResourceSlice.
DRA_DEVICE_LABELS = (*GPU_LABELS, "device")
XID_LABELS = (*GPU_LABELS, "xid")
# namespace/pod/container are "" until pod-resources has named the container; allocation_id
# identifies it from the moment it was allocated.
CONTAINER_LABELS = ("node", "namespace", "pod", "container", "gpu_uuid", "allocation_id")
ENFORCEMENT_LABELS = (*CONTAINER_LABELS, "kind", "action")
# One series per current allocation, whatever GPUs it spans: where it came from (device-plugin |
# dra) and, for a DRA claim, the claim's namespace/name ("" otherwise). Joins the container
# series on allocation_id.
ALLOCATION_LABELS = ("node", "namespace", "pod", "container", "allocation_id", "source", "claim")
NODE_LABELS = ("node",)
BUILD_LABELS = ("node", "version")
# Every (kind, action) the enforcer can count: each container's series exist at 0 from its first
# scrape, so that rate() and a dashboard panel see the first action as an increase.
ENFORCEMENT_ACTIONS = (
    ("memory", "kill"),
    ("memory", "reclaim"),
    ("memory", "monitor"),
    ("compute", "throttle"),
    ("compute", "monitor"),
)


def _ratio(value: float) -> float:
    """A ratio as exposed: within 0..1 (per-process SM figures can sum past 100 %)."""
    if math.isnan(value):
        return 0.0
    return min(max(value, 0.0), 1.0)


def _flag(value: bool) -> float:
    return 1.0 if value else 0.0


def _memory_of(processes: Iterable[ProcessSample]) -> int:
    return sum(p.used_memory_bytes for p in processes if p.used_memory_bytes is not None)


def gpu_label_values(node: str, info: GpuInfo) -> list[str]:
    """The values of GPU_LABELS for a GPU or MIG device."""
    return [
        node,
        info.uuid,
        str(info.index),
        info.parent_uuid,
        info.mig_profile,
        "" if info.gpu_instance_id is None else str(info.gpu_instance_id),
        "" if info.compute_instance_id is None else str(info.compute_instance_id),
    ]


def _container_labels(node: str, c: ContainerUsage | EnforcementCount) -> list[str]:
    return [node, c.namespace, c.pod, c.container, c.gpu_uuid, c.allocation_id]


def _gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: tuple[str, ...]) -> CounterMetricFamily:
    # CounterMetricFamily exposes `<name>_total`: `name` is given without the suffix.
    return CounterMetricFamily(name, doc, labels=labels)


class SnapshotCollector(Collector):
    """Builds every snapshot-derived family from one snapshot reference per scrape."""

    def __init__(
        self,
        node_name: str,
        get_snapshot: Callable[[], NodeSnapshot | None],
        *,
        version: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._node = node_name
        self._get_snapshot = get_snapshot
        self._version = version
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        # Names only, for the registry's duplicate check; no snapshot is read.
        return [self._build_info(), *self._families(None, 0.0), *dra_families(self._node, None)]

    def collect(self) -> Iterable[Metric]:
        snapshot = self._get_snapshot()  # one reference: every family sees the same poll
        yield self._build_info()
        if snapshot is not None:
            yield from self._families(snapshot, self._clock())
            if snapshot.kubelet_api == SOURCE_DRA:
                yield from dra_families(self._node, snapshot)

    def _build_info(self) -> Metric:
        build = _gauge("vgpu_build_info", "Build of the vgpu daemon; always 1.", BUILD_LABELS)
        build.add_metric([self._node, self._version], 1.0)
        return build

    def _families(self, snapshot: NodeSnapshot | None, now_s: float) -> Iterator[Metric]:
        node = self._node
        yield from _gpu_families(node, snapshot)
        yield from _gpu_use_families(node, snapshot)
        yield from _container_families(node, snapshot)
        yield from _enforcement_families(node, snapshot)
        yield _allocation_family(node, snapshot)
        yield from _daemon_families(node, snapshot, now_s)
        yield from mps_families(node, snapshot)
        yield from container_mps_families(node, snapshot)
        yield from memory_limit_families(node, snapshot, GPU_LABELS, gpu_label_values)


def _gpu_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """Per GPU (or MIG device): what it is, its health, and its memory and utilisation."""
    gpu_info = _gauge(
        "vgpu_gpu_info",
        "Static facts about a physical GPU as labels; always 1.",
        GPU_INFO_LABELS,
    )
    gpu_healthy = _gauge(
        "vgpu_gpu_healthy",
        "1 if the GPU is healthy, 0 if not (its slices are withdrawn).",
        GPU_LABELS,
    )
    gpu_mem_total = _gauge(
        "vgpu_gpu_memory_total_bytes", "Total memory of the GPU, in bytes.", GPU_LABELS
    )
    gpu_mem_used = _gauge(
        "vgpu_gpu_memory_used_bytes",
        "Memory in use on the GPU, in bytes, as the driver reports it.",
        GPU_LABELS,
    )
    gpu_util = _gauge(
        "vgpu_gpu_utilization_ratio",
        "Utilisation of the GPU, 0..1: the share of time a kernel was running on it (NVML's "
        "GPU utilisation), averaged over the compute window.",
        GPU_LABELS,
    )
    transitions = _counter(
        "vgpu_gpu_unhealthy_transitions",
        "Times the GPU went from healthy to unhealthy since the daemon started, a count.",
        GPU_LABELS,
    )
    xid_errors = _counter(
        "vgpu_gpu_xid_errors",
        "Xid errors the driver reported for the GPU since the daemon started, by Xid "
        "(critical and application-caused alike), a count.",
        XID_LABELS,
    )
    for gpu in snapshot.gpus if snapshot is not None else ():
        info = gpu.info
        g = gpu_label_values(node, info)
        numa = "" if info.numa_node is None else str(info.numa_node)
        gpu_info.add_metric([*g, info.name, str(info.minor), numa, info.pci_bus_id or ""], 1.0)
        gpu_healthy.add_metric(g, _flag(gpu.reading.healthy))
        transitions.add_metric(g, gpu.reading.unhealthy_transitions)
        for xid, count in gpu.reading.xid_errors:
            xid_errors.add_metric([*g, str(xid)], count)
        gpu_mem_total.add_metric(g, float(info.memory_total_bytes))
        if gpu.reading.memory_used_bytes is not None:
            gpu_mem_used.add_metric(g, float(gpu.reading.memory_used_bytes))
        if gpu.sm_utilization_ratio is not None:
            gpu_util.add_metric(g, _ratio(gpu.sm_utilization_ratio))
    return [
        gpu_info,
        gpu_healthy,
        transitions,
        xid_errors,
        gpu_mem_total,
        gpu_mem_used,
        gpu_util,
    ]


def _gpu_use_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """Per GPU: its slices by state (device-plugin mode: DRA mode has devices, not slices), and
    the processes that belong to no allocation or claimed one their pod does not hold."""
    slices = _gauge(
        "vgpu_slices",
        "Slices of the GPU by state (allocated, free, unhealthy), a count.",
        SLICE_LABELS,
    )
    unattributed = _gauge(
        "vgpu_gpu_unattributed_processes",
        "GPU processes that belong to no allocation of this daemon, a count; never acted on.",
        GPU_LABELS,
    )
    misattributed = _gauge(
        "vgpu_gpu_misattributed_processes",
        "GPU processes whose claimed allocation their pod does not hold (per the kubelet's "
        "checkpoint), a count; never charged to the allocation they claimed.",
        GPU_LABELS,
    )
    unattributed_mem = _gauge(
        "vgpu_gpu_unattributed_memory_bytes",
        "GPU memory used by processes that belong to no allocation of this daemon, in bytes.",
        GPU_LABELS,
    )
    if snapshot is not None:
        by_slices = snapshot.kubelet_api != SOURCE_DRA
        for gpu in snapshot.gpus:
            g = gpu_label_values(node, gpu.info)
            if by_slices:
                slices.add_metric([*g, "allocated"], float(gpu.slices_allocated))
                slices.add_metric([*g, "free"], float(max(gpu.slices_free, 0)))
                slices.add_metric([*g, "unhealthy"], float(gpu.slices_unhealthy))
                slices.add_metric([*g, "unconfirmed"], float(gpu.slices_unconfirmed))
            unattributed.add_metric(g, float(len(gpu.unattributed)))
            misattributed.add_metric(g, float(len(gpu.misattributed)))
            unattributed_mem.add_metric(g, float(_memory_of(gpu.unattributed)))
    return [slices, unattributed, misattributed, unattributed_mem]


def _container_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """Per container and GPU: its memory used and limit, utilisation, share and throttled time."""
    c_mem_used = _gauge(
        "vgpu_container_gpu_memory_used_bytes",
        "GPU memory used by the container's processes on the GPU, in bytes.",
        CONTAINER_LABELS,
    )
    c_mem_limit = _gauge(
        "vgpu_container_gpu_memory_limit_bytes",
        "The container's GPU memory limit on the GPU (its slices' share), in bytes.",
        CONTAINER_LABELS,
    )
    c_sm = _gauge(
        "vgpu_container_sm_utilization_ratio",
        "SM utilisation of the GPU by the container, 0..1, averaged over the compute window.",
        CONTAINER_LABELS,
    )
    c_share = _gauge(
        "vgpu_container_compute_share_ratio",
        "The container's compute share of the GPU (its slices' share), 0..1.",
        CONTAINER_LABELS,
    )
    c_throttled = _counter(
        "vgpu_container_throttled_seconds",
        "Time the container's processes on the GPU have spent stopped by the throttle, in seconds.",
        CONTAINER_LABELS,
    )
    if snapshot is not None:
        # NVML has no utilisation per MIG device: no series rather than a made-up 0.
        mig_devices = {g.info.uuid for g in snapshot.gpus if g.info.is_mig_device}
        for c in snapshot.containers:
            labels = _container_labels(node, c)
            c_mem_used.add_metric(labels, float(c.memory_used_bytes))
            c_mem_limit.add_metric(labels, float(c.memory_limit_bytes))
            if c.gpu_uuid not in mig_devices:
                c_sm.add_metric(labels, _ratio(c.sm_utilization_ratio))
            c_share.add_metric(labels, _ratio(c.compute_share_ratio))
            c_throttled.add_metric(labels, c.throttled_seconds_total)
    return [c_mem_used, c_mem_limit, c_sm, c_share, c_throttled]


def _enforcement_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """The enforcer's actions per container (each of ENFORCEMENT_ACTIONS from 0), and the
    signals it decided on but did not send."""
    enforcement = _counter(
        "vgpu_enforcement_actions",
        "Enforcement actions taken on the container, by kind (memory, compute) and action "
        "(kill, reclaim, throttle, monitor; in a dry run or monitor mode would_kill, "
        "would_reclaim, would_throttle), a count.",
        ENFORCEMENT_LABELS,
    )
    not_sent = _counter(
        "vgpu_enforcement_signals_not_sent",
        "Kills, stops and resumes the enforcer decided on but did not send, by reason: "
        "permission_denied (the daemon may not signal the process), moved (it left the "
        "cgroup it was attributed from), a count.",
        (*NODE_LABELS, "reason"),
    )
    if snapshot is not None:
        counted = {(e.allocation_id, e.gpu_uuid, e.kind, e.action) for e in snapshot.enforcement}
        for c in snapshot.containers:
            for kind, action in ENFORCEMENT_ACTIONS:
                if (c.allocation_id, c.gpu_uuid, kind, action) not in counted:
                    enforcement.add_metric([*_container_labels(node, c), kind, action], 0.0)
        for e in snapshot.enforcement:
            enforcement.add_metric([*_container_labels(node, e), e.kind, e.action], e.count)
        for reason, count in snapshot.signals_not_sent:
            not_sent.add_metric([node, reason], count)
    return [enforcement, not_sent]


def _allocation_family(node: str, snapshot: NodeSnapshot | None) -> Metric:
    """One series per allocation held, naming its source and DRA claim."""
    allocation_info = _gauge(
        "vgpu_allocation_info",
        "An allocation this daemon holds, with where it came from (device-plugin, dra) and "
        "its DRA claim (namespace/name, else empty) as labels; always 1.",
        ALLOCATION_LABELS,
    )
    for a in snapshot.allocations if snapshot is not None else ():
        allocation_info.add_metric(
            [node, a.namespace, a.pod, a.container, a.allocation_id, a.source, a.claim], 1.0
        )
    return allocation_info


def _daemon_families(node: str, snapshot: NodeSnapshot | None, now_s: float) -> list[Metric]:
    """The daemon's own health: its registration with the kubelet, pod-resources, and how
    fresh the figures are (`now_s`: the scrape's wall-clock time)."""
    registrations = _counter(
        "vgpu_kubelet_registrations",
        "Successful registrations of the plugin with the kubelet, a count.",
        NODE_LABELS,
    )
    registration_failures = _counter(
        "vgpu_kubelet_registration_failures",
        "Failed attempts to register the plugin with the kubelet, a count.",
        NODE_LABELS,
    )
    registered = _gauge(
        "vgpu_kubelet_registered",
        "1 while the plugin is registered with the kubelet, else 0.",
        NODE_LABELS,
    )
    pod_resources_up = _gauge(
        "vgpu_pod_resources_up",
        "1 if the kubelet's pod-resources API answered the last query, else 0.",
        NODE_LABELS,
    )
    stale = _gauge(
        "vgpu_snapshot_stale",
        "1 if the latest poll failed and the figures are from an earlier one, else 0.",
        NODE_LABELS,
    )
    last_poll = _gauge(
        "vgpu_last_successful_poll_timestamp_seconds",
        "Unix time of the last successful GPU poll, in seconds; 0 if none yet.",
        NODE_LABELS,
    )
    age = _gauge(
        "vgpu_snapshot_age_seconds",
        "Age of the figures this scrape exposes at scrape time, in seconds.",
        NODE_LABELS,
    )
    if snapshot is not None:
        health = snapshot.health
        n = [node]
        registrations.add_metric(n, health.registrations_total)
        registration_failures.add_metric(n, health.registration_failures_total)
        registered.add_metric(n, _flag(health.registered))
        pod_resources_up.add_metric(n, _flag(health.pod_resources_ok))
        stale.add_metric(n, _flag(snapshot.stale))
        last_poll.add_metric(n, health.last_poll_success_s)
        age.add_metric(n, max(now_s - snapshot.taken_at_s, 0.0))
    return [
        registrations,
        registration_failures,
        registered,
        pod_resources_up,
        stale,
        last_poll,
        age,
    ]


def dra_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """DRA mode's device series (docs/design.md §5): per device the node's ResourceSlice
    publishes, what the prepared claims consumed and what is left. Names only without a
    snapshot."""
    memory_claimed = _gauge(
        "vgpu_dra_device_memory_claimed_bytes",
        "DRA mode: memory of the device that the claims prepared on it consumed, in bytes.",
        DRA_DEVICE_LABELS,
    )
    memory_free = _gauge(
        "vgpu_dra_device_memory_free_bytes",
        "DRA mode: memory of the device no prepared claim consumed, in bytes.",
        DRA_DEVICE_LABELS,
    )
    compute_claimed = _gauge(
        "vgpu_dra_device_compute_claimed_ratio",
        "DRA mode: compute of the device that the claims prepared on it consumed, 0..1.",
        DRA_DEVICE_LABELS,
    )
    compute_free = _gauge(
        "vgpu_dra_device_compute_free_ratio",
        "DRA mode: compute of the device no prepared claim consumed, 0..1.",
        DRA_DEVICE_LABELS,
    )
    claims = _gauge(
        "vgpu_dra_device_claims",
        "DRA mode: claims prepared on the device, a count.",
        DRA_DEVICE_LABELS,
    )
    full = _gauge(
        "vgpu_dra_device_full",
        "DRA mode: 1 when no claim fits on the device any more (less memory or compute is "
        "left than the request policy's minimum), else 0.",
        DRA_DEVICE_LABELS,
    )
    for gpu in snapshot.gpus if snapshot is not None else ():
        device = gpu.dra
        if device is None:
            continue
        labels = [*gpu_label_values(node, gpu.info), device.name]
        memory_claimed.add_metric(labels, float(device.memory_claimed_bytes))
        memory_free.add_metric(labels, float(device.memory_free_bytes))
        compute_claimed.add_metric(labels, _ratio(device.compute_claimed_ratio))
        compute_free.add_metric(labels, _ratio(device.compute_free_ratio))
        claims.add_metric(labels, float(device.claims))
        full.add_metric(labels, _flag(device.full))
    return [memory_claimed, memory_free, compute_claimed, compute_free, claims, full]
