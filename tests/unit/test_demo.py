"""run_demo's own clean-up: what it made before its janitor runs goes when the janitor cannot
start (the janitor removes the rest when the demo is killed: tests/security/test_demo_exit.py)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import pytest

from deviceplugin.sim import demo
from deviceplugin.sim.demo_limits import cgroup2_mount, remove_tree


def test_a_janitor_that_cannot_start_leaves_no_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(prefix: str, dir: str) -> str:
        made.append(Path(real_mkdtemp(prefix=prefix, dir=tmp_path)))
        return str(made[-1])

    def no_janitor(workdir: Path, *cgroups: Path) -> int:
        raise OSError(8, "Exec format error")

    name = f"vgpu-demo-test-{tmp_path.name}"
    monkeypatch.setattr(demo, "demo_subtree_name", lambda: name)
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(demo, "_start_janitor", no_janitor)
    mount = cgroup2_mount()  # as root, the demo's cgroup subtree is made before the janitor
    try:
        with pytest.raises(OSError, match="Exec format error"):
            demo.run_demo(1.0, io.StringIO())
        assert len(made) == 1
        assert not made[0].exists()
        assert mount is None or not (mount / name).exists()
    finally:
        if mount is not None:
            remove_tree(mount / name)
