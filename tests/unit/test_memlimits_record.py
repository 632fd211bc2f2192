"""The memory-limit record in the state directory (deviceplugin/memlimits/record.py) and the
hook's wire protocol (deviceplugin/memlimits/hookserver.py)."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from deviceplugin.memlimits.hookserver import RequestError, answer, parse_request
from deviceplugin.memlimits.record import (
    RECORD_NAME,
    AppliedLimit,
    GrantLimits,
    LeafRecord,
    LimitRecord,
)
from deviceplugin.partitions import GpuLimit, PartitionMode
from tests.support.cgroup_tree import leaf_of

GiB = 1 << 30
LEAF = leaf_of("app")


def a_leaf() -> LeafRecord:
    leaf = LeafRecord(LEAF, "/kubepods", "uid", "c" * 64)
    leaf = leaf.with_grant(GrantLimits("alloc-a", (("GPU-0", GpuLimit(GiB, 4 * GiB)),)))
    leaf = leaf.with_grant(
        GrantLimits("alloc-b", (("GPU-0", GpuLimit(0, 2 * GiB)), ("GPU-1", GpuLimit(0, GiB))))
    )
    leaf = leaf.with_applied(
        AppliedLimit("GPU-0", GpuLimit(GiB, 6 * GiB), PartitionMode.DMEM, 1796422981.5)
    )
    return leaf.with_applied(AppliedLimit("GPU-1", GpuLimit(0, GiB), PartitionMode.MISC, None))


def record(tmp_path: Path, boot: str = "boot-1") -> LimitRecord:
    return LimitRecord(tmp_path, boot=lambda: boot, wall_clock=lambda: 1796422981.0)


def test_a_containers_grants_add_up_per_gpu() -> None:
    assert a_leaf().totals() == {"GPU-0": GpuLimit(GiB, 6 * GiB), "GPU-1": GpuLimit(0, GiB)}
    # A grant asked for again replaces itself.
    again = a_leaf().with_grant(GrantLimits("alloc-a", (("GPU-0", GpuLimit(0, GiB)),)))
    assert again.totals()["GPU-0"] == GpuLimit(0, 3 * GiB)


def test_the_record_round_trips_owner_only_with_rfc3339_times(tmp_path: Path) -> None:
    first = record(tmp_path)
    first.put(a_leaf())
    first.save()
    path = tmp_path / RECORD_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["boot_id"] == "boot-1"
    applied = doc["leaves"][0]["applied"]
    assert applied["GPU-0"]["set_at"] == "2026-12-04T22:23:01.500000Z"
    assert applied["GPU-1"]["set_at"] is None  # being set when the record was written
    second = record(tmp_path)
    second.load()
    assert second.get(LEAF) == a_leaf()
    assert second.soft_below("/kubepods", "GPU-0") == GiB
    assert second.soft_below(LEAF, "GPU-0") == 0  # the leaf itself is not below itself


def test_a_record_of_another_boot_is_void(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    first = record(tmp_path, "boot-1")
    first.put(a_leaf())
    first.save()
    after_reboot = record(tmp_path, "boot-2")
    after_reboot.load()
    assert len(after_reboot) == 0
    assert "of an earlier boot" in caplog.text


def test_bad_entries_are_skipped_and_a_bad_file_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = record(tmp_path)
    good.put(a_leaf())
    good.save()
    doc = json.loads((tmp_path / RECORD_NAME).read_text())
    outside = dict(doc["leaves"][0], cgroup="/system.slice/sshd.service")
    climbing = dict(doc["leaves"][0], cgroup="/kubepods/../etc")
    bad_limit = json.loads(json.dumps(doc["leaves"][0]))
    bad_limit["applied"]["GPU-0"]["soft_bytes"] = 10 * GiB  # above its hard limit
    doc["leaves"] += [outside, climbing, bad_limit, "junk"]
    (tmp_path / RECORD_NAME).write_text(json.dumps(doc))
    read = record(tmp_path)
    read.load()
    assert [leaf.cgroup for leaf in read] == [LEAF]
    assert caplog.text.count("memory-limit record entry skipped") == 4
    (tmp_path / RECORD_NAME).write_text("{not json")
    broken = record(tmp_path)
    broken.load()
    assert len(broken) == 0
    assert (tmp_path / f"{RECORD_NAME}.unreadable-1796422981").read_text() == "{not json"
    assert not (tmp_path / RECORD_NAME).exists()


def test_the_record_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    (tmp_path / RECORD_NAME).symlink_to(target)
    first = record(tmp_path)
    first.put(a_leaf())
    first.save()
    assert target.read_text() == "precious"
    assert not (tmp_path / RECORD_NAME).is_symlink()


# -- the wire ------------------------------------------------------------------------------------


def test_a_request_line() -> None:
    assert parse_request(b"VGPU-HOOK 1 apply 4242 3f1c9a0b2d4e6f70\n") == (
        4242,
        "3f1c9a0b2d4e6f70",
    )
    assert parse_request(b"VGPU-HOOK 1 apply 7 GPU-a1b2::0=x.y_z-1") == (7, "GPU-a1b2::0=x.y_z-1")


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"\n",
        b"VGPU-HOOK 2 apply 1 a\n",
        b"VGPU-HOOK 1 clear 1 a\n",
        b"VGPU-HOOK 1 apply 0 a\n",
        b"VGPU-HOOK 1 apply 01 a\n",
        b"VGPU-HOOK 1 apply -1 a\n",
        b"VGPU-HOOK 1 apply 99999999 a\n",
        b"VGPU-HOOK 1 apply 1 a b\n",
        b"VGPU-HOOK 1 apply 1 ../../etc\n",
        b"VGPU-HOOK 1 apply 1 " + b"a" * 257 + b"\n",
        b"VGPU-HOOK 1 apply 1 \xff\n",
        b"VGPU-HOOK  1 apply 1 a\n",
    ],
)
def test_anything_else_is_refused(line: bytes) -> None:
    with pytest.raises(RequestError):
        parse_request(line)


def test_answers_are_one_printable_line() -> None:
    summary = "GPU-0 soft=0 hard=1 driver-dmem"
    assert answer(True, summary) == f"OK {summary}\n".encode()
    assert answer(False, "bad\nthing\x1b") == b"ERR bad?thing?\n"
    assert len(answer(False, "x" * 5000)) < 1100
