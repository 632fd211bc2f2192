"""The driver's GPU memory partitions on one GPU, as a model: the rules the fake backend follows,
and the NVML driver model in the tests too (docs/design.md §15 gives their sources).

Cgroups are named by their path from the hierarchy's root ("/kubepods/pod.../<id>"; "/" is the
root); a `CgroupTree` says which exist and which have `dmem.*` files. Per cgroup the model keeps
what the driver would: a soft and a hard limit (on dmem, the cgroup's `dmem.min` and `dmem.max`),
and the memory charged to it.

- **Set** needs an existing cgroup other than the root (NOT_FOUND, NOT_SUPPORTED), on dmem one
  with dmem files (NOT_FOUND), and soft <= hard (INVALID_ARGUMENT). Soft 0 with hard MAX clears.
- **dmem**: setting a cgroup's soft limit adds the change to the `dmem.min` of every ancestor up
  to the first without dmem files (a gap stops it), so an ancestor carries the sum of its leaves'
  soft limits. A cgroup removed without its soft limit zeroed first leaves its share in every
  ancestor: the leak the daemon repairs by setting the ancestor back to the sum of the leaves it
  knows (a set on an ancestor changes its own `dmem.min`, and the change propagates the same
  way). An allocation is charged to the cgroup and every ancestor and fails where any of their
  hard limits would be passed. Get of a cgroup with nothing set: NOT_FOUND.
- **misc**: no hierarchy: an allocation is checked against the nearest limited ancestor-or-self
  only (a limited child is not bounded by its parent), and Get reads that nearest limit
  (NOT_SUPPORTED when there is none). A removed cgroup's entry is dropped.
- **Reporting**: `mem_get_info` (what `cuMemGetInfo` returns inside the cgroup) shows the hard
  limit as the total only when the cgroup itself is limited; the physical memory otherwise.
- Physical memory bounds every allocation.

Pure: the tree is handed in; `clock` gives the wall time a limit was set at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from deviceplugin.partitions import (
    LIMIT_MAX,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    cgroup_ancestors,
    nvml_code_name,
)

Store = Literal["dmem", "misc"]
STORES: tuple[Store, ...] = ("dmem", "misc")


class PartitionCodeError(Exception):
    """A call the driver would refuse: `code` is the NVML return code it would give."""

    def __init__(self, code: int, why: str) -> None:
        self.code = code
        super().__init__(f"{nvml_code_name(code)}: {why}")


class CgroupTree(Protocol):
    """Which cgroups exist (paths from the hierarchy's root) and which have dmem files."""

    def exists(self, cgroup: str) -> bool: ...

    def has_dmem_files(self, cgroup: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Limit:
    """A cgroup's limits on one GPU, in bytes, and the wall time they were last set."""

    soft_bytes: int
    hard_bytes: int
    set_at_s: float


def valid_cgroup(cgroup: str) -> bool:
    """A plain absolute path: no empty, `.` or `..` component."""
    if cgroup == "/":
        return True
    parts = cgroup.split("/")
    return cgroup.startswith("/") and all(p not in ("", ".", "..") for p in parts[1:])


def _within(cgroup: str, top: str) -> bool:
    return top in ("/", cgroup) or cgroup.startswith(top + "/")


class PartitionRules:
    """One GPU's partitions under one store. Not thread-safe: callers hold their own lock."""

    def __init__(
        self,
        store: Store,
        tree: CgroupTree,
        capacity_bytes: int,
        clock: Callable[[], float],
        *,
        limits: dict[str, Limit] | None = None,
    ) -> None:
        if store not in STORES:
            raise ValueError(f"memory partition store {store!r} is none of {STORES}")
        self.store: Store = store
        self.tree = tree
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        # Per cgroup with anything set: on dmem every ancestor that carries a leaf's soft share.
        self.limits: dict[str, Limit] = dict(limits or {})
        self.usage: dict[str, int] = {}

    # -- set and get -------------------------------------------------------------------------

    def _existing(self, cgroup: str) -> None:
        if not valid_cgroup(cgroup) or not self.tree.exists(cgroup):
            raise PartitionCodeError(NVML_ERROR_NOT_FOUND, f"no cgroup {cgroup}")
        if cgroup == "/":
            raise PartitionCodeError(NVML_ERROR_NOT_SUPPORTED, "the root cgroup takes no limit")

    def set(self, cgroup: str, soft_bytes: int, hard_bytes: int) -> None:
        self._existing(cgroup)
        if self.store == "dmem" and not self.tree.has_dmem_files(cgroup):
            raise PartitionCodeError(
                NVML_ERROR_NOT_FOUND, f"{cgroup} has no dmem files (its parent lacks +dmem)"
            )
        if not 0 <= soft_bytes <= hard_bytes <= LIMIT_MAX:
            raise PartitionCodeError(
                NVML_ERROR_INVALID_ARGUMENT, f"soft {soft_bytes} above hard {hard_bytes}"
            )
        now = self.clock()
        before = self.limits.get(cgroup)
        delta = soft_bytes - (before.soft_bytes if before else 0)
        self._put(cgroup, soft_bytes, hard_bytes, now)
        if self.store == "dmem" and delta:
            for parent in cgroup_ancestors(cgroup):
                if not self.tree.has_dmem_files(parent):
                    break  # a gap: the driver's walk stops here
                above = self.limits.get(parent)
                soft = max(0, (above.soft_bytes if above else 0) + delta)
                self._put(parent, soft, above.hard_bytes if above else LIMIT_MAX, now)

    def _put(self, cgroup: str, soft_bytes: int, hard_bytes: int, now: float) -> None:
        if soft_bytes == 0 and hard_bytes == LIMIT_MAX:
            self.limits.pop(cgroup, None)
        else:
            self.limits[cgroup] = Limit(soft_bytes, hard_bytes, now)

    def get(self, cgroup: str) -> tuple[int, int, int]:
        """(soft, hard, used) as NVML's Get reads them."""
        self._existing(cgroup)
        if self.store == "dmem":
            found = self.limits.get(cgroup)
            if found is None:
                raise PartitionCodeError(NVML_ERROR_NOT_FOUND, f"no limit set on {cgroup}")
            return found.soft_bytes, found.hard_bytes, self.used_below(cgroup)
        nearest = self._nearest_limited(cgroup, any_limit=True)
        if nearest is None:
            raise PartitionCodeError(NVML_ERROR_NOT_SUPPORTED, f"no limit at or above {cgroup}")
        found = self.limits[nearest]
        return found.soft_bytes, found.hard_bytes, self._charged_to(nearest)

    def forget_removed(self) -> list[tuple[str, Limit]]:
        """Drop what the driver drops with a removed cgroup: its own entry (and its charges). On
        dmem its ancestors keep the soft share it leaves behind. The entries dropped."""
        gone = [(c, limit) for c, limit in self.limits.items() if not self.tree.exists(c)]
        for cgroup, _ in gone:
            del self.limits[cgroup]
        for cgroup in [c for c in self.usage if not self.tree.exists(c)]:
            del self.usage[cgroup]
        return gone

    # -- allocation and reporting ------------------------------------------------------------

    def used_below(self, cgroup: str) -> int:
        return sum(n for c, n in self.usage.items() if _within(c, cgroup))

    def _nearest_limited(self, cgroup: str, *, any_limit: bool = False) -> str | None:
        for candidate in (cgroup, *cgroup_ancestors(cgroup)):
            found = self.limits.get(candidate)
            if found is not None and (any_limit or found.hard_bytes != LIMIT_MAX):
                return candidate
        return None

    def _charged_to(self, limited: str) -> int:
        """misc: the memory of the cgroups whose nearest hard-limited ancestor-or-self is this."""
        return sum(n for c, n in self.usage.items() if self._nearest_limited(c) == limited)

    def headroom(self, cgroup: str) -> int:
        """The most a process in `cgroup` can allocate now: the GPU's free memory, bounded on
        dmem by every limited ancestor-or-self, on misc by the nearest limited one."""
        room = self.capacity_bytes - sum(self.usage.values())
        if self.store == "dmem":
            for node in (cgroup, *cgroup_ancestors(cgroup)):
                found = self.limits.get(node)
                if found is not None and found.hard_bytes != LIMIT_MAX:
                    room = min(room, found.hard_bytes - self.used_below(node))
        else:
            nearest = self._nearest_limited(cgroup)
            if nearest is not None:
                room = min(room, self.limits[nearest].hard_bytes - self._charged_to(nearest))
        return max(0, room)

    def charge(self, cgroup: str, nbytes: int) -> bool:
        """An allocation of `nbytes` by a process in `cgroup`; False (out of memory) where a hard
        limit or the GPU's memory would be passed."""
        if sum(self.usage.values()) + nbytes > self.capacity_bytes:
            return False
        if self.store == "dmem":
            for node in (cgroup, *cgroup_ancestors(cgroup)):
                found = self.limits.get(node)
                if found is not None and self.used_below(node) + nbytes > found.hard_bytes:
                    return False
        else:
            nearest = self._nearest_limited(cgroup)
            hard = self.limits[nearest].hard_bytes if nearest is not None else LIMIT_MAX
            if nearest is not None and self._charged_to(nearest) + nbytes > hard:
                return False
        self.usage[cgroup] = self.usage.get(cgroup, 0) + nbytes
        return True

    def release(self, cgroup: str, nbytes: int) -> None:
        left = self.usage.get(cgroup, 0) - nbytes
        if left > 0:
            self.usage[cgroup] = left
        else:
            self.usage.pop(cgroup, None)

    def mem_get_info(self, cgroup: str) -> tuple[int, int]:
        """(free, total) as `cuMemGetInfo` reports them to a process in `cgroup`."""
        physical_free = max(0, self.capacity_bytes - sum(self.usage.values()))
        own = self.limits.get(cgroup)
        if own is None or own.hard_bytes == LIMIT_MAX:
            return physical_free, self.capacity_bytes
        used = self.used_below(cgroup) if self.store == "dmem" else self._charged_to(cgroup)
        return max(0, min(own.hard_bytes - used, physical_free)), own.hard_bytes
