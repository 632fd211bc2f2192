"""The demo's driver-limited container beside a polled one (docs/design.md §15): as root, with a
writable cgroup v2 hierarchy, the demo starts one container's process in a real cgroup of the
kubelet's layout, asks the daemon's hook socket to limit it, and the fake L4's driver then holds
it at its hard limit (no kill), while the enforcer kills the polled notebook on the A100; the
demo's cgroups are gone when it ends."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from deviceplugin.sim.demo_limits import DriverLimits, cgroup2_mount


def _why_not_limited() -> str:
    """Why the demo cannot make a container's cgroup here; "" when it can."""
    limits, why = DriverLimits.prepare(f"vgpu-test-probe-{uuid.uuid4().hex[:8]}")
    if limits is not None:
        assert limits.remove()
    return why


def test_the_driver_holds_one_container_at_its_limit_and_the_enforcer_kills_a_polled_one() -> None:
    why = _why_not_limited()
    if why:
        pytest.skip(f"the demo's driver-limited container needs root and cgroup v2: {why}")
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--duration", "6"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The container's process, in its own cgroup, was limited by the hook before it used memory.
    cgroup = re.search(
        r"in its own cgroup v2, in the kubelet's layout: (/vgpu-demo-[0-9a-f]+)/", out
    )
    assert cgroup is not None, out
    assert re.search(r"answered: OK GPU-9b2e\S+ soft=\d+ hard=\d+ driver-dmem", out), out
    # Over its limit: the driver held it there, and it still runs.
    held = re.search(
        r"driver: held default/capped/trainer \(pid (\d+)\) at its 5\.6Gi hard limit: it asked "
        r"for 9Gi, got 5\.6Gi",
        out,
    )
    assert held is not None, out
    assert f"process {held.group(1)} of default/capped/trainer has exited" not in out
    assert "killed the largest GPU process of default/capped/trainer" not in out
    end = out[out.index("the status view at the end:") :]
    assert "  memory limits: driver-dmem" in end
    assert re.search(r"default/capped/trainer  1 slice  driver\n\s+mem \[#+\]\s+5\.6Gi/5\.6Gi", end)
    # The notebook, polled on a GPU without partitions, was killed after its grace period.
    assert "  memory limits: poll (no-partitions)" in end
    assert "killed the largest GPU process of default/notebook/jupyter" in out
    assert re.search(r"process \d+ of default/notebook/jupyter has exited \(SIGKILL\)", out)
    mount = cgroup2_mount()
    assert mount is not None
    assert not (mount / cgroup.group(1).lstrip("/")).exists(), "the demo's cgroups are left"
