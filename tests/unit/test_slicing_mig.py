"""MIG in the pure core: strategies and resource names, per-profile slicing, held slices of
vanished devices, both config formats and the fake state file's `mig` block."""

from __future__ import annotations

import pytest
import yaml

from deviceplugin.config import (
    Config,
    GpuMatch,
    MigConfig,
    MigStrategy,
    SliceOverride,
    SliceRule,
    SlicingConfig,
    parse_config,
)
from deviceplugin.errors import ConfigError, StateFileError
from deviceplugin.gpu.fake import parse_state
from deviceplugin.model import GpuInfo, GpuReading, NodeReading
from deviceplugin.slicing import (
    MIG_EXCLUDED_REASON,
    MIG_NONE_REASON,
    MIG_PARENT_REASON,
    build_inventory,
    keep_held,
    plan_gpus,
)

GI = 1 << 30
PARENT = "GPU-00000000-0000-4000-8000-000000000001"


def full(index: int) -> GpuInfo:
    return GpuInfo(f"GPU-{index}", index, "NVIDIA L4", 24 * GI, index)


def parent() -> GpuInfo:
    return GpuInfo(PARENT, 1, "NVIDIA A100-SXM4-80GB", 80 * GI, 1, mig_enabled=True)


def mig(gi: int, profile: str, memory_gib: int) -> GpuInfo:
    return GpuInfo(
        f"MIG-{gi}",
        1,
        f"NVIDIA A100-SXM4-80GB MIG {profile}",
        memory_gib * GI,
        1,
        parent_uuid=PARENT,
        mig_profile=profile,
        gpu_instance_id=gi,
        compute_instance_id=0,
    )


NODE = [full(0), parent(), mig(1, "3g.40gb", 40), mig(2, "1g.10gb", 10), mig(3, "1g.10gb", 10)]


def plans_by_uuid(cfg: SlicingConfig, strategy: MigStrategy, gpus: list[GpuInfo] = NODE) -> dict:  # type: ignore[type-arg]
    return {p.gpu.uuid: p for p in plan_gpus(gpus, cfg, mig=MigConfig(strategy=strategy))}


def test_none_leaves_mig_gpus_and_devices_out() -> None:
    plans = plans_by_uuid(SlicingConfig(), MigStrategy.NONE)
    assert plans[PARENT].excluded_reason == MIG_EXCLUDED_REASON
    assert plans["MIG-1"].excluded_reason == MIG_NONE_REASON
    assert plans["GPU-0"].replicas == 4


def test_mixed_names_a_resource_per_profile_and_one_slice_per_device_by_default() -> None:
    plans = plans_by_uuid(SlicingConfig(), MigStrategy.MIXED)
    assert plans[PARENT].excluded_reason == MIG_PARENT_REASON
    assert plans["GPU-0"].resource_name == "nvidia.com/vgpu"
    assert plans["MIG-1"].resource_name == "nvidia.com/mig-3g.40gb"
    assert plans["MIG-2"].resource_name == "nvidia.com/mig-1g.10gb"
    # slicing.replicas applies to full GPUs only.
    assert [plans[u].replicas for u in ("MIG-1", "MIG-2", "MIG-3")] == [1, 1, 1]
    assert plans["MIG-1"].memory_per_slice_bytes == 40 * GI


def test_a_profile_override_slices_only_that_profile() -> None:
    cfg = SlicingConfig(
        default=SliceRule(replicas=2),
        overrides=(
            # A model override never reaches MIG devices, even when the name would match.
            SliceOverride(GpuMatch(model="*A100*"), SliceRule(replicas=8)),
            SliceOverride(GpuMatch(profile="1g.*"), SliceRule(memory_per_slice_bytes=5 * GI)),
        ),
    )
    plans = plans_by_uuid(cfg, MigStrategy.MIXED)
    assert plans["MIG-2"].replicas == 2
    assert plans["MIG-2"].memory_per_slice_bytes == 5 * GI
    assert plans["MIG-1"].replicas == 1


def test_single_needs_one_profile() -> None:
    plans = plans_by_uuid(SlicingConfig(), MigStrategy.SINGLE)
    reason = "MIG strategy single needs one MIG profile on the node, found 1g.10gb, 3g.40gb"
    assert all(plans[u].excluded_reason.startswith(reason) for u in ("MIG-1", "MIG-2", PARENT))
    assert plans["GPU-0"].sliced

    alike = [full(0), parent(), mig(2, "1g.10gb", 10), mig(3, "1g.10gb", 10)]
    plans = plans_by_uuid(SlicingConfig(), MigStrategy.SINGLE, alike)
    assert plans["MIG-2"].resource_name == "nvidia.com/vgpu"
    assert plans["MIG-2"].sliced


def reading(*infos: GpuInfo, unhealthy: str = "") -> NodeReading:
    return NodeReading(0.0, tuple(GpuReading(i, healthy=i.uuid != unhealthy) for i in infos))


def test_inventory_splits_by_resource_and_mig_slices_follow_their_parents_health() -> None:
    cfg = SlicingConfig()
    inventory = build_inventory(
        reading(*NODE, unhealthy=PARENT), cfg, mig=MigConfig(strategy=MigStrategy.MIXED)
    )
    assert inventory.resource_names == (
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/vgpu",
    )
    small = inventory.for_resource("nvidia.com/mig-1g.10gb")
    assert [s.device_id for s in small.slices] == ["MIG-2::0", "MIG-3::0"]
    assert not any(s.healthy for s in small.slices)
    assert all(s.healthy for s in inventory.for_resource("nvidia.com/vgpu").slices)


def test_held_slices_of_a_vanished_device_stay_unhealthy_until_freed() -> None:
    mixed = MigConfig(strategy=MigStrategy.MIXED)
    before = build_inventory(reading(*NODE), SlicingConfig(), mig=mixed)
    after = build_inventory(
        reading(full(0), parent(), mig(4, "7g.80gb", 80)), SlicingConfig(), mig=mixed
    )

    kept = keep_held(before, after, {"MIG-1::0"})
    assert kept.by_id["MIG-1::0"].healthy is False
    assert "nvidia.com/mig-3g.40gb" in kept.resource_names
    assert "nvidia.com/mig-1g.10gb" not in kept.resource_names
    assert keep_held(before, after, set()) == after


# --- config ------------------------------------------------------------------------------


def test_vgpu_format_mig_strategy() -> None:
    assert parse_config({"mig": {"strategy": "mixed"}}).mig.strategy is MigStrategy.MIXED
    assert Config().mig.strategy is MigStrategy.NONE
    with pytest.raises(ConfigError) as e:
        parse_config({"mig": {"strategy": "all"}})
    assert e.value.problems == ['mig.strategy: "all" is not one of none, single, mixed']


NVIDIA_MIXED = """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources:
      - {name: nvidia.com/gpu, replicas: 4}
      - {name: nvidia.com/mig-1g.10gb, replicas: 2}
      - {name: nvidia.com/mig-3g.40gb, replicas: 3, rename: big-slice}
"""


def test_nvidia_file_with_mig_strategy_and_several_resources() -> None:
    config = parse_config(yaml.safe_load(NVIDIA_MIXED))
    assert config.resource_name == "nvidia.com/gpu"
    assert config.slicing.default == SliceRule(replicas=4)
    # NVIDIA's plugin ignores rename, with a warning: the profile keeps its own name.
    assert config.mig == MigConfig(strategy=MigStrategy.MIXED)
    plans = {p.gpu.uuid: p for p in plan_gpus(NODE, config.slicing, mig=config.mig)}
    assert (plans["MIG-2"].resource_name, plans["MIG-2"].replicas) == (
        "nvidia.com/mig-1g.10gb",
        2,
    )
    assert (plans["MIG-1"].resource_name, plans["MIG-1"].replicas) == ("nvidia.com/mig-3g.40gb", 3)
    assert [w.split(":")[0] for w in config.warnings] == ["sharing.timeSlicing.resources"]
    assert "rename is ignored" in config.warnings[0]


def test_nvidia_single_strategy_slices_mig_devices_like_gpus() -> None:
    config = parse_config(
        yaml.safe_load(
            "flags: {migStrategy: single}\n"
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 3}]}}"
        )
    )
    gpus = [full(0), parent(), mig(2, "1g.10gb", 10)]
    planned = plan_gpus(gpus, config.slicing, mig=config.mig, resource_name=config.resource_name)
    plans = {p.gpu.uuid: p for p in planned}
    assert plans["MIG-2"].replicas == 3
    assert plans["MIG-2"].resource_name == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "sharing: {timeSlicing: {resources: [{name: a, replicas: 2}, {name: a, replicas: 3}]}}",
            "sharing.timeSlicing.resources[1]: nvidia.com/a is listed twice; keep one entry (vgpu"
            " refuses it, where NVIDIA's plugin serves the larger of the two replica counts)",
        ),
    ],
)
def test_nvidia_mig_resources_that_cannot_be_served(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(text))
    assert e.value.problems == [problem]


def test_an_nvidia_mig_resource_without_the_mixed_strategy_replicates_nothing() -> None:
    # NVIDIA's plugin serves no nvidia.com/mig-<profile> with the single strategy: the entry
    # matches no device, and the MIG devices are nvidia.com/gpu, whole.
    config = parse_config(
        yaml.safe_load(
            "flags: {migStrategy: single}\n"
            "sharing: {timeSlicing: {resources: [{name: mig-1g.10gb, replicas: 2}]}}"
        )
    )
    assert config.slicing == SlicingConfig(SliceRule(replicas=1))
    (warning,) = config.warnings
    assert warning.startswith(
        "sharing.timeSlicing.resources[0].name: nvidia.com/mig-1g.10gb is ignored"
    )


# --- fake state file ---------------------------------------------------------------------


def state(mig: object) -> dict:  # type: ignore[type-arg]
    return {
        "gpus": [
            {
                "uuid": PARENT,
                "index": 0,
                "name": "NVIDIA A100-SXM4-80GB",
                "memory_total_bytes": 80 * GI,
                "minor": 0,
                "mig": mig,
            }
        ]
    }


def device(gi: int, memory: int = 10 * GI, uuid: str = "") -> dict:  # type: ignore[type-arg]
    return {
        "uuid": uuid or f"MIG-{gi}",
        "gpu_instance_id": gi,
        "compute_instance_id": 0,
        "profile": "1g.10gb",
        "memory_total_bytes": memory,
    }


def test_fake_state_mig_block_round_trips() -> None:
    parsed = parse_state(state({"enabled": True, "devices": [device(1), device(2)]}))
    (gpu,) = parsed.gpus
    assert gpu.mig_enabled
    assert [d.uuid for d in gpu.mig_devices] == ["MIG-1", "MIG-2"]
    assert parse_state(parsed.to_json()) == parsed
    info = gpu.mig_info(gpu.mig_devices[0])
    assert (info.parent_uuid, info.mig_profile, info.gpu_instance_id) == (PARENT, "1g.10gb", 1)
    # A fake MIG device's index under its GPU is its place in the list.
    assert [gpu.mig_info(d).mig_index for d in gpu.mig_devices] == [0, 1]


@pytest.mark.parametrize(
    ("mig", "problem"),
    [
        (
            {"enabled": True, "devices": [device(1), device(1, uuid="MIG-x")]},
            "gpus[0].mig.devices[1].gpu_instance_id: duplicate of gpus[0].mig.devices[0]",
        ),
        (
            {"enabled": True, "devices": [device(1, memory=81 * GI)]},
            "gpus[0].mig.devices[0].memory_total_bytes: 86973087744 is more than the GPU's",
        ),
        (
            {"enabled": False, "devices": [device(1)]},
            "gpus[0].mig.devices: lists MIG devices but enabled is false",
        ),
        (
            {"enabled": True, "devices": [device(1, uuid=PARENT)]},
            "gpus[0].mig.devices[0].uuid: duplicate of gpus[0].uuid",
        ),
    ],
)
def test_fake_state_mig_block_problems(mig: object, problem: str) -> None:
    with pytest.raises(StateFileError) as e:
        parse_state(state(mig))
    assert problem in str(e.value)


def test_nvidia_rename_by_default_names_mig_resources_shared() -> None:
    config = parse_config(
        yaml.safe_load(
            "flags: {migStrategy: mixed}\n"
            "sharing: {timeSlicing: {renameByDefault: true, resources: ["
            "{name: nvidia.com/gpu, replicas: 2}, {name: nvidia.com/mig-1g.10gb, replicas: 2}]}}"
        )
    )
    assert config.resource_name == "nvidia.com/gpu.shared"
    assert config.mig.resource_for("1g.10gb") == "nvidia.com/mig-1g.10gb.shared"
    assert config.mig.resource_for("3g.40gb") == "nvidia.com/mig-3g.40gb"
