"""The demo leaves nothing behind however it ends: no stopped process, no orphan, no directory,
no cgroup (where, as root, it made its driver-limited container's); closing its terminal (SIGHUP)
stops it as cleanly as Ctrl-C, and even SIGKILL leaves nothing."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deviceplugin.sim.demo_limits import cgroup2_mount


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_the_demo_leaves_nothing_behind(sig: signal.Signals) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "deviceplugin", "demo", "--duration", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: list[psutil.Process] = []
    try:
        assert demo.stdout is not None
        workdir: Path | None = None
        cgroups: Path | None = None  # the demo's cgroup subtree, when it made one
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            assert line, f"the demo ended early: {''.join(lines)}"
            lines.append(line)
            found = re.search(r"kubelet in (/\S+)", line)
            if found:
                workdir = Path(found.group(1))
            subtree = re.search(r"in the kubelet's layout: /(vgpu-demo-[0-9a-f]+)/", line)
            mount = cgroup2_mount()
            if subtree and mount is not None:
                cgroups = mount / subtree.group(1)
                assert cgroups.is_dir()
            if line.startswith("running for"):
                break
        assert workdir is not None
        assert workdir.exists()
        # Let the enforcer throttle the inference server: some workload is then often stopped.
        time.sleep(1.5)
        children = psutil.Process(demo.pid).children(recursive=True)
        workloads = [c for c in children if c.name() == "sleep"]
        assert workloads, "the demo runs no workload"
        demo.send_signal(sig)
        code = demo.wait(timeout=30)
        if sig is signal.SIGHUP:
            assert code == 0, demo.stderr.read() if demo.stderr else ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (
                all(_gone(c.pid) for c in children)
                and not workdir.exists()
                and (cgroups is None or not cgroups.exists())
            ):
                break
            time.sleep(0.05)
        left = {c.pid: _state(c.pid) for c in children if not _gone(c.pid)}
        assert left == {}, f"processes left behind: {left}"
        assert not workdir.exists(), f"{workdir} left behind"
        assert cgroups is None or not cgroups.exists(), f"{cgroups} left behind"
    finally:
        for child in children:
            try:
                child.send_signal(signal.SIGCONT)
                child.kill()
            except psutil.Error:
                pass
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
