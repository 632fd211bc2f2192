"""GetPreferredAllocation (docs/design.md §3): property tests over random inventories, worked
examples, and the requests that cannot be met."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deviceplugin.config import AllocationPolicy, GpuMatch, SliceOverride, SliceRule, SlicingConfig
from deviceplugin.errors import AllocationError
from deviceplugin.model import GpuInfo, GpuReading, Inventory, NodeReading
from deviceplugin.preferred import preferred_allocation
from deviceplugin.slicing import build_inventory

GI = 1 << 30
PACK = AllocationPolicy.PACK
SPREAD = AllocationPolicy.SPREAD


def make_inventory(replicas: list[int], uuids: list[str] | None = None) -> Inventory:
    """GPU i has replicas[i] slices; its UUID is uuids[i] (default "GPU-<i>")."""
    names = uuids if uuids is not None else [f"GPU-{i}" for i in range(len(replicas))]
    gpus = tuple(
        GpuReading(info=GpuInfo(uuid=u, index=i, name="X", memory_total_bytes=64 * GI, minor=i))
        for i, u in enumerate(names)
    )
    cfg = SlicingConfig(
        overrides=tuple(
            SliceOverride(GpuMatch(index=i), SliceRule(replicas=r)) for i, r in enumerate(replicas)
        )
    )
    return build_inventory(NodeReading(0.0, gpus), cfg)


@dataclass(frozen=True)
class Case:
    inventory: Inventory
    available: list[str]
    must_include: list[str]
    size: int

    def gpu_of(self, device_id: str) -> int:
        return self.inventory.by_id[device_id].gpu_index

    def free_by_gpu(self) -> Counter[int]:
        """Available slices per GPU index, leaving out must_include."""
        must = set(self.must_include)
        return Counter(
            self.gpu_of(i) for i in self.available if i in self.inventory.by_id and i not in must
        )

    def used_by_gpu(self) -> Counter[int]:
        """Slices per GPU index not available before the request."""
        avail = set(self.available)
        return Counter(s.gpu_index for s in self.inventory.slices if s.device_id not in avail)


@st.composite
def cases(draw: st.DrawFn, *, with_must: bool = True, unknown: bool = False) -> Case:
    replicas = draw(st.lists(st.integers(1, 16), min_size=1, max_size=8))
    # UUIDs in a shuffled order, so that UUID order and index order differ.
    uuids = [f"GPU-{p:02x}" for p in draw(st.permutations(range(len(replicas))))]
    inventory = make_inventory(replicas, uuids)
    all_ids = [s.device_id for s in inventory.slices]
    available = draw(st.lists(st.sampled_from(all_ids), unique=True, max_size=len(all_ids)))
    if unknown:
        available += [f"other-{k}" for k in draw(st.sets(st.integers(0, 99), max_size=6))]
    available = draw(st.permutations(available))
    must: list[str] = []
    if with_must and available:
        must = draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = draw(st.integers(len(must), len(available)))
    return Case(inventory, list(available), must, size)


def run(case: Case, policy: AllocationPolicy) -> list[str]:
    return preferred_allocation(
        case.inventory, case.available, case.must_include, case.size, policy
    )


policies = st.sampled_from(list(AllocationPolicy))


# --- properties of every answer --------------------------------------------------------------


@settings(max_examples=300)
@given(case=cases(unknown=True), policy=policies)
def test_answer_is_exact_size_subset_without_duplicates_and_includes_must(
    case: Case, policy: AllocationPolicy
) -> None:
    got = run(case, policy)
    assert len(got) == case.size
    assert len(set(got)) == len(got)
    assert set(got) <= set(case.available)
    assert set(case.must_include) <= set(got)


@settings(max_examples=200)
@given(case=cases(unknown=True), policy=policies, data=st.data())
def test_answer_is_deterministic_whatever_the_input_order(
    case: Case, policy: AllocationPolicy, data: st.DataObject
) -> None:
    first = run(case, policy)
    shuffled = Case(
        case.inventory,
        data.draw(st.permutations(case.available)),
        data.draw(st.permutations(case.must_include)),
        case.size,
    )
    assert run(shuffled, policy) == first
    assert run(case, policy) == first


@settings(max_examples=200)
@given(case=cases(unknown=True), policy=policies)
def test_unknown_ids_only_as_last_resort(case: Case, policy: AllocationPolicy) -> None:
    got = run(case, policy)
    known_available = [i for i in case.available if i in case.inventory.by_id]
    unknown_must = [i for i in case.must_include if i not in case.inventory.by_id]
    unknown_chosen = [i for i in got if i not in case.inventory.by_id]
    want = len(unknown_must) + max(0, case.size - len(known_available) - len(unknown_must))
    assert len(unknown_chosen) == want


@settings(max_examples=200)
@given(case=cases(), policy=policies)
def test_lowest_slice_numbers_first_within_a_gpu(case: Case, policy: AllocationPolicy) -> None:
    got = run(case, policy)
    must = set(case.must_include)
    for gpu_index in {case.gpu_of(i) for i in got}:
        picked = sorted(
            case.inventory.by_id[i].id.n
            for i in got
            if i not in must and case.gpu_of(i) == gpu_index
        )
        free = sorted(
            case.inventory.by_id[i].id.n
            for i in case.available
            if i not in must and case.gpu_of(i) == gpu_index
        )
        assert picked == free[: len(picked)]


# --- pack ------------------------------------------------------------------------------------


def with_size(case: Case, size: int) -> Case:
    return Case(case.inventory, case.available, case.must_include, size)


@settings(max_examples=300)
@given(case=cases(with_must=False), data=st.data())
def test_pack_request_that_fits_one_gpu_lands_on_the_fullest_that_fits(
    case: Case, data: st.DataObject
) -> None:
    free = case.free_by_gpu()
    used = case.used_by_gpu()
    assume(free)
    case = with_size(case, data.draw(st.integers(1, max(free.values())), label="size"))
    fitting = [g for g, n in free.items() if n >= case.size]
    got = run(case, PACK)
    gpus = {case.gpu_of(i) for i in got}
    assert len(gpus) == 1
    (chosen,) = gpus
    assert chosen == min(fitting, key=lambda g: (-used[g], g))


@settings(max_examples=300)
@given(case=cases(with_must=False))
def test_pack_spans_as_few_gpus_as_possible(case: Case) -> None:
    got = run(case, PACK)
    counts = sorted(case.free_by_gpu().values(), reverse=True)
    fewest = 0
    covered = 0
    while covered < case.size:
        covered += counts[fewest]
        fewest += 1
    assert len({case.gpu_of(i) for i in got}) == fewest


@settings(max_examples=200)
@given(case=cases(with_must=False), data=st.data())
def test_pack_with_must_include_puts_the_rest_on_the_fullest_gpu_that_fits(
    case: Case, data: st.DataObject
) -> None:
    """must_include picks count as used, so the rest joins them unless a fuller GPU fits."""
    free = case.free_by_gpu()
    roomy = sorted(g for g, n in free.items() if n >= 2)
    assume(roomy)
    gpu = data.draw(st.sampled_from(roomy), label="gpu")
    on_gpu = [i for i in case.available if i in case.inventory.by_id and case.gpu_of(i) == gpu]
    must = data.draw(
        st.lists(st.sampled_from(on_gpu), unique=True, min_size=1, max_size=len(on_gpu) - 1),
        label="must",
    )
    remaining = data.draw(st.integers(1, len(on_gpu) - len(must)), label="remaining")
    case = Case(case.inventory, case.available, must, len(must) + remaining)
    used = case.used_by_gpu() + Counter(case.gpu_of(i) for i in must)
    free = case.free_by_gpu()
    fitting = [g for g, n in free.items() if n >= remaining]
    want = min(fitting, key=lambda g: (-used[g], g))
    got = run(case, PACK)
    assert {case.gpu_of(i) for i in got if i not in set(must)} == {want}
    if want == gpu:
        assert {case.gpu_of(i) for i in got} == {gpu}


# --- spread ----------------------------------------------------------------------------------


@settings(max_examples=300)
@given(case=cases(with_must=False))
def test_spread_uses_as_many_gpus_as_it_can(case: Case) -> None:
    got = run(case, SPREAD)
    gpus_with_free = len(case.free_by_gpu())
    assert len({case.gpu_of(i) for i in got}) == min(case.size, gpus_with_free)


@settings(max_examples=300)
@given(case=cases())
def test_spread_with_must_include_adds_new_gpus_first(case: Case) -> None:
    got = run(case, SPREAD)
    must_gpus = {case.gpu_of(i) for i in case.must_include}
    new_gpus = set(case.free_by_gpu()) - must_gpus
    remaining = case.size - len(case.must_include)
    want = len(must_gpus) + min(remaining, len(new_gpus))
    assert len({case.gpu_of(i) for i in got}) == want


@settings(max_examples=200)
@given(case=cases(with_must=False))
def test_spread_is_balanced(case: Case) -> None:
    """Round-robin: no GPU gets two more slices than another GPU that still had a free one."""
    got = run(case, SPREAD)
    per_gpu = Counter(case.gpu_of(i) for i in got)
    free = case.free_by_gpu()
    for n in per_gpu.values():
        for other, other_free in free.items():
            if per_gpu[other] < other_free:
                assert n <= per_gpu[other] + 1


# --- worked examples -------------------------------------------------------------------------


def ids(gpu: int, *ns: int) -> list[str]:
    return [f"GPU-{gpu}::{n}" for n in ns]


def test_pack_prefers_the_fullest_gpu_that_fits() -> None:
    inv = make_inventory([4, 4, 4])
    # GPU 0 is empty, GPU 1 has 1 used, GPU 2 has 2 used.
    available = ids(0, 0, 1, 2, 3) + ids(1, 1, 2, 3) + ids(2, 2, 3)
    assert preferred_allocation(inv, available, [], 2, PACK) == ids(2, 2, 3)
    # Three slices do not fit on GPU 2 any more: GPU 1 is the fullest that holds them.
    assert preferred_allocation(inv, available, [], 3, PACK) == ids(1, 1, 2, 3)
    assert preferred_allocation(inv, available, [], 4, PACK) == ids(0, 0, 1, 2, 3)


def test_pack_ties_go_to_the_lower_index() -> None:
    inv = make_inventory([4, 4])
    available = ids(0, 0, 1, 2, 3) + ids(1, 0, 1, 2, 3)
    assert preferred_allocation(inv, available, [], 2, PACK) == ids(0, 0, 1)


def test_pack_spans_gpus_largest_first_then_fills_a_fitting_one() -> None:
    inv = make_inventory([8, 4, 4])
    available = ids(0, *range(3, 8)) + ids(1, 0, 1, 2) + ids(2, 2, 3)
    # 7 slices: GPU 0's five free slices, then 2 more: GPU 2 (2 used) is fuller than GPU 1.
    got = preferred_allocation(inv, available, [], 7, PACK)
    assert got == ids(0, *range(3, 8)) + ids(2, 2, 3)


def test_pack_follows_must_include() -> None:
    inv = make_inventory([4, 4])
    available = ids(0, 0, 1, 2, 3) + ids(1, 0, 1, 2, 3)
    assert preferred_allocation(inv, available, ids(1, 2), 3, PACK) == ids(1, 0, 1, 2)


def test_spread_round_robin_emptiest_first() -> None:
    inv = make_inventory([4, 4, 4])
    # GPU 0 has 2 used, GPU 1 has 0, GPU 2 has 1.
    available = ids(0, 2, 3) + ids(1, 0, 1, 2, 3) + ids(2, 1, 2, 3)
    assert preferred_allocation(inv, available, [], 1, SPREAD) == ids(1, 0)
    assert preferred_allocation(inv, available, [], 2, SPREAD) == ids(1, 0) + ids(2, 1)
    assert preferred_allocation(inv, available, [], 4, SPREAD) == (
        ids(0, 2) + ids(1, 0, 1) + ids(2, 1)
    )


def test_spread_goes_to_gpus_without_must_include_first() -> None:
    inv = make_inventory([4, 4])
    available = ids(0, 0, 1, 2, 3) + ids(1, 0, 1, 2, 3)
    assert preferred_allocation(inv, available, ids(0, 3), 2, SPREAD) == ids(0, 3) + ids(1, 0)


def test_unknown_ids_fill_in_last() -> None:
    inv = make_inventory([2])
    available = ["zz-other", *ids(0, 0, 1), "aa-other"]
    assert preferred_allocation(inv, available, [], 2, PACK) == ids(0, 0, 1)
    assert preferred_allocation(inv, available, [], 3, PACK) == [*ids(0, 0, 1), "aa-other"]
    assert preferred_allocation(inv, available, ["zz-other"], 1, PACK) == ["zz-other"]


def test_size_zero_and_everything() -> None:
    inv = make_inventory([2, 2])
    available = ids(1, 1) + ids(0, 0, 1)
    assert preferred_allocation(inv, available, [], 0, PACK) == []
    assert preferred_allocation(inv, available, [], 3, SPREAD) == ids(0, 0, 1) + ids(1, 1)


def test_duplicates_in_the_request_are_collapsed() -> None:
    inv = make_inventory([4])
    available = ids(0, 0, 1, 1)
    assert preferred_allocation(inv, available, ids(0, 1, 1), 2, PACK) == ids(0, 0, 1)


# --- requests that cannot be met -------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        pytest.param(ids(0, 0, 1), [], -1, "size -1 is negative", id="negative"),
        pytest.param(ids(0, 0, 1), [], 3, "larger than the 2 available", id="too-large"),
        pytest.param(ids(0, 0, 1, 2), ids(0, 0, 1), 1, "smaller than the 2", id="must-too-many"),
        pytest.param(
            ids(0, 0, 1),
            ids(0, 3),
            2,
            'must-include device ID "GPU-0::3" is not available',
            id="must-missing",
        ),
    ],
)
def test_impossible_requests_raise(
    available: list[str], must: list[str], size: int, message: str
) -> None:
    inv = make_inventory([4])
    for policy in AllocationPolicy:
        with pytest.raises(AllocationError, match=message):
            preferred_allocation(inv, available, must, size, policy)
