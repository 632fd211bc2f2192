"""The MPS families of /metrics (docs/design.md §5, a contract), from the snapshot's MPS status;
series only with mps.enabled.

The control daemon: `vgpu_mps_daemon_up`, `vgpu_mps_daemon_restarts_total` (a wedge's restart
included), `vgpu_mps_drift_total{change}`, `vgpu_mps_protocol` (2 or 3); its drains:
`vgpu_mps_drains_total` (clients terminated through it before a stop),
`vgpu_mps_undrained_stops_total` (stopped without: it did not answer),
`vgpu_mps_wedges_total` (drains past their bound and canaries that hung, each followed by a
restart), `vgpu_mps_canary_failing` (1 while the canary fails without hanging: it cannot tell a
wedge then), `vgpu_mps_root_clients` (clients running as root); under MPS v3
`vgpu_mps_namespaces` and, per container and GPU (container labels),
`vgpu_container_mps_active_thread_ratio` and `vgpu_container_mps_pinned_memory_limit_bytes`:
its namespace's caps.
"""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from deviceplugin.allocation import MIB
from deviceplugin.model import NodeSnapshot

NODE_LABELS = ("node",)
CONTAINER_LABELS = ("node", "namespace", "pod", "container", "gpu_uuid", "allocation_id")


def _gauge(name: str, doc: str, labels: tuple[str, ...] = NODE_LABELS) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: tuple[str, ...] = NODE_LABELS) -> CounterMetricFamily:
    # CounterMetricFamily exposes `<name>_total`: `name` is given without the suffix.
    return CounterMetricFamily(name, doc, labels=labels)


def mps_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """The node's MPS control daemon, its drains and wedges."""
    up = _gauge(
        "vgpu_mps_daemon_up",
        "1 while the node's MPS control daemon runs, else 0; only with mps.enabled.",
    )
    restarts = _counter(
        "vgpu_mps_daemon_restarts",
        "Times the MPS control daemon was found dead (or wedged) and started again, a count.",
    )
    drift = _counter(
        "vgpu_mps_drift",
        "Changes made through the MPS control socket by others (a default raised, a quit, a "
        "namespace deleted), each undone by the daemon, a count; by change.",
        (*NODE_LABELS, "change"),
    )
    protocol = _gauge("vgpu_mps_protocol", "The MPS protocol the control daemon runs: 2 or 3.")
    drains = _counter(
        "vgpu_mps_drains",
        "MPS clients terminated through the control daemon before they were stopped, a count.",
    )
    undrained = _counter(
        "vgpu_mps_undrained_stops",
        "MPS clients stopped without a drain (the control daemon did not answer), a count.",
    )
    wedges = _counter(
        "vgpu_mps_wedges",
        "Wedged GPUs found (a drain past its bound, a canary that hung), each followed by a "
        "restart of MPS, a count.",
    )
    canary = _gauge(
        "vgpu_mps_canary_failing",
        "1 while the MPS canary fails without hanging (it cannot tell a wedge then), else 0.",
    )
    roots = _gauge(
        "vgpu_mps_root_clients",
        "MPS clients running as root: each can raise its own caps or delete another "
        "container's MPS namespace.",
    )
    held = _gauge("vgpu_mps_namespaces", "MPS v3 namespaces held for containers or claims.")
    mps = snapshot.health.mps if snapshot is not None else None
    if mps is not None:
        up.add_metric([node], 1.0 if mps.up else 0.0)
        restarts.add_metric([node], mps.restarts_total)
        for change, count in mps.drift_total:
            drift.add_metric([node, change], count)
        protocol.add_metric([node], mps.protocol)
        drains.add_metric([node], mps.drains_total)
        undrained.add_metric([node], mps.undrained_total)
        wedges.add_metric([node], mps.wedges_total)
        canary.add_metric([node], 1.0 if mps.canary_error else 0.0)
        roots.add_metric([node], len(mps.root_clients))
        held.add_metric([node], len(mps.namespaces))
    return [up, restarts, drift, protocol, drains, undrained, wedges, canary, roots, held]


def container_mps_families(node: str, snapshot: NodeSnapshot | None) -> list[Metric]:
    """Per container and GPU, its MPS v3 namespace's caps."""
    threads = _gauge(
        "vgpu_container_mps_active_thread_ratio",
        "The share of the GPU's threads the container's MPS namespace allows, 0..1.",
        CONTAINER_LABELS,
    )
    pinned = _gauge(
        "vgpu_container_mps_pinned_memory_limit_bytes",
        "The pinned GPU memory the container's MPS namespace allows on the GPU, in bytes.",
        CONTAINER_LABELS,
    )
    mps = snapshot.health.mps if snapshot is not None else None
    if snapshot is not None and mps is not None and mps.namespaces:
        by_owner = {ns.owner: ns for ns in mps.namespaces}
        for c in snapshot.containers:
            ns = by_owner.get(c.allocation_id)
            if ns is None:
                continue
            labels = [node, c.namespace, c.pod, c.container, c.gpu_uuid, c.allocation_id]
            threads.add_metric(labels, ns.active_thread_percentage / 100)
            pinned.add_metric(labels, float(ns.pinned_memory_mib * MIB))
    return [threads, pinned]
