"""InventoryCache: the inventory is rebuilt only when what it is built from changes."""

from __future__ import annotations

import dataclasses

from deviceplugin.config import SliceRule, SlicingConfig
from deviceplugin.incremental import InventoryCache
from deviceplugin.model import GpuInfo, GpuReading, NodeReading, ProcessSample
from deviceplugin.slicing import build_inventory

GI = 1 << 30


def reading(*, healthy: bool = True, util: float = 0.0, memory: int = 80 * GI) -> NodeReading:
    gpus = tuple(
        GpuReading(
            info=GpuInfo(f"GPU-{i:08x}-0000-0000-0000-000000000000", i, "A100", memory, i),
            healthy=healthy or i == 0,
            sm_util_percent=util,
            processes=(ProcessSample(100 + i, GI, util),),
        )
        for i in range(2)
    )
    return NodeReading(1.0, gpus)


CFG = SlicingConfig(default=SliceRule(replicas=4))


def test_unchanged_gpus_give_the_same_inventory_object() -> None:
    cache = InventoryCache()
    first = cache.build(reading(), CFG)
    # New reading objects, other utilisation and processes: the GPUs' facts and health are equal.
    second = cache.build(reading(util=37.0), CFG)
    assert second is first
    assert cache.builds == 1
    assert first == build_inventory(reading(), CFG)


def test_a_change_of_health_facts_or_slicing_rebuilds() -> None:
    cache = InventoryCache()
    first = cache.build(reading(), CFG)

    unhealthy = cache.build(reading(healthy=False), CFG)
    assert unhealthy == build_inventory(reading(healthy=False), CFG)
    assert [s.healthy for s in unhealthy.slices].count(False) == 4

    resized = cache.build(reading(healthy=False, memory=40 * GI), CFG)
    assert resized == build_inventory(reading(healthy=False, memory=40 * GI), CFG)
    assert resized.slices[0].memory_limit_bytes == 10 * GI

    resliced_cfg = dataclasses.replace(CFG, default=SliceRule(replicas=2))
    resliced = cache.build(reading(healthy=False, memory=40 * GI), resliced_cfg)
    assert len(resliced.slices) == 4
    assert cache.builds == 4

    assert cache.build(reading(), CFG) == first
