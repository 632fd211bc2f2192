"""Node state shared on the event loop: values replaced whole, with waiters woken on change.

Everything here runs on the daemon's one asyncio event loop; nothing is locked because nothing is
shared with threads. Readers hold a reference to an immutable value, so a reader never sees half
an update.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

from deviceplugin.model import AllocationRecord, Slice

T = TypeVar("T")


class Published(Generic[T]):
    """A value that changes by replacement. `set` with an equal value is not a change."""

    def __init__(self, value: T) -> None:
        self._value = value
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def value(self) -> T:
        return self._value

    @property
    def version(self) -> int:
        return self._version

    def set(self, value: T) -> bool:
        """Replace the value; wake every waiter. Returns whether it changed."""
        if value == self._value:
            return False
        self._value = value
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    async def wait_change(self, seen_version: int) -> None:
        """Return once the version differs from `seen_version`."""
        while self._version == seen_version:
            await self._changed.wait()


class GrantKeeper(Protocol):
    """Where the book's grants are kept beyond the daemon's life (`deviceplugin.grants`)."""

    def made(self, record: AllocationRecord) -> None:
        """A fresh Allocate's grants, to keep (Allocate awaits `kept` before it answers)."""

    async def kept(self) -> None:
        """Until every grant handed over so far is kept."""

    def grant(self, record: AllocationRecord) -> AllocationRecord:
        """`record`, known from the kubelet without its grants, with the grants it was made
        with (kept by `made`), else those the current plan gives."""

    def forget(self, allocation_ids: Collection[str]) -> None:
        """Forget the grants of these allocations (their pods are gone)."""

    def retain(self, allocation_ids: Collection[str]) -> None:
        """Forget the grants of every allocation but these (those of pods that went while the
        daemon was away)."""


class AllocationBook:
    """Every allocation this daemon handed out or recovered, by allocation ID.

    With a `keeper`, an allocation made here has its grants kept there, one known only from
    the kubelet (pod-resources, its checkpoint) gets its grants from there, and the grants of
    allocations the book drops are forgotten; a record that arrives with grants (a DRA claim)
    keeps its own."""

    def __init__(self, keeper: GrantKeeper | None = None) -> None:
        self._keeper = keeper
        self._records: dict[str, AllocationRecord] = {}
        # Allocations the kubelet has listed at least once: gone as soon as it stops listing them.
        self._confirmed: set[str] = set()
        self._synced = False
        # Whether the keeper's grants were pruned to the book's allocations once.
        self._pruned = False
        # Resource names this node no longer serves (renamed by a reload): records made under
        # one are marked `retired_resource` when read.
        self.retired: frozenset[str] = frozenset()

    def allocated(self, record: AllocationRecord) -> None:
        """A fresh Allocate. Its ID may be an old one (the same slices again, for a new pod): the
        old pod's names and time go, and the kubelet has yet to list it."""
        if self._keeper is not None:
            self._keeper.made(record)
        self._records[record.allocation_id] = record
        self._confirmed.discard(record.allocation_id)

    async def kept(self) -> None:
        """Until the grants of every allocation made so far are kept (Allocate answers then)."""
        if self._keeper is not None:
            await self._keeper.kept()

    def _granted(self, record: AllocationRecord) -> AllocationRecord:
        if record.grants or self._keeper is None:
            return record
        return self._keeper.grant(record)

    def get(self, allocation_id: str) -> AllocationRecord | None:
        return self._records.get(allocation_id)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[AllocationRecord]:
        """Every record, `listed` saying whether the kubelet listed it at the latest refresh
        (every record counts as listed until pod-resources has answered once)."""
        retired = self.retired
        records = (
            self._records.values()
            if not retired
            else [
                r
                if (r.resource_name in retired) == r.retired_resource
                else replace(r, retired_resource=not r.retired_resource)
                for r in self._records.values()
            ]
        )
        if not self._synced:
            return iter(list(records))
        confirmed = self._confirmed
        return iter(
            [
                r if (r.allocation_id in confirmed) == r.listed else replace(r, listed=not r.listed)
                for r in records
            ]
        )

    def held_elsewhere(self, slices: Mapping[str, Slice]) -> dict[str, str]:
        """The slices held under a resource name other than the one they are served under now
        (`slices`: the inventory's, by ID), with the name they are held under: a rename must not
        offer them again while they are held."""
        held: dict[str, str] = {}
        for record in self._records.values():
            name = record.resource_name
            if not name:
                continue
            for slice_id in record.slice_ids:
                served = slices.get(slice_id)
                if served is not None and served.resource_name != name:
                    held[slice_id] = name
        return held

    def recovered(self, records: Iterable[AllocationRecord]) -> int:
        """Allocations known from elsewhere than pod-resources (the kubelet's checkpoint, while
        pod-resources does not answer): each one not in the book is added. Returns how many."""
        added = 0
        for record in records:
            if record.allocation_id not in self._records:
                self._records[record.allocation_id] = self._granted(record)
                added += 1
        return added

    def sync(
        self,
        live: Iterable[AllocationRecord],
        *,
        now_s: float,
        grace_s: float,
        keep: Collection[str] = (),
        release: Collection[str] = (),
    ) -> tuple[int, int]:
        """Bring the book in step with what the kubelet reports as live: add or name the live
        allocations; drop the others that the kubelet listed before (their pod is gone), and
        those it never listed once they are `grace_s` old. An allocation in `keep` is neither
        dropped nor doubted, listed or not (a restarted kubelet lists no pod until it has had
        them from the API server). An allocation in `release` not listed is dropped at once (a
        finished init container's, whose devices the kubelet reused). Returns (added, dropped)."""
        live_ids = set()
        added = 0
        for record in live:
            live_ids.add(record.allocation_id)
            known = self._records.get(record.allocation_id)
            if known is not None and not known.grants:
                # Granted nothing when it came (none of its slices in the plan yet): again.
                known = self._records[record.allocation_id] = self._granted(known)
            if known is None:
                added += 1
                self._records[record.allocation_id] = self._granted(record)
            elif (known.namespace, known.pod, known.container, known.init_container) != (
                record.namespace,
                record.pod,
                record.container,
                record.init_container,
            ):
                self._records[record.allocation_id] = replace(
                    known,
                    namespace=record.namespace,
                    pod=record.pod,
                    container=record.container,
                    init_container=record.init_container,
                )
        stale = [
            r.allocation_id
            for r in self._records.values()
            if r.allocation_id not in live_ids
            and r.allocation_id not in keep
            and (
                r.allocation_id in self._confirmed
                or r.allocation_id in release
                or now_s - r.allocated_at_s >= grace_s
            )
        ]
        for allocation in stale:
            del self._records[allocation]
        kept = {a for a in keep if a in self._records}
        self._confirmed = live_ids | kept
        if self._keeper is not None:
            if stale:
                self._keeper.forget(stale)
            if live_ids and not self._pruned:
                # The kubelet lists its pods: a grant kept for none of the book's allocations
                # is of a pod that went while this daemon was away.
                self._keeper.retain(self._records.keys())
                self._pruned = True
        self._synced = True
        return added, len(stale)

    def slice_ids(self) -> Iterable[str]:
        for record in self._records.values():
            yield from record.slice_ids


async def until_set(stop: asyncio.Event, event: asyncio.Event, timeout_s: float) -> None:
    """Wait until `stop` or `event` is set, or `timeout_s` passed."""
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(event.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
