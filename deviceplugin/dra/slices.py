"""The node's ResourceSlice (docs/design.md, "DRA driver"): pure, inventory in, API object out.

One device per GPU the plan slices, and one per MIG device when the MIG strategy is not `none`
(the same plans the device-plugin mode advertises slices of). Each device:

- name `gpu-<index>`, or `gpu-<index>-mig-<gi>-<ci>` for a MIG device;
- attributes `uuid`, `index`, `productName`, `type` (`gpu` | `mig`), and for a MIG device
  `migProfile` and `parentUUID`;
- consumable capacities `memory` (bytes) and `compute` (100 = the whole device), with
  `allowMultipleAllocations: true` so that many claims share it, each consuming an amount. A
  request policy (the config's `dra` section, KEP-5075) bounds what a claim may ask, at least a
  minimum in steps (the scheduler rounds a request up to the next step), and says what it gets
  when it names nothing: one device-plugin slice's worth of memory and compute. The scheduler
  records what it granted in the claim's `consumedCapacity`, and the enforcer holds the claim to
  exactly that, so the two never disagree;
- a taint when unhealthy: `vgpu.dev/unhealthy` (NoSchedule) keeps new claims off it, and
  `vgpu.dev/lost` (NoExecute) for a GPU that has fallen off the bus evicts the pods using it.

The pool is the node's name and holds one slice; its generation is raised whenever the devices
change (`publish` in `driver`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deviceplugin.config import DraConfig
from deviceplugin.dra.validation import slice_errors
from deviceplugin.model import GpuPlan, Inventory, dra_device_name
from deviceplugin.slicing import format_bytes

API_VERSION = "resource.k8s.io/v1"
MANAGED_BY = {"app.kubernetes.io/managed-by": "vgpu"}
TAINT_UNHEALTHY = "unhealthy"
TAINT_LOST = "lost"
# NVML's and the fake backend's words for a GPU that is gone, not merely failing (Xid 79).
_LOST_WORDS = ("fallen off the bus", "lost", "gone")


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One device's health as the poll last saw it; `reason` is the backend's words."""

    healthy: bool = True
    reason: str = ""

    @property
    def lost(self) -> bool:
        reason = self.reason.lower()
        return not self.healthy and any(word in reason for word in _LOST_WORDS)


def device_name(plan: GpuPlan) -> str:
    """`gpu-<index>`, or `gpu-<index>-mig-<gi>-<ci>` for a MIG device."""
    return dra_device_name(plan.gpu)


def slice_name(node_name: str, driver_name: str) -> str:
    """The node's one slice: a DNS subdomain made of the node's and the driver's names."""
    raw = f"{node_name}-{driver_name}".lower()
    return re.sub(r"[^a-z0-9.-]", "-", raw).strip("-.")[:253]


def _round_down(value: int, minimum: int, step: int) -> int:
    """`value` on the grid minimum + k*step, rounded down, never below the minimum."""
    if value <= minimum:
        return minimum
    return minimum + (value - minimum) // step * step


def device_plans(inventory: Inventory) -> list[GpuPlan]:
    """The plans that become devices: every sliced GPU and MIG device, by index, then UUID."""
    plans = [p for p in inventory.plans if p.sliced]
    return sorted(plans, key=lambda p: (p.gpu.index, p.gpu.parent_uuid != "", p.gpu.uuid))


def build_device(
    plan: GpuPlan, policy: DraConfig, health: DeviceHealth, driver_name: str
) -> dict[str, Any]:
    gpu = plan.gpu
    attributes: dict[str, dict[str, Any]] = {
        "uuid": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "productName": {"string": gpu.name},
        "type": {"string": "mig" if gpu.parent_uuid else "gpu"},
    }
    if gpu.parent_uuid:
        attributes["migProfile"] = {"string": gpu.mig_profile}
        attributes["parentUUID"] = {"string": gpu.parent_uuid}
    # The range's max is on the step grid (min + k * step), as the API server demands: the
    # largest such amount the device holds. What lies above it, less than one step, is never
    # granted (151Mi of an H100 80GB's 81559Mi with the default 256Mi steps).
    memory_max = _round_down(
        gpu.memory_total_bytes, policy.memory_min_bytes, policy.memory_step_bytes
    )
    one_slice_memory = plan.memory_per_slice_bytes
    if policy.memory_default_bytes is not None:
        one_slice_memory = policy.memory_default_bytes
    memory_default = min(
        memory_max,
        _round_down(one_slice_memory, policy.memory_min_bytes, policy.memory_step_bytes),
    )
    compute_max = _round_down(100, policy.compute_min, policy.compute_step)
    one_slice_compute = int(round(plan.compute_share_ratio * 100, 6))
    if policy.compute_default is not None:
        one_slice_compute = policy.compute_default
    compute_default = min(
        compute_max, _round_down(one_slice_compute, policy.compute_min, policy.compute_step)
    )
    device: dict[str, Any] = {
        "name": device_name(plan),
        "attributes": attributes,
        "capacity": {
            "memory": {
                "value": str(gpu.memory_total_bytes),
                "requestPolicy": {
                    "default": str(memory_default),
                    "validRange": {
                        "min": str(policy.memory_min_bytes),
                        "max": str(memory_max),
                        "step": str(policy.memory_step_bytes),
                    },
                },
            },
            "compute": {
                "value": "100",
                "requestPolicy": {
                    "default": str(compute_default),
                    "validRange": {
                        "min": str(policy.compute_min),
                        "max": str(compute_max),
                        "step": str(policy.compute_step),
                    },
                },
            },
        },
        "allowMultipleAllocations": True,
    }
    if not health.healthy:
        lost = health.lost
        device["taints"] = [
            {
                "key": f"{driver_name}/{TAINT_LOST if lost else TAINT_UNHEALTHY}",
                "effect": "NoExecute" if lost else "NoSchedule",
            }
        ]
    return device


def inventory_health(inventory: Inventory, reasons: Mapping[str, str]) -> dict[str, DeviceHealth]:
    """Each device's health: healthy while any of its slices is; `reasons` by UUID."""
    healthy: dict[str, bool] = {}
    for s in inventory.slices:
        healthy[s.id.gpu_uuid] = healthy.get(s.id.gpu_uuid, False) or s.healthy
    return {
        uuid: DeviceHealth(ok, "" if ok else reasons.get(uuid, "unhealthy"))
        for uuid, ok in healthy.items()
    }


def build_devices(
    inventory: Inventory,
    policy: DraConfig,
    driver_name: str,
    reasons: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The devices of the node's slice, from the plan the poll built."""
    health = inventory_health(inventory, reasons or {})
    return [
        build_device(plan, policy, health.get(plan.gpu.uuid, DeviceHealth()), driver_name)
        for plan in device_plans(inventory)
    ]


def build_slice(
    node_name: str,
    driver_name: str,
    devices: list[dict[str, Any]],
    generation: int,
    owner: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ResourceSlice object; `owner` (the Node's name and uid) lets the garbage collector
    remove it with its node."""
    metadata: dict[str, Any] = {"name": slice_name(node_name, driver_name), "labels": MANAGED_BY}
    if owner:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": owner["name"], "uid": owner["uid"]}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver_name,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


# The config key that sets each capacity's request policy.
_POLICY_KEYS = {"memory": "dra.memory", "compute": "dra.compute"}
_DEVICE_FIELD = re.compile(r"spec\.devices\[(\d+)\](?:\.capacity\[(\w+)\])?")


def slice_problems(obj: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse the ResourceSlice `obj` (docs/dra.md): one line per rule
    it breaks, naming the device, the field and the config key that sets it; empty when the API
    server would take it."""
    devices = (obj.get("spec") or {}).get("devices") or []
    lines = []
    for error in slice_errors(obj):
        line = str(error)
        found = _DEVICE_FIELD.match(error.field)
        if found is not None and int(found[1]) < len(devices):
            device = devices[int(found[1])]
            attributes = device.get("attributes") or {}
            product = (attributes.get("productName") or {}).get("string", "?")
            uuid = (attributes.get("uuid") or {}).get("string", "?")
            memory = int((device.get("capacity") or {}).get("memory", {}).get("value", 0))
            line = (
                f"device {device.get('name')} ({product}, {format_bytes(memory)}, {uuid}): {line}"
            )
            key = _POLICY_KEYS.get(found[2] or "")
            if key is not None:
                line += f" (its request policy comes from {key}: min, step, default)"
        lines.append(line)
    return lines
