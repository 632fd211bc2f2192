"""Where the demo cannot make a container's cgroup, it says why in one line and leaves the
driver-limited container out (deviceplugin/sim/demo_limits.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deviceplugin.sim import demo_limits
from deviceplugin.sim.demo_limits import DriverLimits, cgroup2_mount, remove_tree


def test_without_root_it_is_left_out_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert DriverLimits.prepare("vgpu-demo-x") == (None, "making a container's cgroup needs root")


def test_without_cgroup_v2_it_is_left_out_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
    assert cgroup2_mount(mounts) is None
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(demo_limits, "cgroup2_mount", lambda: None)
    assert DriverLimits.prepare("vgpu-demo-x") == (None, "this machine has no cgroup v2 hierarchy")


def test_a_hierarchy_it_cannot_write_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(demo_limits, "cgroup2_mount", lambda: tmp_path / "absent")
    limits, why = DriverLimits.prepare("vgpu-demo-x")
    assert limits is None
    assert why.startswith(f"the cgroup v2 hierarchy at {tmp_path / 'absent'} is not writable")


def test_the_cgroup2_mount_is_found_on_a_hybrid_host(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "tmpfs /sys/fs/cgroup tmpfs ro 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nsdelegate 0 0\n"
        "cgroup /sys/fs/cgroup/pids cgroup rw,pids 0 0\n"
    )
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")


def test_a_container_cgroup_is_in_the_kubelets_layout_and_removed_with_its_subtree(
    tmp_path: Path,
) -> None:
    (tmp_path / "vgpu-demo-x").mkdir()
    limits = DriverLimits(tmp_path, "vgpu-demo-x")
    uid = "546f7bc7-0bb0-424b-be11-8318c7292a10"
    leaf = limits.container_cgroup(uid, "trainer")
    relative = leaf.relative_to(tmp_path).as_posix()
    assert re.fullmatch(rf"vgpu-demo-x/kubepods/burstable/pod{uid}/[0-9a-f]{{64}}", relative)
    assert limits.root == "/vgpu-demo-x"
    assert remove_tree(limits.top)
    assert not limits.top.exists()
