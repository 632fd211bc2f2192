"""A daemon restarted while the kubelet's pod-resources API does not answer still knows, and
enforces, every allocation that the kubelet's device checkpoint names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deviceplugin.config import Config, MemoryEnforcement
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.model import allocation_id
from tests.blackbox.daemon_harness import (
    FAST,
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

KILL_FAST = Config(
    enforcement=dataclasses.replace(FAST, memory=MemoryEnforcement(grace_period_s=0.2))
)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_daemon_restarted_without_pod_resources_enforces_what_the_checkpoint_names(
    node: Node, workloads: Workloads
) -> None:
    async with running_daemon(node, KILL_FAST):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("hog", [("main", 1)])).containers[0]
    held = allocation_id(grant.device_ids)
    uuid = grant.device_ids[0].rsplit("::", 1)[0]
    gpu = next(g for g in TWO_GPUS if g.uuid == uuid)
    limit = gpu.memory_total_bytes // 4
    hog = workloads.spawn(grant.envs)
    node.write_gpus(
        [with_processes(g, FakeProcess(hog, limit + GiB, 10)) if g is gpu else g for g in TWO_GPUS]
    )
    # The daemon comes back while pod-resources does not answer (nothing listens there).
    gone = node.root / "no-pod-resources.sock"
    async with running_daemon(node, KILL_FAST, pod_resources_socket=gone) as daemon:
        await eventually(lambda: daemon.book.get(held) is not None, 10, "the held allocation")
        assert not plugins(daemon).tracker.ok
        await eventually(lambda: not alive(hog), 10, "the over-limit process killed")
        record = daemon.book.get(held)
        assert record is not None
        assert record.slice_ids == tuple(sorted(grant.device_ids))
