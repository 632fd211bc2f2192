"""The allocation book and published values: what the daemon knows about who holds what."""

from __future__ import annotations

import asyncio

from deviceplugin.model import AllocationRecord
from deviceplugin.state import AllocationBook, Published


def rec(allocation: str, at: float = 0.0, pod: str = "", container: str = "") -> AllocationRecord:
    return AllocationRecord(
        allocation, (f"GPU-a::{allocation}",), at, "ns" if pod else "", pod, container
    )


def test_sync_names_known_allocations_and_adds_the_ones_made_before_a_restart() -> None:
    book = AllocationBook()
    book.allocated(rec("a", at=100.0))
    added, dropped = book.sync(
        [rec("a", pod="web", container="srv"), rec("b", pod="db")], now_s=101, grace_s=60
    )
    assert (added, dropped) == (1, 0)
    a = book.get("a")
    assert a is not None
    assert (a.pod, a.container, a.allocated_at_s) == ("web", "srv", 100.0)
    assert book.get("b") is not None


def test_an_allocation_the_kubelet_stops_listing_is_dropped_at_once() -> None:
    book = AllocationBook()
    book.sync([rec("a", pod="web")], now_s=100, grace_s=60)
    assert book.sync([], now_s=101, grace_s=60) == (0, 1)
    assert book.get("a") is None


def test_a_fresh_allocation_not_listed_yet_is_kept_for_the_grace_period() -> None:
    book = AllocationBook()
    book.allocated(rec("a", at=100.0))
    assert book.sync([], now_s=130, grace_s=60) == (0, 0)
    assert book.get("a") is not None
    assert book.sync([], now_s=161, grace_s=60) == (0, 1)


def test_the_same_slices_allocated_again_start_a_new_record() -> None:
    # A deleted pod's slices handed to a new pod give the same allocation ID: the new one must
    # not inherit the old pod's names, nor be dropped before the kubelet lists it.
    book = AllocationBook()
    book.allocated(rec("a", at=100.0))
    book.sync([rec("a", pod="old")], now_s=101, grace_s=60)
    book.sync([], now_s=102, grace_s=60)  # the old pod is gone
    book.allocated(rec("a", at=103.0))
    assert book.sync([], now_s=104, grace_s=60) == (0, 0)
    fresh = book.get("a")
    assert fresh is not None
    assert (fresh.pod, fresh.allocated_at_s) == ("", 103.0)


async def test_published_wakes_waiters_only_on_a_real_change() -> None:
    value = Published(1)
    seen = value.version
    waiter = asyncio.create_task(value.wait_change(seen))
    assert not value.set(1)
    await asyncio.sleep(0)
    assert not waiter.done()
    assert value.set(2)
    await asyncio.wait_for(waiter, 1)
    assert value.value == 2
