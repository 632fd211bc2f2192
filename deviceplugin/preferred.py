"""The preferred allocation among slices (docs/design.md §2). Pure: plain values in and out.

`preferred_allocation` answers the kubelet's GetPreferredAllocation. `pack` keeps a container's
slices on one GPU when it can, on the GPU that is already the fullest, so that whole GPUs stay free
for large requests; `spread` puts them on as many GPUs as it can, emptiest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deviceplugin.config import AllocationPolicy
from deviceplugin.errors import AllocationError
from deviceplugin.model import Inventory, Slice


@dataclass(slots=True)
class _GpuPool:
    """One GPU during a preferred-allocation decision."""

    index: int
    uuid: str
    free: list[Slice]  # available and not yet picked, lowest slice number first
    used: int  # slices not available before this request, plus those picked for it
    picked: int = 0
    chosen: list[Slice] = field(default_factory=list)

    @property
    def order(self) -> tuple[int, str]:
        return (self.index, self.uuid)

    def take(self, count: int) -> None:
        taken, self.free = self.free[:count], self.free[count:]
        self.chosen.extend(taken)
        self.picked += len(taken)
        self.used += len(taken)


def _unique(ids: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _check_request(available_set: set[str], must_include: list[str], size: int) -> None:
    problems: list[str] = []
    if size < 0:
        problems.append(f"allocation size {size} is negative")
    missing = [i for i in must_include if i not in available_set]
    if missing:
        problems.extend(f'must-include device ID "{i}" is not available' for i in missing)
    if size < len(must_include):
        problems.append(
            f"allocation size {size} is smaller than the {len(must_include)} "
            "must-include device IDs"
        )
    if size > len(available_set):
        problems.append(
            f"allocation size {size} is larger than the {len(available_set)} available device IDs"
        )
    if problems:
        raise AllocationError("cannot choose a preferred allocation: " + "; ".join(problems))


def _pack(pools: list[_GpuPool], remaining: int) -> None:
    """Fill the fullest GPU that holds the whole rest of the request; when none does, empty the
    GPU with the most free slices and try again, so the request spans as few GPUs as possible."""
    while remaining > 0:
        candidates = [p for p in pools if p.free]
        if not candidates:
            return
        fitting = [p for p in candidates if len(p.free) >= remaining]
        if fitting:
            best = min(fitting, key=lambda p: (-p.used, p.order))
        else:
            best = min(candidates, key=lambda p: (-len(p.free), -p.used, p.order))
        count = min(remaining, len(best.free))
        best.take(count)
        remaining -= count


def _spread(pools: list[_GpuPool], remaining: int) -> None:
    """Round-robin, one slice at a time: the GPU with the fewest slices of this request so far,
    then the fewest used slices, then the lowest index."""
    base_used = {p.uuid: p.used - p.picked for p in pools}
    while remaining > 0:
        candidates = [p for p in pools if p.free]
        if not candidates:
            return
        best = min(candidates, key=lambda p: (p.picked, base_used[p.uuid], p.order))
        best.take(1)
        remaining -= 1


def preferred_allocation(
    inventory: Inventory,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: AllocationPolicy,
) -> list[str]:
    """Choose `size` device IDs out of `available`, including every `must_include` ID.

    The result is in inventory order (GPU index, then slice number); IDs we do not know come last
    and are only chosen when the known ones run out. Raises AllocationError when no such choice
    exists."""
    available_ids = _unique(available)
    must_ids = _unique(must_include)
    available_set = set(available_ids)
    _check_request(available_set, must_ids, size)

    must_set = set(must_ids)
    pools: dict[str, _GpuPool] = {}
    # One pass over every slice of the node on every call: kept to set lookups and appends.
    pool = _GpuPool(-1, "", [], 0)
    for s in inventory.slices:
        uuid = s.id.gpu_uuid
        if uuid != pool.uuid:
            found = pools.get(uuid)
            if found is None:
                found = pools[uuid] = _GpuPool(s.gpu_index, uuid, [], 0)
            pool = found
        device_id = s.device_id
        if device_id in must_set:
            pool.chosen.append(s)
            pool.picked += 1
            pool.used += 1
        elif device_id in available_set:
            pool.free.append(s)
        else:
            pool.used += 1
    ordered_pools = sorted(pools.values(), key=lambda p: p.order)

    remaining = size - len(must_ids)
    if policy == AllocationPolicy.SPREAD:
        _spread(ordered_pools, remaining)
    else:
        _pack(ordered_pools, remaining)

    chosen = sorted(
        (s for p in ordered_pools for s in p.chosen),
        key=lambda s: (s.gpu_index, s.id.gpu_uuid, s.id.n),  # SliceId's order, without its __lt__
    )
    result = [s.device_id for s in chosen]
    unknown_must = sorted(i for i in must_ids if i not in inventory.by_id)
    result.extend(unknown_must)
    shortfall = size - len(result)
    if shortfall > 0:
        spare = sorted(i for i in available_ids if i not in inventory.by_id and i not in must_set)
        result.extend(spare[:shortfall])
    assert len(result) == size, (result, size)
    return result


__all__ = ["preferred_allocation"]
