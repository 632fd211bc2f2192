"""The driver's memory-partition rules (deviceplugin/gpu/fake/partitionrules.py): what the fake
GPUs and the NVML driver model both follow, on a directory laid out like the hierarchy."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.gpu.cgrouptree import DirectoryTree
from deviceplugin.gpu.fake.partitionrules import PartitionCodeError, PartitionRules, Store
from deviceplugin.partitions import (
    LIMIT_MAX,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
)
from tests.support.cgroup_tree import Hierarchy

GiB = 1 << 30
CAPACITY = 80 * GiB
POD = "/kubepods/burstable/poda"
LEAF_A = f"{POD}/a"
LEAF_B = f"{POD}/b"


@pytest.fixture
def cgroups(tmp_path: Path) -> Hierarchy:
    tree = Hierarchy(tmp_path)
    tree.mkdir(LEAF_A)
    tree.mkdir(LEAF_B)
    return tree


def rules(cgroups: Hierarchy, store: Store) -> PartitionRules:
    return PartitionRules(store, DirectoryTree(cgroups.root), CAPACITY, lambda: 1000.5)


def code_of(call: object, *args: object) -> int:
    with pytest.raises(PartitionCodeError) as raised:
        call(*args)  # type: ignore[operator]
    return raised.value.code


def test_dmem_soft_limits_sum_into_every_ancestor_and_come_out_when_cleared(
    cgroups: Hierarchy,
) -> None:
    driver = rules(cgroups, "dmem")
    driver.set(LEAF_A, 1 * GiB, 8 * GiB)
    driver.set(LEAF_B, 2 * GiB, 8 * GiB)
    for ancestor in (POD, "/kubepods/burstable", "/kubepods"):
        assert driver.get(ancestor)[:2] == (3 * GiB, LIMIT_MAX)
    assert driver.get(LEAF_A)[:2] == (1 * GiB, 8 * GiB)
    driver.set(LEAF_A, 0, LIMIT_MAX)
    assert driver.get(POD)[:2] == (2 * GiB, LIMIT_MAX)
    assert code_of(driver.get, LEAF_A) == NVML_ERROR_NOT_FOUND  # nothing set there any more
    driver.set(LEAF_B, 0, LIMIT_MAX)
    assert driver.limits == {}


def test_dmem_a_leaf_removed_with_its_soft_limit_leaks_it_into_its_ancestors(
    cgroups: Hierarchy,
) -> None:
    driver = rules(cgroups, "dmem")
    driver.set(LEAF_A, 1 * GiB, 8 * GiB)
    cgroups.remove(LEAF_A)
    gone = driver.forget_removed()
    assert [cgroup for cgroup, _ in gone] == [LEAF_A]
    assert driver.get(POD)[0] == 1 * GiB  # the leak
    # The repair: the ancestor set back to what its leaves hold; the change propagates up.
    driver.set(POD, 0, LIMIT_MAX)
    assert "/kubepods" not in driver.limits
    assert driver.limits == {}


def test_dmem_a_gap_stops_the_propagation(cgroups: Hierarchy) -> None:
    (cgroups.path("/kubepods") / "cgroup.subtree_control").write_text("cpu memory\n")
    driver = rules(cgroups, "dmem")
    driver.set(LEAF_A, 1 * GiB, 8 * GiB)
    assert driver.get(POD)[0] == 1 * GiB
    # /kubepods/burstable has no dmem files (its parent lacks +dmem): the walk stops below it.
    assert "/kubepods/burstable" not in driver.limits
    assert "/kubepods" not in driver.limits
    assert code_of(driver.set, "/kubepods/burstable", 0, GiB) == NVML_ERROR_NOT_FOUND


def test_refusals_name_the_code_the_driver_gives(cgroups: Hierarchy) -> None:
    driver = rules(cgroups, "dmem")
    assert code_of(driver.set, "/nowhere", 0, GiB) == NVML_ERROR_NOT_FOUND
    assert code_of(driver.set, "/", 0, GiB) == NVML_ERROR_NOT_SUPPORTED
    assert code_of(driver.set, LEAF_A, 2 * GiB, GiB) == NVML_ERROR_INVALID_ARGUMENT
    assert code_of(driver.set, f"{POD}/../poda/a", 0, GiB) == NVML_ERROR_NOT_FOUND
    assert (
        code_of(
            driver.get,
            "/",
        )
        == NVML_ERROR_NOT_SUPPORTED
    )
    misc = rules(cgroups, "misc")
    assert code_of(misc.get, LEAF_A) == NVML_ERROR_NOT_SUPPORTED  # no limit at or above it


def test_dmem_allocation_fails_at_the_leaf_or_any_ancestors_hard_limit(cgroups: Hierarchy) -> None:
    driver = rules(cgroups, "dmem")
    driver.set(LEAF_A, 0, 4 * GiB)
    assert driver.charge(LEAF_A, 3 * GiB)
    assert not driver.charge(LEAF_A, 2 * GiB)  # 5 GiB > 4 GiB
    assert driver.charge(LEAF_A, 1 * GiB)
    # A parent-only limit is one shared budget for the siblings, and the leaf sees the GPU.
    driver.set(POD, 0, 6 * GiB)
    assert driver.charge(LEAF_B, 2 * GiB)
    assert not driver.charge(LEAF_B, 1)
    assert driver.mem_get_info(LEAF_B) == (CAPACITY - 6 * GiB, CAPACITY)
    assert driver.mem_get_info(LEAF_A) == (0, 4 * GiB)  # its own limit: the total it reports


def test_misc_is_not_hierarchical_a_limited_child_escapes_its_parent(cgroups: Hierarchy) -> None:
    driver = rules(cgroups, "misc")
    driver.set(POD, 0, 2 * GiB)
    driver.set(LEAF_A, 0, 6 * GiB)
    assert driver.charge(LEAF_A, 5 * GiB)  # bounded by its own limit, not the parent's
    assert driver.charge(LEAF_B, 2 * GiB)  # the parent's budget, for the unlimited sibling
    assert not driver.charge(LEAF_B, 1)
    assert driver.get(LEAF_B)[:2] == (0, 2 * GiB)  # reads the nearest limit
    assert "/kubepods" not in driver.limits  # no propagation
    cgroups.remove(LEAF_A)
    assert [c for c, _ in driver.forget_removed()] == [LEAF_A]


def test_physical_memory_bounds_every_allocation(cgroups: Hierarchy) -> None:
    driver = rules(cgroups, "dmem")
    assert driver.charge(LEAF_A, CAPACITY)
    assert not driver.charge(LEAF_B, 1)
    driver.release(LEAF_A, CAPACITY)
    assert driver.charge(LEAF_B, 1)


def test_the_time_a_limit_was_set_is_kept(cgroups: Hierarchy) -> None:
    driver = rules(cgroups, "misc")
    driver.set(LEAF_A, 0, GiB)
    assert driver.limits[LEAF_A].set_at_s == 1000.5
