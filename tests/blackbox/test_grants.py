"""A running allocation keeps what it was given, across a reload that reslices its GPU and a
restart of the daemon: the kubelet simulator, the fake GPUs and real processes."""

from __future__ import annotations

import json
import logging
import subprocess
from typing import Any

import pytest

from deviceplugin.app import Daemon
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.grants import GRANTS_FILE
from deviceplugin.sim.records import ContainerGrant
from deviceplugin.usage.statusview import render_status, snapshot_to_json
from tests.blackbox.daemon_harness import GiB, Node, Workloads, eventually, with_processes
from tests.blackbox.test_reload import configmap, daemon_with_config

ENFORCE = "enforcement:\n  pollInterval: 50ms\n  memory: {action: kill, gracePeriod: 200ms}\n"
FOUR = ENFORCE + "slicing:\n  replicas: 4\n"
EIGHT = ENFORCE + "slicing:\n  replicas: 8\n"


def kept_grants(node: Node) -> dict[str, Any]:
    """The allocations whose grants the daemon keeps in its state directory ({}: no file)."""
    path = node.root / "state" / GRANTS_FILE
    return dict(json.loads(path.read_text())["allocations"]) if path.exists() else {}


def popen(workloads: Workloads, pid: int) -> subprocess.Popen[bytes]:
    (proc,) = [p for p in workloads.procs if p.pid == pid]
    return proc


def run_on_gpu0(node: Node, *processes: FakeProcess) -> None:
    """The fake GPU 0 lists exactly `processes`."""
    node.write_gpus([with_processes(node.gpus[0], *processes), *node.gpus[1:]])


def container_status(daemon: Daemon, allocation: str) -> dict[str, object]:
    """The allocation's container in /status (on its one GPU); {} while it is not there."""
    snapshot = daemon.poller.snapshot
    if snapshot is None:
        return {}
    found = [
        c for c in snapshot_to_json(snapshot)["containers"] if c["allocation_id"] == allocation
    ]
    assert len(found) <= 1, found
    return dict(found[0]) if found else {}


def limit_of(daemon: Daemon, allocation: str) -> object:
    return container_status(daemon, allocation).get("memory_limit_bytes")


async def killed_over_its_new_slice(
    node: Node, daemon: Daemon, workloads: Workloads, name: str, held: FakeProcess
) -> None:
    """Admit a pod of one slice of the current plan (10Gi) running a 12Gi process beside `held`,
    and wait for the enforcer to kill it: the grace period has then passed with `held` on the
    GPU too."""
    grant = (await node.sim.admit_pod(name, [("c", 1)])).containers[0]
    assert grant.envs["VGPU_MEMORY_LIMIT_MIB_0"] == "10240"  # the new plan's slice
    over = workloads.spawn(grant.envs)
    run_on_gpu0(node, held, FakeProcess(over, 12 * GiB))
    await eventually(lambda: popen(workloads, over).poll() is not None, what=f"{name} killed")
    assert limit_of(daemon, grant.envs["VGPU_ALLOCATION_ID"]) == 10 * GiB


async def test_a_reload_to_more_replicas_keeps_a_running_containers_limit_through_a_restart(
    node: Node, workloads: Workloads, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = configmap(node.root / "cfg", 1, FOUR)
    async with daemon_with_config(node, path) as (daemon, _):
        await node.sim.wait_for(lambda: len(node.sim.devices("nvidia.com/vgpu")) == 8)
        # Two slices of the 80Gi A100 in four: 40Gi and half its compute.
        grant: ContainerGrant = (await node.sim.admit_pod("trainer", [("c", 2)])).containers[0]
        allocation = grant.envs["VGPU_ALLOCATION_ID"]
        assert grant.envs["VGPU_MEMORY_LIMIT_MIB_0"] == "40960"
        assert grant.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == "50"
        held = FakeProcess(workloads.spawn(grant.envs), 26 * GiB)
        run_on_gpu0(node, held)
        await eventually(lambda: limit_of(daemon, allocation) == 40 * GiB, what="the container")
        await eventually(
            lambda: container_status(daemon, allocation).get("pod") == "trainer", what="named"
        )

        configmap(node.root / "cfg", 2, EIGHT)
        await node.sim.wait_for(lambda: len(node.sim.devices("nvidia.com/vgpu")) == 16)
        await killed_over_its_new_slice(node, daemon, workloads, "after-reload", held)
        # The 26Gi process of the 40Gi container runs on; what it holds is what its env says.
        assert popen(workloads, held.pid).poll() is None
        shown = container_status(daemon, allocation)
        assert (shown["memory_limit_bytes"], shown["compute_share_ratio"]) == (40 * GiB, 0.5)
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        view = "\n".join(render_status(snapshot_to_json(snapshot), width=120))
        assert "26Gi/40Gi" in view
        changed = [
            r.getMessage() for r in caplog.records if "keeps what it was given" in r.getMessage()
        ]
        assert changed == [
            f"config reload: a running allocation keeps what it was given "
            f"allocation_id={allocation} pod=default/trainer/c gpu={node.gpus[0].uuid} slices=2 "
            "memory=40Gi compute=0.50 new_plan_memory=20Gi new_plan_compute=0.25"
        ]

    # A new daemon, on the resliced config, learns of the container from the kubelet.
    async with daemon_with_config(node, path) as (daemon, _):
        await eventually(lambda: daemon.book.get(allocation) is not None, what="recovered")
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids("nvidia.com/vgpu")) == 16)
        await killed_over_its_new_slice(node, daemon, workloads, "after-restart", held)
        assert popen(workloads, held.pid).poll() is None
        assert limit_of(daemon, allocation) == 40 * GiB
        record = daemon.book.get(allocation)
        assert record is not None
        assert [(g.memory_limit_bytes, g.compute_share_ratio) for g in record.grants] == [
            (40 * GiB, 0.5)
        ]
    assert not [r for r in caplog.records if "has no kept grant" in r.getMessage()]


async def test_an_allocation_recovered_without_a_kept_grant_gets_the_current_plan_and_says_so(
    node: Node, workloads: Workloads, caplog: pytest.LogCaptureFixture
) -> None:
    path = configmap(node.root / "cfg", 1, FOUR)
    async with daemon_with_config(node, path) as (daemon, _):
        await node.sim.wait_for(lambda: len(node.sim.devices("nvidia.com/vgpu")) == 8)
        grant = (await node.sim.admit_pod("trainer", [("c", 2)])).containers[0]
        allocation = grant.envs["VGPU_ALLOCATION_ID"]
        assert kept_grants(node)[allocation]["grants"][0]["memory_limit_bytes"] == 40 * GiB
    # As a daemon that kept no grants would leave it (one of an older version).
    (node.root / "state" / GRANTS_FILE).unlink()
    configmap(node.root / "cfg", 2, EIGHT)
    caplog.set_level(logging.WARNING)
    async with daemon_with_config(node, path) as (daemon, _):
        await eventually(lambda: daemon.book.get(allocation) is not None, what="recovered")
        record = daemon.book.get(allocation)
        assert record is not None
        assert [(g.memory_limit_bytes, g.slices) for g in record.grants] == [(20 * GiB, 2)]
        (line,) = [r.getMessage() for r in caplog.records if "has no kept grant" in r.getMessage()]
        assert f"allocation_id={allocation}" in line
        assert "memory=20Gi compute=0.25 slices=2" in line
        # Kept from then on: the next restart does not say it again.
        await eventually(
            lambda: allocation in kept_grants(node), what="the current plan's grant kept"
        )
        assert kept_grants(node)[allocation]["grants"][0]["memory_limit_bytes"] == 20 * GiB
