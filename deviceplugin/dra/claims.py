"""A ResourceClaim's allocation for this driver, and what the claim's containers get (pure).

The scheduler writes the allocation into the claim's status: per request a result naming the
driver, the pool (this node), the device, and with consumable capacity the `consumedCapacity`
(memory, compute) and a `shareID`. Prepare reads it once, here, into a `PreparedClaim`; from then
on the claim is an allocation like a device-plugin one, whose grants (`model.DeviceGrant`) are
what it consumed:

- memory limit on a GPU = the memory the claim consumed on it;
- compute share on a GPU = the compute it consumed / 100;
- `VGPU_ALLOCATION_ID` = the first 16 hex digits of the SHA-256 of `<GPU-UUID>::<claim UID>`
  for each of its GPUs, sorted and joined with commas: recomputable from the API server;
- the environment of docs/design.md §3, with those limits.

A result without `consumedCapacity` (a device allocated whole) consumes the whole device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from deviceplugin.allocation import (
    CONTROL_DEVICE_NODES,
    ENV_VISIBLE_DEVICES,
    GPU_DEVICE_NODE_PREFIX,
    DeviceLimits,
    limits_env,
    mps_mounts,
)
from deviceplugin.config import AllocationConfig, MpsConfig
from deviceplugin.dra.refs import is_claim_uid, is_dns_label, shown
from deviceplugin.dra.slices import device_name, device_plans
from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    DeviceGrant,
    GpuPlan,
    Inventory,
    allocation_id,
)
from deviceplugin.owners import AllocationOwners, OwnerEntry, normalize_pod_uid

MIB = 1 << 20
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1)}
_DECIMAL.update({"k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9)})
_DECIMAL.update({"T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)})


# A quantity is refused, before it is converted, when its text is longer than this or its number
# is beyond 10**MAX_EXPONENT (or below 10**-MAX_EXPONENT): the API server keeps `1e1000000` as
# `10e999999`, and turning that into an integer takes minutes. A GPU's bytes are below 10**16.
MAX_QUANTITY_CHARS = 64
MAX_EXPONENT = 30


class ClaimError(ValueError):
    """A claim this driver cannot prepare; the message names the claim and what is wrong."""


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (`15Gi`, `25`, `500m`, `1e3`) as a Decimal; ValueError if not one,
    or if it is out of range (`MAX_QUANTITY_CHARS`, `MAX_EXPONENT`): bounded before anything
    converts it."""
    value = text.strip()
    if len(value) > MAX_QUANTITY_CHARS:
        raise ValueError(
            f"{shown(text)} is out of range: more than {MAX_QUANTITY_CHARS} characters"
        )
    for suffix, factor in _BINARY.items():
        if value.endswith(suffix):
            return _number(value[: -len(suffix)], text) * factor
    if value[-1:] in _DECIMAL and value[-1:] != "":
        return _number(value[:-1], text) * _DECIMAL[value[-1]]
    return _number(value, text)


def _number(digits: str, text: str) -> Decimal:
    try:
        number = Decimal(digits)
    except InvalidOperation:
        raise ValueError(f"{shown(text)} is not a quantity") from None
    if not number.is_finite() or number < 0:
        raise ValueError(f"{shown(text)} is not a quantity")
    if number and not -MAX_EXPONENT <= number.adjusted() <= MAX_EXPONENT:
        raise ValueError(f"{shown(text)} is out of range")
    return number


@dataclass(frozen=True, slots=True)
class ClaimDevice:
    """One allocation result of a claim on one of this node's devices."""

    request: str
    device: str
    gpu_uuid: str
    gpu_index: int
    minor: int
    memory_total_bytes: int
    memory_bytes: int
    compute_percent: float
    share_id: str = ""
    # What it may use of the device's memory, at least what it consumed (its request): the
    # claim's `vgpu.dev` parameters' memoryLimit (dra.params); None where it is the request.
    memory_limit_bytes: int | None = None

    @property
    def limit_bytes(self) -> int:
        return self.memory_bytes if self.memory_limit_bytes is None else self.memory_limit_bytes


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim prepared on this node: what was granted, and the CDI devices handed back."""

    uid: str
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...]
    # (name, uid) of the pods the claim is reserved for.
    pods: tuple[tuple[str, str], ...] = ()
    cdi_ids: tuple[str, ...] = ()
    prepared_at_s: float = 0.0

    @property
    def allocation_id(self) -> str:
        return allocation_id(f"{uuid}::{self.uid}" for uuid in self.gpu_uuids)

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """Its distinct GPUs (or MIG devices), in index order."""
        seen: dict[str, tuple[int, str]] = {}
        for d in self.devices:
            seen.setdefault(d.gpu_uuid, (d.gpu_index, d.gpu_uuid))
        return tuple(uuid for _, uuid in sorted(seen.values()))

    def per_gpu(self) -> list[tuple[ClaimDevice, int, float]]:
        """(first result, memory bytes, compute percent) per GPU, in index order: a claim may
        hold several shares of one device (an extended-resource count, two requests)."""
        totals: dict[str, tuple[ClaimDevice, int, float]] = {}
        for d in self.devices:
            first, memory, compute = totals.get(d.gpu_uuid, (d, 0, 0.0))
            totals[d.gpu_uuid] = (first, memory + d.memory_bytes, compute + d.compute_percent)
        return [totals[uuid] for uuid in self.gpu_uuids]

    def limits_per_gpu(self) -> dict[str, tuple[int, int]]:
        """Per GPU, (request, limit) bytes: what the claim consumed there, and what it may use
        (never more than the device has)."""
        totals: dict[str, tuple[int, int]] = {}
        for d in self.devices:
            request, limit = totals.get(d.gpu_uuid, (0, 0))
            totals[d.gpu_uuid] = (
                request + d.memory_bytes,
                min(d.memory_total_bytes, limit + d.limit_bytes),
            )
        return totals


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    value: Any = obj
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def plans_by_device(inventory: Inventory) -> dict[str, GpuPlan]:
    return {device_name(p): p for p in device_plans(inventory)}


def read_claim(
    claim: Mapping[str, Any],
    *,
    driver_name: str,
    node_name: str,
    plans: Mapping[str, GpuPlan],
    now_s: float = 0.0,
) -> PreparedClaim:
    """The claim's allocation on this node's devices. Raises ClaimError naming what is wrong."""
    namespace = str(_get(claim, "metadata", "namespace") or "")
    name = str(_get(claim, "metadata", "name") or "")
    uid = str(_get(claim, "metadata", "uid") or "")
    label = f"ResourceClaim {namespace}/{name}"
    results = _get(claim, "status", "allocation", "devices", "results")
    if not isinstance(results, list):
        raise ClaimError(f"{label} is not allocated: the scheduler has not written its allocation")
    devices: list[ClaimDevice] = []
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != driver_name:
            continue
        device = str(result.get("device") or "")
        if result.get("pool") != node_name:
            raise ClaimError(
                f"{label}: device {shown(device)} is in pool {shown(result.get('pool'))}, not "
                f"this node's pool {node_name!r}"
            )
        plan = plans.get(device)
        if plan is None:
            raise ClaimError(
                f"{label}: device {shown(device)} is not published by this node "
                f"(it has {', '.join(sorted(plans)) or 'no device'}); its GPU may be gone"
            )
        devices.append(_claim_device(label, result, device, plan))
    if not devices:
        raise ClaimError(f"{label} holds no device of driver {driver_name}")
    return PreparedClaim(
        uid, namespace, name, tuple(devices), reserved_pods(claim), prepared_at_s=now_s
    )


def reserved_pods(claim: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(name, UID) of the pods in the claim's `status.reservedFor`."""
    return tuple(
        (str(ref.get("name", "")), str(ref.get("uid", "")))
        for ref in _get(claim, "status", "reservedFor") or ()
        if isinstance(ref, Mapping) and ref.get("resource") == "pods"
    )


def _claim_device(label: str, result: Mapping[str, Any], device: str, plan: GpuPlan) -> ClaimDevice:
    """One result on one of this node's devices. Each consumed amount is compared, as a decimal,
    with the device's capacity before it is converted: a claim consuming more than its device
    is refused, naming both."""
    consumed = result.get("consumedCapacity") or {}
    where = f"{label}: device {shown(device)}"
    if not isinstance(consumed, Mapping):
        raise ClaimError(f"{where}: consumedCapacity is not a map of amounts")
    total = plan.gpu.memory_total_bytes
    memory = _consumed(label, device, consumed, name="memory", capacity=total, unit=" bytes")
    compute = _consumed(label, device, consumed, name="compute", capacity=100)
    request = str(result.get("request") or "")
    if not all(is_dns_label(part) for part in request.split("/")):
        raise ClaimError(f"{where}: request {shown(request)} is not a request name")
    share_id = str(result.get("shareID") or "")
    if share_id and not is_claim_uid(share_id):
        raise ClaimError(f"{where}: shareID {shown(share_id)} is not a share ID")
    return ClaimDevice(
        request=request,
        device=device,
        gpu_uuid=plan.gpu.uuid,
        gpu_index=plan.gpu.index,
        minor=plan.gpu.minor,
        memory_total_bytes=total,
        memory_bytes=math.ceil(memory),
        compute_percent=float(compute),
        share_id=share_id,
    )


def _consumed(
    label: str,
    device: str,
    consumed: Mapping[str, Any],
    *,
    name: str,
    capacity: int,
    unit: str = "",
) -> Decimal:
    """The amount of `name` consumed (the whole `capacity` when the claim names none), checked
    against the capacity as a decimal."""
    if name not in consumed:
        return Decimal(capacity)
    raw = consumed[name]
    try:
        amount = parse_quantity(raw if isinstance(raw, str) else str(raw))
    except ValueError as e:
        raise ClaimError(f"{label}: device {shown(device)}: consumed {name} {e}") from None
    if amount > capacity:
        raise ClaimError(
            f"{label} consumes {shown(raw)} of {name}: more {name} than device "
            f"{shown(device)} has ({capacity}{unit})"
        )
    return amount


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """What a prepared claim's containers get: the CDI spec's container edits."""

    env: Mapping[str, str]
    # (host path, container path, read-only)
    mounts: tuple[tuple[str, str, bool], ...] = ()
    device_nodes: tuple[str, ...] = ()


def claim_edits(
    claim: PreparedClaim, cfg: AllocationConfig, mps: MpsConfig, *, device_nodes: bool
) -> ContainerEdits:
    """The docs/design.md §3 environment for a claim, with its consumed amounts as limits: the
    same as Allocate's (limits_env), with each GPU by UUID, and the same MPS mounts."""
    per_gpu = claim.per_gpu()
    env: dict[str, str] = {ENV_VISIBLE_DEVICES: ",".join(d.gpu_uuid for d, _, _ in per_gpu)}
    # The limit is what the container may use; frameworks are told of its request.
    limits_of = claim.limits_per_gpu()
    limits = [
        DeviceLimits(
            d.gpu_uuid, limits_of[d.gpu_uuid][1], memory, int(compute), d.memory_total_bytes
        )
        for d, memory, compute in per_gpu
    ]
    env.update(limits_env(claim.allocation_id, limits, cfg, mps))
    mounts = tuple((m.host_path, m.container_path, m.read_only) for m in mps_mounts(mps))
    nodes: tuple[str, ...] = ()
    if device_nodes:
        nodes = (
            *CONTROL_DEVICE_NODES,
            *(f"{GPU_DEVICE_NODE_PREFIX}{d.minor}" for d, _, _ in per_gpu),
        )
    return ContainerEdits(env, mounts, nodes)


def claim_grants(claim: PreparedClaim) -> tuple[DeviceGrant, ...]:
    """What the claim may use per GPU, in index order: the capacity it consumed there (compute
    / 100; memory its request) and its memory limit, the figures its CDI spec's environment
    states."""
    limits = claim.limits_per_gpu()
    grants: list[DeviceGrant] = []
    for d, memory, compute in claim.per_gpu():
        limit = limits[d.gpu_uuid][1]
        request = None if limit == memory else memory
        grants.append(DeviceGrant(d.gpu_uuid, limit, compute / 100.0, 1, request))
    return tuple(grants)


def claim_record(claim: PreparedClaim, container: str = "") -> AllocationRecord:
    """The claim in the allocation book: its pod's names (the container where pod-resources
    has named it; several pods or containers sharing a claim are joined with commas), its
    grants. A claim holds no slice."""
    pod = ",".join(dict.fromkeys(name for name, _ in claim.pods))
    return AllocationRecord(
        allocation_id=claim.allocation_id,
        slice_ids=(),
        allocated_at_s=claim.prepared_at_s,
        namespace=claim.namespace,
        pod=pod,
        container=container,
        grants=claim_grants(claim),
        source=SOURCE_DRA,
        claim=f"{claim.namespace}/{claim.name}",
    )


def claim_owners(
    claims: Iterable[PreparedClaim], users: Mapping[str, Sequence[tuple[str, str]]]
) -> AllocationOwners:
    """For each prepared claim, each pod it is reserved for, and each of that pod's containers
    the kubelet's pod-resources DRA entries list with the claim (`users`: claim UID ->
    [(pod name, container name)]), the claim's allocation held by that container. A pod whose
    containers are not named gets one owner without a container: its processes' claims stand
    only where the kubelet's container names cannot be read at all. A claim holds no slice:
    its owners name no device."""
    owners: list[OwnerEntry] = []
    for claim in claims:
        allocation = claim.allocation_id
        gpus = frozenset(claim.gpu_uuids)
        for pod_name, pod_uid in claim.pods:
            containers = sorted({c for p, c in users.get(claim.uid, ()) if p == pod_name})
            owners.extend(
                OwnerEntry(normalize_pod_uid(pod_uid), container, allocation, (), gpus)
                for container in containers or [""]
            )
    return AllocationOwners.of(tuple(owners))
