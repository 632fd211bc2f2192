"""Monitor mode (deviceplugin/enforcement_mode.py) through the whole daemon: an NVIDIA-format
config decides, logs and counts what it would do and signals nothing, until enforcement is
turned on; a vgpu-format config is enforced as it says; a live reload between the two formats
switches the mode. The over-limit workloads are real processes this test spawns (Workloads
resumes and kills them at the end)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import (
    Config,
    ConfigFormat,
    EnforcementConfig,
    MemoryEnforcement,
    config_from_bytes,
)
from deviceplugin.gpu.fake import FakeProcess
from tests.blackbox.daemon_harness import (
    TWO_GPUS,
    GiB,
    Node,
    Workloads,
    eventually,
    registered,
    running_daemon,
    with_processes,
)
from tests.blackbox.test_enforcement_daemon import alive

NVIDIA = b"""\
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
# The same plan in vgpu's format: a reload between the two keeps every slice.
VGPU = b"""\
version: v1
resourceName: nvidia.com/gpu
slicing: {replicas: 4}
"""
RESOURCE = "nvidia.com/gpu"
# Polls every 50 ms, memory over its limit for 200 ms acted on: the file's other settings kept.
QUICK = EnforcementConfig(
    poll_interval_s=0.05, idle_poll_interval_s=0.05, memory=MemoryEnforcement(grace_period_s=0.2)
)


def quick(content: bytes) -> Config:
    config = config_from_bytes(content, "config.yaml")
    return dataclasses.replace(config, enforcement=QUICK)


async def over_its_limit(node: Node, workloads: Workloads, pod: str) -> int:
    """A one-slice container of `pod` whose process holds a GiB more than its slice: the only
    GPU process of the node."""
    grant = (await node.sim.admit_pod(pod, [("c", 1)], resource_name=RESOURCE)).containers[0]
    uuid = grant.device_ids[0].rsplit("::", 1)[0]
    gpu = next(g for g in TWO_GPUS if g.uuid == uuid)
    pid = workloads.spawn(grant.envs)
    over = FakeProcess(pid, gpu.memory_total_bytes // 4 + GiB, 10)
    node.write_gpus([with_processes(g, over) if g is gpu else g for g in TWO_GPUS])
    return pid


def counted(daemon: Daemon, action: str) -> int:
    assert daemon.enforcer is not None
    return sum(c.count for c in daemon.enforcer.counts() if c.action == action)


async def test_an_nvidia_config_records_what_it_would_kill_and_kills_nothing(
    node: Node, workloads: Workloads, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    config = quick(NVIDIA)
    assert config.format is ConfigFormat.NVIDIA
    async with running_daemon(node, config) as daemon:
        await registered(node, 8, RESOURCE)
        hog = await over_its_limit(node, workloads, "hog")
        await eventually(lambda: counted(daemon, "would_kill") == 1, 10, "a would_kill")
        assert alive(hog)
        assert counted(daemon, "kill") == 0
    messages = [r.getMessage() for r in caplog.records]
    (start,) = [m for m in messages if m.startswith("enforcement: monitor mode")]
    assert "--enforce-nvidia-config true" in start
    (kill,) = [m for m in messages if m.startswith("memory limit exceeded")]
    assert "action=would_kill" in kill
    assert f"pid={hog}" in kill
    assert "sent=false (dry run: would kill)" in kill


async def test_enforcement_turned_on_kills_with_the_same_nvidia_file(
    node: Node, workloads: Workloads
) -> None:
    async with running_daemon(node, quick(NVIDIA), enforce_nvidia_config=True) as daemon:
        await registered(node, 8, RESOURCE)
        hog = await over_its_limit(node, workloads, "hog")
        await eventually(lambda: not alive(hog), 10, "the over-limit process killed")
        assert counted(daemon, "kill") == 1
        assert counted(daemon, "would_kill") == 0


async def test_a_reload_between_the_formats_switches_the_mode(
    node: Node, workloads: Workloads, caplog: pytest.LogCaptureFixture
) -> None:
    """vgpu's format enforces as it says; reloaded to NVIDIA's the daemon only records, and
    back to vgpu's it enforces again."""
    async with running_daemon(node, quick(VGPU)) as daemon:
        await registered(node, 8, RESOURCE)
        first = await over_its_limit(node, workloads, "first")
        await eventually(lambda: not alive(first), 10, "the first over-limit process killed")

        await daemon.apply_config(quick(NVIDIA))
        assert daemon.config.enforcement.dry_run
        second = await over_its_limit(node, workloads, "second")
        await eventually(lambda: counted(daemon, "would_kill") == 1, 10, "a would_kill")
        assert alive(second)

        await daemon.apply_config(quick(VGPU))
        assert not daemon.config.enforcement.dry_run
        await eventually(lambda: not alive(second), 10, "the second killed once enforced")
    reloads = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("config reload: enforcement")
    ]
    assert len(reloads) == 2
    assert reloads[0].startswith("config reload: enforcement: monitor mode")
    assert reloads[1] == "config reload: enforcement: on, as the config says"
