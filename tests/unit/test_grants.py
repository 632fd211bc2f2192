"""What each allocation was granted, kept in the state directory (deviceplugin.grants), and the
allocation book that keeps them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from deviceplugin.allocation import slice_grants
from deviceplugin.config import Config, SliceRule, SlicingConfig
from deviceplugin.grants import GRANTS_FILE, GrantStore, held_changes
from deviceplugin.model import SOURCE_DRA, AllocationRecord, DeviceGrant, Inventory, allocation_id
from deviceplugin.safefs import RefusedFileError, read_bounded
from deviceplugin.state import AllocationBook
from tests.unit.test_attribution import GI, INVENTORY, UUID0, UUID1, gpu_info, sid

TWO = (sid(UUID0, 0), sid(UUID0, 1))


def made(*slice_ids: str, pod: str = "") -> AllocationRecord:
    """An allocation of `slice_ids` as Allocate makes it: granted their figures in INVENTORY."""
    return AllocationRecord(
        allocation_id(slice_ids),
        tuple(sorted(slice_ids)),
        100.0,
        namespace="ml" if pod else "",
        pod=pod,
        container="main" if pod else "",
        grants=slice_grants([INVENTORY.by_id[s] for s in sorted(slice_ids)]),
    )


def known(record: AllocationRecord) -> AllocationRecord:
    """The same allocation as the kubelet names it: its slices, no grants."""
    return AllocationRecord(
        record.allocation_id,
        record.slice_ids,
        200.0,
        namespace=record.namespace,
        pod=record.pod,
        container=record.container,
    )


def store(root: Path, inventory: Inventory = INVENTORY) -> GrantStore:
    return GrantStore(root / "state", lambda: inventory)


def resliced(replicas: int) -> Inventory:
    from deviceplugin.slicing import build_inventory
    from tests.unit.test_attribution import reading

    return build_inventory(reading(), SlicingConfig(default=SliceRule(replicas=replicas)))


def test_a_grant_kept_at_allocate_is_what_a_new_daemon_gives_the_allocation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = made(*TWO, pod="trainer")
    first = store(tmp_path)
    first.made(record)
    first.wait_kept()
    path = tmp_path / "state" / GRANTS_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # A new daemon whose plan gives each slice half as much.
    caplog.set_level(logging.WARNING)
    again = store(tmp_path, resliced(8)).grant(known(record))
    assert again.grants == record.grants == (DeviceGrant(UUID0, 40 * GI, 0.5, 2),)
    assert not caplog.records


def test_an_allocation_without_a_kept_grant_gets_the_current_plan_and_keeps_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    record = known(made(*TWO, pod="trainer"))
    keeper = store(tmp_path, resliced(8))
    granted = keeper.grant(record)
    keeper.wait_kept()
    assert granted.grants == (DeviceGrant(UUID0, 20 * GI, 0.25, 2),)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "has no kept grant; it gets the current plan's figures" in line
    assert f"allocation_id={record.allocation_id} pod=ml/trainer/" in line
    assert f"{UUID0}: memory=20Gi compute=0.25 slices=2" in line
    # Kept from then on, whatever the plan says next.
    assert store(tmp_path, INVENTORY).get(record.allocation_id) == granted.grants


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not JSON"),
        (b'{"version": 9, "allocations": {}}', "expected"),
        (b"[]", "expected"),
    ],
)
def test_an_unreadable_file_is_logged_and_every_allocation_gets_the_current_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / GRANTS_FILE).write_bytes(content)
    caplog.set_level(logging.WARNING)
    granted = store(tmp_path).grant(known(made(*TWO)))
    assert granted.grants == (DeviceGrant(UUID0, 40 * GI, 0.5, 2),)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert why in errors[0]
    assert GRANTS_FILE in errors[0]


def test_a_bad_entry_is_skipped_and_the_others_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad, elsewhere = made(*TWO), made(sid(UUID0, 2)), made(sid(UUID1, 0))
    keeper = store(tmp_path)
    for record in (good, bad, elsewhere):
        keeper.made(record)
    keeper.wait_kept()
    path = tmp_path / "state" / GRANTS_FILE
    doc = json.loads(path.read_text())
    doc["allocations"][bad.allocation_id]["grants"][0]["memory_limit_bytes"] = -1
    # A grant on a GPU that none of its slices is of: never taken.
    doc["allocations"][elsewhere.allocation_id]["grants"][0]["gpu_uuid"] = UUID0
    path.write_text(json.dumps(doc))
    caplog.set_level(logging.WARNING)
    fresh = store(tmp_path, resliced(8))
    assert fresh.get(good.allocation_id) == good.grants
    assert fresh.get(bad.allocation_id) is None
    assert fresh.get(elsewhere.allocation_id) is None
    skipped = sorted(r.getMessage() for r in caplog.records if "is skipped" in r.getMessage())
    assert len(skipped) == 2
    assert any("memory_limit_bytes is not a whole number" in line for line in skipped)
    assert any(f"grants on GPUs its slices are not of: {UUID0}" in line for line in skipped)


def test_the_file_is_never_read_through_a_symlink_or_from_a_fifo(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    elsewhere = tmp_path / "planted.json"
    record = made(*TWO)
    elsewhere.write_text(
        json.dumps(
            {
                "version": 1,
                "allocations": {
                    record.allocation_id: {
                        "slice_ids": list(record.slice_ids),
                        "grants": [
                            {
                                "gpu_uuid": UUID0,
                                "memory_limit_bytes": 80 * GI,
                                "compute_share_ratio": 1.0,
                                "slices": 2,
                            }
                        ],
                    }
                },
            }
        )
    )
    (state / GRANTS_FILE).symlink_to(elsewhere)
    caplog.set_level(logging.ERROR)
    grants = store(tmp_path)
    assert grants.grant(known(record)).grants == (DeviceGrant(UUID0, 40 * GI, 0.5, 2),)
    assert "is a symbolic link" in caplog.records[0].getMessage()
    grants.wait_kept()  # the grant just made is written (over the link) on the writer's thread
    (state / GRANTS_FILE).unlink()
    os.mkfifo(state / GRANTS_FILE)  # a reader that blocked on it would hang here
    with pytest.raises(RefusedFileError, match="not a regular file"):
        read_bounded(state / GRANTS_FILE, 1 << 20)


def test_a_file_over_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    with pytest.raises(RefusedFileError, match="more than 100 bytes"):
        read_bounded(path, 100)
    assert read_bounded(path, 101) == b"x" * 101


def test_the_book_keeps_grants_and_forgets_those_of_pods_gone(tmp_path: Path) -> None:
    keeper = store(tmp_path, resliced(8))
    book = AllocationBook(keeper)
    running, gone_while_away = made(*TWO, pod="a"), made(sid(UUID1, 0), pod="b")
    keeper.made(running)
    keeper.made(gone_while_away)
    # A restart: the kubelet lists only the first; its grant is the one it was made with.
    book.sync([known(running)], now_s=300.0, grace_s=60.0)
    record = book.get(running.allocation_id)
    assert record is not None
    assert record.grants == running.grants
    assert keeper.get(gone_while_away.allocation_id) is None
    # A fresh Allocate is kept before it is answered; its pod going forgets it.
    fresh = made(sid(UUID0, 3), pod="c")
    book.allocated(fresh)
    asyncio.run(book.kept())  # what Allocate awaits before it answers
    assert store(tmp_path).get(fresh.allocation_id) == fresh.grants
    book.sync([known(running), known(fresh)], now_s=301.0, grace_s=60.0)
    book.sync([known(running)], now_s=302.0, grace_s=60.0)
    keeper.wait_kept()
    assert store(tmp_path).get(fresh.allocation_id) is None
    assert store(tmp_path).get(running.allocation_id) == running.grants


def test_a_claim_keeps_its_own_grants_and_nothing_of_it_is_kept(tmp_path: Path) -> None:
    keeper = store(tmp_path)
    book = AllocationBook(keeper)
    claim = AllocationRecord(
        "c1aa1111c1aa1111", (), 1.0, grants=(DeviceGrant(UUID0, 3 * GI, 0.3),), source=SOURCE_DRA
    )
    book.sync([claim], now_s=2.0, grace_s=0.0)
    assert book.get(claim.allocation_id) == claim
    assert keeper.get(claim.allocation_id) is None


def test_a_reload_names_each_running_allocation_the_new_plan_would_have_changed() -> None:
    trainer, other_gpu = made(*TWO, pod="trainer"), made(sid(UUID1, 0), pod="small")
    claim = AllocationRecord(
        "c1aa1111c1aa1111", (), 1.0, grants=(DeviceGrant(UUID0, 3 * GI, 0.3),), source=SOURCE_DRA
    )
    gpus = [gpu_info(0, UUID0), gpu_info(1, UUID1)]
    same = Config(slicing=SlicingConfig(default=SliceRule(replicas=4)))
    assert held_changes([trainer, other_gpu, claim], gpus, same) == []
    eight = Config(slicing=SlicingConfig(default=SliceRule(replicas=8)))
    assert held_changes([trainer, other_gpu, claim], gpus, eight) == [
        f"a running allocation keeps what it was given allocation_id={trainer.allocation_id} "
        f"pod=ml/trainer/main gpu={UUID0} slices=2 memory=40Gi compute=0.50 "
        "new_plan_memory=20Gi new_plan_compute=0.25",
        f"a running allocation keeps what it was given allocation_id={other_gpu.allocation_id} "
        f"pod=ml/small/main gpu={UUID1} slices=1 memory=20Gi compute=0.25 "
        "new_plan_memory=10Gi new_plan_compute=0.12",
    ]


def test_an_allocation_whose_slices_are_not_in_the_plan_yet_is_granted_once_they_are(
    tmp_path: Path,
) -> None:
    plan: list[Inventory] = [Inventory()]  # the first poll has not seen its GPU yet
    book = AllocationBook(GrantStore(tmp_path / "state", lambda: plan[0]))
    record = known(made(*TWO, pod="trainer"))
    book.sync([record], now_s=1.0, grace_s=60.0)
    held = book.get(record.allocation_id)
    assert held is not None
    assert held.grants == ()
    plan[0] = INVENTORY
    book.sync([record], now_s=2.0, grace_s=60.0)
    held = book.get(record.allocation_id)
    assert held is not None
    assert held.grants == (DeviceGrant(UUID0, 40 * GI, 0.5, 2),)
