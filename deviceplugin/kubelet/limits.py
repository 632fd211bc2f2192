"""The kubelet's limit on the device list: a ListAndWatch response is one gRPC message, and the
kubelet's client refuses a message over 4 MiB. A device list that large makes every
ListAndWatch fail and the plugin re-register in a loop, so a slicing plan whose device list
would not fit is refused up front, by `check-config` and `serve` alike, from the plan alone
(before a single slice is built)."""

from __future__ import annotations

from collections.abc import Iterable

from deviceplugin.config import MAX_REPLICAS, SlicingConfig
from deviceplugin.errors import BackendError
from deviceplugin.kubelet.proto import UNHEALTHY, dp
from deviceplugin.model import GpuPlan

# The kubelet's gRPC client keeps grpc-go's default receive limit.
KUBELET_MAX_MESSAGE_BYTES = 4 << 20
# Room kept under the limit (gRPC framing, longer IDs after a GPU change).
_MARGIN_BYTES = 64 << 10


class DeviceListTooLargeError(BackendError):
    """The slicing plan's device list would not fit in one kubelet message. A BackendError, so
    that it stops a start (exit 2) and later only fails the poll, keeping the last device list."""


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def device_list_bytes(plans: Iterable[GpuPlan]) -> int:
    """An upper bound of the size of the ListAndWatch response for these plans: each device
    is counted with its GPU's longest ID, the longer health value and its topology."""
    total = 0
    for plan in plans:
        if not plan.sliced:
            continue
        topology = (
            dp.TopologyInfo(nodes=[dp.NUMANode(ID=plan.gpu.numa_node)])
            if plan.gpu.numa_node is not None
            else None
        )
        device = dp.Device(
            ID=f"{plan.gpu.uuid}::{plan.replicas - 1}", health=UNHEALTHY, topology=topology
        )
        size = device.ByteSize()
        total += plan.replicas * (1 + _varint_len(size) + size)
    return total


def _keys(slicing: SlicingConfig) -> str:
    key = (
        "slicing.memoryPerSlice"
        if slicing.default.memory_per_slice_bytes is not None
        else "slicing.replicas"
    )
    return f"{key} (or slicing.overrides)" if slicing.overrides else key


def device_list_problem(plans: Iterable[GpuPlan], slicing: SlicingConfig) -> str | None:
    """Why this plan's device list cannot reach the kubelet, naming the config key and the
    bound; None when it fits."""
    plans = tuple(plans)
    for plan in plans:
        if plan.sliced and plan.replicas > MAX_REPLICAS:
            return (
                f"{_keys(slicing)}: GPU {plan.gpu.index} ({plan.gpu.name}) would get "
                f"{plan.replicas} slices, more than {MAX_REPLICAS} per GPU: use larger slices"
            )
    # Each resource has a device list (a ListAndWatch stream) of its own.
    by_resource: dict[str, list[GpuPlan]] = {}
    for plan in plans:
        by_resource.setdefault(plan.resource_name, []).append(plan)
    limit = KUBELET_MAX_MESSAGE_BYTES - _MARGIN_BYTES
    for resource, resource_plans in sorted(by_resource.items()):
        size = device_list_bytes(resource_plans)
        if size <= limit:
            continue
        slices = sum(p.replicas for p in resource_plans if p.sliced)
        fitting = slices * limit // size
        return (
            f"{_keys(slicing)}: {slices} slices of {resource} make a device list of about "
            f"{size} bytes, over the kubelet's {KUBELET_MAX_MESSAGE_BYTES}-byte gRPC message "
            f"limit (less a {_MARGIN_BYTES}-byte margin); at most about {fitting} slices fit "
            "on this node: use fewer, larger slices"
        )
    return None
