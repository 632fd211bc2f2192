"""Unit tables for deviceplugin.slicing: plan_gpus, build_inventory, format_bytes."""

from __future__ import annotations

import pytest

from deviceplugin.config import GpuMatch, SliceOverride, SliceRule, SlicingConfig
from deviceplugin.model import (
    MAX_DEVICE_ID_LENGTH,
    GpuInfo,
    GpuPlan,
    GpuReading,
    Inventory,
    NodeReading,
    SliceId,
)
from deviceplugin.slicing import (
    MIG_EXCLUDED_REASON,
    build_inventory,
    format_bytes,
    keep_held,
    plan_gpus,
    rule_for,
)

GI = 1 << 30
MI = 1 << 20
A100_80 = "NVIDIA A100-SXM4-80GB"
T4 = "Tesla T4"


def gpu(
    index: int,
    *,
    name: str = A100_80,
    memory: int = 80 * GI,
    uuid: str | None = None,
    numa: int | None = None,
    mig: bool = False,
) -> GpuInfo:
    return GpuInfo(
        uuid=uuid if uuid is not None else f"GPU-{index:08x}-0000-0000-0000-000000000000",
        index=index,
        name=name,
        memory_total_bytes=memory,
        minor=index,
        numa_node=numa,
        mig_enabled=mig,
    )


def override(
    rule: SliceRule, *, model: str | None = None, index: int | None = None, uuid: str | None = None
) -> SliceOverride:
    return SliceOverride(match=GpuMatch(model=model, index=index, uuid=uuid), rule=rule)


def replicas(n: int) -> SliceRule:
    return SliceRule(replicas=n)


def per_slice(n: int) -> SliceRule:
    return SliceRule(memory_per_slice_bytes=n)


# --- format_bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (512, "512B"),
        (1024, "1Ki"),
        (512 * MI, "512Mi"),
        (20 * GI, "20Gi"),
        (int(19.8 * GI), "19.8Gi"),
        (int(79.2 * GI), "79.2Gi"),
        (2 << 40, "2Ti"),
        (-20 * GI, "-20Gi"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


# --- plan_gpus -------------------------------------------------------------------------------


def test_default_config_gives_four_replicas() -> None:
    (plan,) = plan_gpus([gpu(0)], SlicingConfig())
    assert plan == GpuPlan(gpu(0), 4, 20 * GI, 0.25, resource_name="nvidia.com/vgpu")
    assert plan.sliced


@pytest.mark.parametrize(
    ("memory", "rule", "want_replicas", "want_per_slice"),
    [
        (80 * GI, replicas(1), 1, 80 * GI),
        (80 * GI, replicas(3), 3, (80 * GI) // 3),
        (80 * GI + 1, replicas(2), 2, 40 * GI),
        (16 * GI, replicas(7), 7, (16 * GI) // 7),
        (80 * GI, per_slice(10 * GI), 8, 10 * GI),
        (80 * GI, per_slice(30 * GI), 2, 40 * GI),  # floor(80/30)=2, then 80/2
        (80 * GI, per_slice(80 * GI), 1, 80 * GI),
        (15 * GI, per_slice(4 * GI), 3, 5 * GI),
    ],
)
def test_rules(memory: int, rule: SliceRule, want_replicas: int, want_per_slice: int) -> None:
    (plan,) = plan_gpus([gpu(0, memory=memory)], SlicingConfig(default=rule))
    assert plan.replicas == want_replicas
    assert plan.memory_per_slice_bytes == want_per_slice
    assert plan.compute_share_ratio == pytest.approx(1 / want_replicas)
    assert plan.excluded_reason == ""


def test_memory_per_slice_larger_than_gpu_is_excluded_with_reason() -> None:
    memory = int(79.2 * GI)
    (plan,) = plan_gpus([gpu(0, memory=memory)], SlicingConfig(default=per_slice(100 * GI)))
    assert not plan.sliced
    assert plan.replicas == 0
    assert plan.excluded_reason == "memoryPerSlice 100Gi is larger than the GPU's 79.2Gi"


def test_mig_gpu_is_excluded() -> None:
    plans = plan_gpus([gpu(0, mig=True), gpu(1)], SlicingConfig())
    assert plans[0].replicas == 0
    assert plans[0].excluded_reason == MIG_EXCLUDED_REASON
    assert not plans[0].sliced
    assert plans[1].sliced


@pytest.mark.parametrize(
    ("rule", "reason_part"),
    [
        (replicas(0), "replicas 0"),
        (per_slice(0), "memoryPerSlice 0"),
        (SliceRule(), "neither replicas nor memoryPerSlice"),
    ],
)
def test_invalid_rules_exclude(rule: SliceRule, reason_part: str) -> None:
    (plan,) = plan_gpus([gpu(0)], SlicingConfig(default=rule))
    assert plan.replicas == 0
    assert reason_part in plan.excluded_reason


def test_plans_are_in_index_order() -> None:
    plans = plan_gpus([gpu(2), gpu(0), gpu(1)], SlicingConfig())
    assert [p.gpu.index for p in plans] == [0, 1, 2]


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        pytest.param((), [4, 4, 4], id="no-overrides"),
        pytest.param((override(replicas(8), model="*A100*"),), [8, 8, 4], id="model-glob"),
        pytest.param((override(replicas(8), model="NVIDIA A100*"),), [8, 8, 4], id="model-prefix"),
        pytest.param((override(replicas(8), model="*a100*"),), [4, 4, 4], id="model-case"),
        pytest.param((override(replicas(8), model=T4),), [4, 4, 8], id="model-exact"),
        pytest.param((override(replicas(2), index=1),), [4, 2, 4], id="index"),
        pytest.param(
            (override(replicas(3), uuid="GPU-00000002-0000-0000-0000-000000000000"),),
            [4, 4, 3],
            id="uuid",
        ),
        pytest.param(
            (override(replicas(2), index=0), override(replicas(8), model="*A100*")),
            [2, 8, 4],
            id="first-match-wins",
        ),
        pytest.param(
            (override(replicas(8), model="*A100*"), override(replicas(2), index=0)),
            [8, 8, 4],
            id="first-match-wins-other-order",
        ),
        pytest.param(
            (override(replicas(2), model="*A100*", index=1),),
            [4, 2, 4],
            id="all-fields-must-match",
        ),
        pytest.param(
            (override(replicas(2), model=T4, index=1),),
            [4, 4, 4],
            id="partial-match-is-no-match",
        ),
        pytest.param(
            (override(per_slice(16 * GI), model=T4),),
            [4, 4, 1],
            id="memory-override",
        ),
    ],
)
def test_overrides(overrides: tuple[SliceOverride, ...], want: list[int]) -> None:
    gpus = [gpu(0), gpu(1), gpu(2, name=T4, memory=16 * GI)]
    plans = plan_gpus(gpus, SlicingConfig(overrides=overrides))
    assert [p.replicas for p in plans] == want


def test_rule_for_returns_default_when_nothing_matches() -> None:
    cfg = SlicingConfig(default=replicas(5), overrides=(override(replicas(8), index=7),))
    assert rule_for(gpu(0), cfg) == replicas(5)
    assert rule_for(gpu(7), cfg) == replicas(8)


# --- build_inventory -------------------------------------------------------------------------


def reading(*gpus: GpuInfo | GpuReading) -> NodeReading:
    return NodeReading(
        timestamp_s=0.0,
        gpus=tuple(g if isinstance(g, GpuReading) else GpuReading(info=g) for g in gpus),
    )


def test_inventory_ids_and_values() -> None:
    g0, g1 = gpu(0, numa=0), gpu(1, numa=1, memory=40 * GI)
    inv = build_inventory(reading(g0, g1), SlicingConfig(default=replicas(2)))
    assert [s.device_id for s in inv.slices] == [
        f"{g0.uuid}::0",
        f"{g0.uuid}::1",
        f"{g1.uuid}::0",
        f"{g1.uuid}::1",
    ]
    s = inv.by_id[f"{g1.uuid}::1"]
    assert s.id == SliceId(g1.uuid, 1)
    assert s.gpu_index == 1
    assert s.numa_node == 1
    assert s.memory_limit_bytes == 20 * GI
    assert s.compute_share_ratio == pytest.approx(0.5)
    assert s.healthy
    assert [p.gpu for p in inv.plans] == [g0, g1]


def test_inventory_ids_round_trip_through_parse() -> None:
    inv = build_inventory(reading(gpu(0)), SlicingConfig(default=replicas(12)))
    for s in inv.slices:
        assert SliceId.parse(s.device_id) == s.id
    assert [s.id.n for s in inv.slices] == list(range(12))


def test_inventory_health_comes_from_reading() -> None:
    sick = GpuReading(info=gpu(1), healthy=False, health_reason="XID 79")
    inv = build_inventory(reading(gpu(0), sick), SlicingConfig())
    assert {s.healthy for s in inv.slices if s.gpu_index == 0} == {True}
    assert {s.healthy for s in inv.slices if s.gpu_index == 1} == {False}
    assert len(inv.slices) == 8  # unhealthy GPUs are still advertised, as unhealthy


def test_inventory_numa_unknown() -> None:
    inv = build_inventory(reading(gpu(0)), SlicingConfig())
    assert {s.numa_node for s in inv.slices} == {None}


def test_inventory_order_by_index_whatever_the_reading_order() -> None:
    inv = build_inventory(reading(gpu(2), gpu(0), gpu(1)), SlicingConfig(default=replicas(2)))
    assert [(s.gpu_index, s.id.n) for s in inv.slices] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert [p.gpu.index for p in inv.plans] == [0, 1, 2]


def test_inventory_leaves_out_excluded_gpus_but_keeps_their_plans() -> None:
    inv = build_inventory(reading(gpu(0, mig=True), gpu(1)), SlicingConfig())
    assert {s.gpu_index for s in inv.slices} == {1}
    plan = inv.plan_for(gpu(0).uuid)
    assert plan is not None
    assert plan.excluded_reason == MIG_EXCLUDED_REASON


def test_inventory_excludes_gpu_whose_ids_are_too_long() -> None:
    # "::9" takes 3 characters; a UUID of 60 fits replicas <= 10, not 11.
    fits = "G" * (MAX_DEVICE_ID_LENGTH - 3)
    too_long = "H" * (MAX_DEVICE_ID_LENGTH - 3)
    inv = build_inventory(
        reading(gpu(0, uuid=fits), gpu(1, uuid=too_long)),
        SlicingConfig(overrides=(override(replicas(10), index=0), override(replicas(11), index=1))),
    )
    assert {s.gpu_index for s in inv.slices} == {0}
    assert max(len(s.device_id) for s in inv.slices) == MAX_DEVICE_ID_LENGTH
    plan = inv.plan_for(too_long)
    assert plan is not None
    assert plan.replicas == 0
    assert "longer than" in plan.excluded_reason
    assert str(MAX_DEVICE_ID_LENGTH) in plan.excluded_reason


def test_inventory_excludes_duplicate_uuid() -> None:
    inv = build_inventory(reading(gpu(0, uuid="GPU-x"), gpu(1, uuid="GPU-x")), SlicingConfig())
    assert {s.gpu_index for s in inv.slices} == {0}
    assert len(inv.by_id) == 4
    assert "same UUID" in inv.plans[1].excluded_reason


def test_empty_reading_gives_empty_inventory() -> None:
    inv = build_inventory(reading(), SlicingConfig())
    assert inv.slices == ()
    assert inv.plans == ()


# --- keep_held: a new plan with slices still held ---------------------------------------------


def _inventory(replicas: int, *gpus: GpuInfo) -> Inventory:
    reading = NodeReading(0.0, tuple(GpuReading(g) for g in gpus))
    return build_inventory(reading, SlicingConfig(default=SliceRule(replicas=replicas)))


def test_a_held_slice_the_new_plan_drops_stays_unhealthy_with_its_old_share() -> None:
    g = gpu(0)
    old, new = _inventory(4, g), _inventory(2, g)
    held = [f"{g.uuid}::1", f"{g.uuid}::3"]
    kept = keep_held(old, new, held)
    assert [s.device_id for s in kept.slices] == [f"{g.uuid}::{n}" for n in (0, 1, 3)]
    dropped = kept.by_id[f"{g.uuid}::3"]
    assert not dropped.healthy
    assert dropped.memory_limit_bytes == 20 * GI  # what it was handed out with
    assert dropped.compute_share_ratio == 0.25
    # A held slice the new plan keeps is the new plan's, healthy.
    assert kept.by_id[f"{g.uuid}::1"] == new.by_id[f"{g.uuid}::1"]


def test_nothing_held_or_nothing_dropped_is_the_new_plan_itself() -> None:
    g = gpu(0)
    old, new = _inventory(4, g), _inventory(2, g)
    assert keep_held(old, new, []) is new
    assert keep_held(old, new, [f"{g.uuid}::0"]) is new


def test_slices_of_a_gpu_that_is_gone_are_not_kept() -> None:
    a, b = gpu(0), gpu(1)
    old, new = _inventory(2, a, b), _inventory(2, a)
    assert keep_held(old, new, [f"{b.uuid}::0"]) is new
