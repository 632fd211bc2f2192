"""A rename of `resourceName` never loses or double-hands held slices: allocations held under the
old name stay known and enforced until the kubelet frees them, their slices are offered under no
name meanwhile, and /status says which allocations belong to a retired name. Also across a
restart of the daemon after the rename."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import Config, MemoryEnforcement
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.sim.kubelet import AdmissionError
from tests.blackbox.daemon_harness import (
    FAST,
    RESOURCE,
    TWO_GPUS,
    GiB,
    Node,
    Workloads,
    eventually,
    plugins,
    registered,
    running_daemon,
    with_processes,
)

RENAMED = "example.com/gpu-share"
KILL_FAST = Config(
    enforcement=dataclasses.replace(FAST, memory=MemoryEnforcement(grace_period_s=0.2))
)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def status(daemon: Daemon) -> dict[str, Any]:
    assert daemon.http is not None
    url = f"http://127.0.0.1:{daemon.http.port}/status"
    with urllib.request.urlopen(url, timeout=5) as response:
        document: dict[str, Any] = json.load(response)
    return document


async def status_of(daemon: Daemon, allocation: str) -> dict[str, Any] | None:
    doc = await asyncio.to_thread(status, daemon)
    return next((a for a in doc["allocations"] if a["allocation_id"] == allocation), None)


async def test_a_renamed_resource_keeps_enforcing_what_is_held_under_the_old_name(
    node: Node, workloads: Workloads
) -> None:
    async with running_daemon(node, KILL_FAST, pod_resources_interval_s=0.2) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("hog", [("main", 1)])).containers[0]
        allocation = grant.envs["VGPU_ALLOCATION_ID"]
        await daemon.apply_config(dataclasses.replace(KILL_FAST, resource_name=RENAMED))
        await registered(node, 8, resource=RENAMED)
        # pod-resources is asked a few times under the new name: the allocation stays.
        seen = plugins(daemon).tracker.refreshes
        await eventually(lambda: plugins(daemon).tracker.refreshes >= seen + 3, 10, "refreshes")
        shown = await status_of(daemon, allocation)
        assert shown is not None, "the allocation held under the old name was forgotten"
        assert shown["resource_name"] == RESOURCE
        assert shown["retired"] is True
        assert node.sim.unhealthy_ids(RENAMED) == set(grant.device_ids)
        with pytest.raises(AdmissionError):
            await node.sim.admit_pod("twice", [("main", 8)], resource_name=RENAMED)
        # Its process goes over its limit: it is killed, as before the rename.
        uuid = grant.device_ids[0].rsplit("::", 1)[0]
        gpu = next(g for g in TWO_GPUS if g.uuid == uuid)
        hog = workloads.spawn(grant.envs)
        node.write_gpus(
            [
                with_processes(g, FakeProcess(hog, gpu.memory_total_bytes // 4 + GiB, 10))
                if g is gpu
                else g
                for g in TWO_GPUS
            ]
        )
        await eventually(lambda: not alive(hog), 10, "the over-limit process killed")


async def test_a_daemon_restarted_after_a_rename_still_holds_the_old_names_slices(
    node: Node,
) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("held", [("main", 2)])).containers[0]
    allocation = grant.envs["VGPU_ALLOCATION_ID"]
    # The daemon comes back with the new name only: pod-resources still lists the pod's slices
    # under the old one.
    config = Config(enforcement=FAST, resource_name=RENAMED)
    async with running_daemon(node, config, pod_resources_interval_s=0.2) as daemon:
        await registered(node, 8, resource=RENAMED)
        # From the very first device list on, not only once pod-resources has been asked.
        assert node.sim.list_and_watch_updates(RENAMED) == 1
        assert node.sim.unhealthy_ids(RENAMED) == set(grant.device_ids)
        assert node.sim.allocatable(RENAMED) == 6
        assert daemon.book.get(allocation) is not None
        await asyncio.sleep(0.2)
        shown = await status_of(daemon, allocation)
        assert shown is not None
        assert shown["retired"] is True


async def test_a_rename_and_a_restart_while_pod_resources_is_down_hand_out_nothing_twice(
    node: Node,
) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("held", [("main", 2)])).containers[0]
    allocation = grant.envs["VGPU_ALLOCATION_ID"]
    # Back with the new name only, and pod-resources does not answer: the kubelet's checkpoint
    # still lists the pod's slices under the old name.
    config = Config(enforcement=FAST, resource_name=RENAMED)
    gone = node.root / "no-pod-resources.sock"
    async with running_daemon(node, config, pod_resources_socket=gone) as daemon:
        await registered(node, 8, resource=RENAMED)
        assert node.sim.list_and_watch_updates(RENAMED) == 1
        assert node.sim.unhealthy_ids(RENAMED) == set(grant.device_ids)
        record = daemon.book.get(allocation)
        assert record is not None
        assert record.resource_name == RESOURCE
