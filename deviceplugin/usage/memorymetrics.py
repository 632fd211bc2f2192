"""The metric families of the memory limits the driver enforces (docs/design.md §5, §15), from
the snapshot's `memory_limits` view: per GPU how its memory is enforced, per container and GPU
its request, who holds it to its limit, since when and what the driver counts as its use, and
the count of each action on a limit."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from deviceplugin.memlimits.book import ACTIONS
from deviceplugin.model import GpuInfo, NodeSnapshot
from deviceplugin.usage.memorydoc import container_memory_fields

CONTAINER_LABELS = ("node", "namespace", "pod", "container", "gpu_uuid", "allocation_id")


def memory_limit_families(
    node: str,
    snapshot: NodeSnapshot | None,
    gpu_labels: tuple[str, ...],
    gpu_values: Callable[[str, GpuInfo], list[str]],
) -> list[Metric]:
    """Names only without a snapshot; a GPU's series carry `gpu_labels` (`gpu_values`)."""
    enforcement = GaugeMetricFamily(
        "vgpu_gpu_memory_enforcement",
        "How the GPU's memory is enforced: 1 on the series of its mode (driver-dmem, "
        "driver-misc: its driver holds each container to its limit; poll: the poller does), "
        "with the cause of a poll.",
        labels=(*gpu_labels, "mode", "cause"),
    )
    request = GaugeMetricFamily(
        "vgpu_container_gpu_memory_request_bytes",
        "GPU memory the container is guaranteed on the GPU (its request; at most its limit), "
        "in bytes.",
        labels=CONTAINER_LABELS,
    )
    enforced_by = GaugeMetricFamily(
        "vgpu_container_gpu_memory_enforced_by",
        "1 on the series of who holds the container to its memory limit on the GPU: the "
        "driver (driver-dmem, driver-misc) once its runtime hook set the limit on its cgroup, "
        "else poll.",
        labels=(*CONTAINER_LABELS, "by"),
    )
    set_at = GaugeMetricFamily(
        "vgpu_container_gpu_memory_limit_set_timestamp_seconds",
        "When the driver was given the container's memory limit on the GPU, in seconds since "
        "the Unix epoch; absent while its memory is polled.",
        labels=CONTAINER_LABELS,
    )
    driver_used = GaugeMetricFamily(
        "vgpu_container_gpu_memory_driver_used_bytes",
        "GPU memory the driver charges to the container's cgroup on the GPU, in bytes; "
        "absent while its memory is polled.",
        labels=CONTAINER_LABELS,
    )
    actions = CounterMetricFamily(
        "vgpu_memory_limit_actions",
        "Actions on containers' GPU memory limits, by action: set, cleared, kept, repaired, "
        "refused, failed; a count.",
        labels=("node", "action"),
    )
    served = GaugeMetricFamily(
        "vgpu_memory_limit_hook_served",
        "1 while the runtime hook's socket is served (a GPU's driver partitions memory), else 0.",
        labels=("node",),
    )
    if snapshot is not None:
        view = snapshot.memory_limits
        for gpu in snapshot.gpus:
            found = view.gpu(gpu.info.uuid)
            enforcement.add_metric([*gpu_values(node, gpu.info), found.mode, found.cause], 1.0)
        for c in snapshot.containers:
            labels = [node, c.namespace, c.pod, c.container, c.gpu_uuid, c.allocation_id]
            fields = container_memory_fields(view, c)
            request.add_metric(labels, float(fields["memory_request_bytes"]))
            enforced_by.add_metric([*labels, fields["memory_enforced_by"]], 1.0)
            limits = view.of_allocation(c.allocation_id, c.gpu_uuid)
            if fields["memory_limit_set_at"] is not None:
                set_at.add_metric(labels, max(limit.set_at_s or 0.0 for limit in limits))
            if fields["memory_driver_used_bytes"] is not None:
                driver_used.add_metric(labels, float(fields["memory_driver_used_bytes"]))
        counts = dict(view.actions)
        for action in ACTIONS:
            actions.add_metric([node, action], float(counts.get(action, 0)))
        served.add_metric([node], 1.0 if view.served else 0.0)
    return [enforcement, request, enforced_by, set_at, driver_used, actions, served]
