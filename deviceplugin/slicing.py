"""Slicing (docs/design.md §2): physical GPUs + config -> slices. The preferred allocation among
them is `preferred`'s.

Pure: no I/O, no clocks, no driver. Everything here takes plain values and returns plain values.

A slice is only a name, `<GPU-UUID>::<n>`, plus the share of its GPU that it stands for:
`floor(memory / replicas)` bytes and `1 / replicas` of the compute. The rule for a GPU is the first
override whose match fits it, else the default rule. A GPU that cannot be sliced (MIG mode, a
`memoryPerSlice` larger than the GPU, device IDs the kubelet would refuse) is kept in the plan with
`excluded_reason`, so that `check-config` and the logs can say why it advertises nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from fnmatch import fnmatchcase

from deviceplugin.config import (
    DEFAULT_RESOURCE_NAME,
    GpuMatch,
    MigConfig,
    MigStrategy,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.model import (
    MAX_DEVICE_ID_LENGTH,
    GpuInfo,
    GpuPlan,
    Inventory,
    NodeReading,
    Slice,
    SliceId,
)

MIG_EXCLUDED_REASON = "MIG mode is enabled; MIG GPUs are not sliced"
MIG_PARENT_REASON = "MIG mode is enabled; its MIG devices are sliced instead"
MIG_NONE_REASON = "MIG strategy is none; MIG devices are not advertised (set mig.strategy)"
# A MIG device is one slice unless an override with a profile match says otherwise.
MIG_DEFAULT_RULE = SliceRule(replicas=1)

_BINARY_UNITS = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def format_bytes(n: int) -> str:
    """A byte count for people: the largest binary unit it reaches, exact values without a
    decimal ("20Gi", "512Mi"), others with one ("19.8Gi"); below 1Ki plain bytes ("512B")."""
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    for suffix, unit in _BINARY_UNITS:
        if magnitude >= unit:
            if magnitude % unit == 0:
                return f"{sign}{magnitude // unit}{suffix}"
            return f"{sign}{magnitude / unit:.1f}{suffix}"
    return f"{sign}{magnitude}B"


# --- the plan -------------------------------------------------------------------------------


def _matches(match: GpuMatch, gpu: GpuInfo) -> bool:
    if (match.profile is not None) != gpu.is_mig_device:
        return False
    if match.profile is not None and not fnmatchcase(gpu.mig_profile, match.profile):
        return False
    if match.model is not None and not fnmatchcase(gpu.name, match.model):
        return False
    if match.index is not None and match.index != gpu.index:
        return False
    return match.uuid is None or match.uuid == gpu.uuid


def rule_for(gpu: GpuInfo, cfg: SlicingConfig) -> SliceRule:
    """The rule for `gpu`: the first override whose match fits it (every given field must
    match), else the default: `cfg.default` for a full GPU, one slice for a MIG device."""
    for override in cfg.overrides:
        if _matches(override.match, gpu):
            return override.rule
    return MIG_DEFAULT_RULE if gpu.is_mig_device else cfg.default


def _excluded(gpu: GpuInfo, reason: str) -> GpuPlan:
    return GpuPlan(
        gpu=gpu,
        replicas=0,
        memory_per_slice_bytes=0,
        compute_share_ratio=0.0,
        excluded_reason=reason,
    )


def _plan_one(gpu: GpuInfo, rule: SliceRule, resource_name: str) -> GpuPlan:
    total = gpu.memory_total_bytes
    if rule.replicas is not None:
        replicas = rule.replicas
        if replicas < 1:
            return _excluded(gpu, f"replicas {replicas} is less than 1")
    elif rule.memory_per_slice_bytes is not None:
        per_slice = rule.memory_per_slice_bytes
        if per_slice < 1:
            return _excluded(gpu, f"memoryPerSlice {per_slice} is not a positive size")
        replicas = total // per_slice
        if replicas < 1:
            return _excluded(
                gpu,
                f"memoryPerSlice {format_bytes(per_slice)} is larger than the GPU's "
                f"{format_bytes(total)}",
            )
    else:
        return _excluded(gpu, "the slicing rule sets neither replicas nor memoryPerSlice")
    memory_per_slice = total // replicas
    if memory_per_slice < 1:
        return _excluded(
            gpu, f"{replicas} replicas of the GPU's {format_bytes(total)} leave no memory per slice"
        )
    return GpuPlan(
        gpu=gpu,
        replicas=replicas,
        memory_per_slice_bytes=memory_per_slice,
        compute_share_ratio=1.0 / replicas,
        resource_name=resource_name,
    )


def _mig_single_problem(gpus: Sequence[GpuInfo]) -> str:
    """Why the single strategy cannot advertise these MIG devices, or "" if it can."""
    profiles = sorted({g.mig_profile for g in gpus if g.is_mig_device})
    if len(profiles) <= 1:
        return ""
    return (
        "MIG strategy single needs one MIG profile on the node, found "
        + ", ".join(profiles)
        + " (use mig.strategy mixed, or re-partition the GPUs alike)"
    )


def plan_gpus(
    gpus: Sequence[GpuInfo],
    cfg: SlicingConfig,
    *,
    mig: MigConfig | None = None,
    resource_name: str = DEFAULT_RESOURCE_NAME,
) -> tuple[GpuPlan, ...]:
    """How each GPU and MIG device is sliced, in GPU index order (a GPU's MIG devices follow it,
    by UUID). Excluded GPUs are kept, with replicas 0 and `excluded_reason` set.

    Full GPUs are advertised under `resource_name`. A GPU in MIG mode is never sliced itself;
    its MIG devices are, per the MIG strategy: under `resource_name` (single, when the node has
    one profile), under the profile's own resource (mixed), or not at all (none)."""
    mig = mig or MigConfig()
    ordered = sorted(gpus, key=lambda g: (g.index, g.is_mig_device, g.uuid))
    single_problem = _mig_single_problem(ordered) if mig.strategy is MigStrategy.SINGLE else ""
    plans: list[GpuPlan] = []
    for gpu in ordered:
        if gpu.is_mig_device:
            if mig.strategy is MigStrategy.NONE:
                plans.append(_excluded(gpu, MIG_NONE_REASON))
            elif single_problem:
                plans.append(_excluded(gpu, single_problem))
            else:
                name = (
                    resource_name
                    if mig.strategy is MigStrategy.SINGLE
                    else mig.resource_for(gpu.mig_profile)
                )
                plans.append(_plan_one(gpu, rule_for(gpu, cfg), name))
        elif gpu.mig_enabled:
            if mig.strategy is MigStrategy.NONE:
                reason = MIG_EXCLUDED_REASON
            else:
                reason = single_problem or MIG_PARENT_REASON
            plans.append(_excluded(gpu, reason))
        else:
            plans.append(_plan_one(gpu, rule_for(gpu, cfg), resource_name))
    return tuple(plans)


def _id_problem(plan: GpuPlan, seen_uuids: set[str]) -> str:
    """Why this sliced GPU's device IDs cannot be advertised, or "" if they can."""
    uuid = plan.gpu.uuid
    if not uuid:
        return "the GPU reports an empty UUID"
    if uuid in seen_uuids:
        return f"another GPU has the same UUID {uuid!r}"
    longest = str(SliceId(uuid, plan.replicas - 1))
    if len(longest) > MAX_DEVICE_ID_LENGTH:
        return (
            f"device ID {longest!r} is {len(longest)} characters, longer than the kubelet's "
            f"limit of {MAX_DEVICE_ID_LENGTH}"
        )
    return ""


def build_inventory(
    reading: NodeReading,
    cfg: SlicingConfig,
    *,
    mig: MigConfig | None = None,
    resource_name: str = DEFAULT_RESOURCE_NAME,
) -> Inventory:
    """The slices this node advertises: `replicas` slices per sliced GPU or MIG device, healthy
    when its reading is (and, for a MIG device, its parent's is). A GPU whose device IDs the
    kubelet would refuse is excluded with a reason."""
    healthy_by_uuid: dict[str, bool] = {}
    for gpu_reading in reading.gpus:
        healthy_by_uuid.setdefault(gpu_reading.info.uuid, gpu_reading.healthy)
    for gpu_reading in reading.gpus:
        parent = gpu_reading.info.parent_uuid
        if parent and not healthy_by_uuid.get(parent, True):
            healthy_by_uuid[gpu_reading.info.uuid] = False

    plans: list[GpuPlan] = []
    slices: list[Slice] = []
    seen_uuids: set[str] = set()
    infos = [g.info for g in reading.gpus]
    for plan in plan_gpus(infos, cfg, mig=mig, resource_name=resource_name):
        if not plan.sliced:
            plans.append(plan)
            continue
        problem = _id_problem(plan, seen_uuids)
        seen_uuids.add(plan.gpu.uuid)
        if problem:
            plans.append(_excluded(plan.gpu, problem))
            continue
        plans.append(plan)
        slices.extend(
            Slice(
                id=SliceId(plan.gpu.uuid, n),
                gpu_index=plan.gpu.index,
                numa_node=plan.gpu.numa_node,
                memory_limit_bytes=plan.memory_per_slice_bytes,
                compute_share_ratio=plan.compute_share_ratio,
                healthy=healthy_by_uuid[plan.gpu.uuid],
                resource_name=plan.resource_name,
            )
            for n in range(plan.replicas)
        )
    return Inventory.of(plans, slices)


HELD_REASON = "MIG device gone, but an allocation still holds its slices"


def keep_held(previous: Inventory, current: Inventory, held: Iterable[str]) -> Inventory:
    """`current`, plus every slice of `previous` that an allocation holds (`held`) and that
    `current` no longer has, advertised Unhealthy with the memory and compute it was handed out
    with: the kubelet admits nothing new onto it, and its resource stays registered, until the
    kubelet frees it when the container's pod ends.

    Two things drop a held slice: a new slicing plan (a config reload with fewer replicas, a
    new MIG strategy) for a device that is still there, and a MIG layout change (mig-parted
    re-partitioning a GPU) that removes a MIG device while its GPU stays. The plan of a MIG
    device that is gone is kept, with `excluded_reason` saying why, so that its resource keeps a
    plan. A whole GPU that is gone takes its slices with it: there is nothing left to hold."""
    previous_plans = {p.gpu.uuid: p for p in previous.plans}
    planned = {p.gpu.uuid for p in current.plans}

    def still_there(uuid: str) -> bool:
        if uuid in planned:
            return True
        plan = previous_plans.get(uuid)
        return plan is not None and plan.gpu.parent_uuid in planned

    kept = [
        replace(previous.by_id[device_id], healthy=False)
        for device_id in set(held)
        if device_id not in current.by_id
        and device_id in previous.by_id
        and still_there(previous.by_id[device_id].id.gpu_uuid)
    ]
    if not kept:
        return current
    kept_uuids = {s.id.gpu_uuid for s in kept}
    plans = list(current.plans)
    plans.extend(
        replace(plan, excluded_reason=plan.excluded_reason or HELD_REASON)
        for uuid, plan in previous_plans.items()
        if uuid in kept_uuids and uuid not in planned
    )
    return Inventory.of(plans, (*current.slices, *kept))


__all__ = [
    "MIG_EXCLUDED_REASON",
    "MIG_NONE_REASON",
    "MIG_PARENT_REASON",
    "build_inventory",
    "format_bytes",
    "keep_held",
    "plan_gpus",
    "rule_for",
]
