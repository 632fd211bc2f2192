"""GPU health through the whole daemon on the nvml backend, with the driver model in place of the
driver: an Xid or a hung NVML call on one GPU reaches the kubelet simulator as Unhealthy slices
while Allocate on the other GPU's slices keeps working."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import Config, EnforcementConfig, HealthConfig
from deviceplugin.gpu.nvml import NvmlBackend
from deviceplugin.kubelet.proto import UNHEALTHY, dp, dp_grpc
from tests.blackbox.daemon_harness import RESOURCE, Node, registered
from tests.support.nvml_model import NvmlModel, model_gpus

POLL_INTERVAL_S = 0.05  # the harness's FAST config


@dataclass
class Rig:
    node: Node
    model: NvmlModel
    backend: NvmlBackend
    daemon: Daemon

    def slices(self, index: int) -> set[str]:
        return {f"{self.model.gpus[index].uuid}::{n}" for n in range(4)}


@contextlib.asynccontextmanager
async def nvml_daemon(
    root: Path, health: HealthConfig, config: Config | None = None
) -> AsyncIterator[Rig]:
    node = Node(root, ())
    numa = root / "sys" / "bus" / "pci" / "devices" / "0000:10:00.0"
    numa.mkdir(parents=True)
    (numa / "numa_node").write_text("1\n")
    model = NvmlModel(model_gpus(2))
    backend = NvmlBackend(
        health,
        nvml=model,
        call_timeout_s=POLL_INTERVAL_S,
        event_wait_timeout_s=0.05,
        sysfs_root=root / "sys",
    )
    daemon = Daemon(node.settings(config), backend)
    await node.sim.start()
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield Rig(node, model, backend, daemon)
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        model.release_all()
        await asyncio.wait_for(task, 10)
        backend.close()
        await node.sim.stop()


async def allocate(node: Node, device_id: str) -> dp.AllocateResponse:
    async with grpc.aio.insecure_channel(f"unix://{node.plugin_socket()}") as channel:
        stub = dp_grpc.DevicePluginStub(channel)
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=[device_id])]
        )
        response: dp.AllocateResponse = await stub.Allocate(request, timeout=5)
        return response


async def test_an_xid_on_one_gpu_reaches_the_kubelet_while_the_other_keeps_allocating(
    short_tmp: Path,
) -> None:
    async with nvml_daemon(short_tmp, HealthConfig()) as rig:
        sim = rig.node.sim
        await registered(rig.node, 8)
        assert sim.devices(RESOURCE)[f"{rig.model.gpus[0].uuid}::0"].numa_nodes == (1,)
        held = (await sim.admit_pod("before", [("c", 1)])).containers[0]

        started = time.monotonic()
        rig.model.emit_xid(1, 79)
        await sim.wait_for(lambda: sim.unhealthy_ids(RESOURCE) == rig.slices(1), timeout_s=5)
        elapsed_s = time.monotonic() - started

        # The watcher marks the GPU at once; the next poll carries it to the kubelet.
        assert elapsed_s < 1.0
        assert all(sim.devices(RESOURCE)[d].health == UNHEALTHY for d in rig.slices(1))
        assert sim.healthy_ids(RESOURCE) == rig.slices(0)
        # The other GPU's slices keep being allocated, and a pod holding one keeps it.
        pod = await sim.admit_pod("after", [("c", 2)])
        assert set(pod.containers[0].device_ids) <= rig.slices(0)
        response = await allocate(rig.node, f"{rig.model.gpus[0].uuid}::3")
        env = response.container_responses[0].envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == rig.model.gpus[0].uuid
        assert [p.name for p in sim.pods()] == ["before", "after"]
        assert sim.pods()[0].containers[0].device_ids == held.device_ids
        # The sick GPU's slices are refused.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await allocate(rig.node, f"{rig.model.gpus[1].uuid}::0")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = rig.backend.health_stats[1]
        assert (stats.healthy, stats.xids, stats.unhealthy_transitions) == (False, {79: 1}, 1)


async def test_an_xid_on_an_idle_node_is_reported_without_waiting_for_the_idle_poll(
    short_tmp: Path,
) -> None:
    # Nothing allocated, no GPU process: the GPUs are read every 30 s, but an Xid wakes the poll.
    idle = EnforcementConfig(poll_interval_s=POLL_INTERVAL_S, idle_poll_interval_s=30.0)
    async with nvml_daemon(short_tmp, HealthConfig(), Config(enforcement=idle)) as rig:
        sim = rig.node.sim
        await registered(rig.node, 8)
        assert rig.daemon.poller.idle
        started = time.monotonic()
        rig.model.emit_xid(0, 79)
        await sim.wait_for(lambda: sim.unhealthy_ids(RESOURCE) == rig.slices(0), timeout_s=5)
        assert time.monotonic() - started < 1.0


async def test_an_ignored_xid_changes_nothing(short_tmp: Path) -> None:
    async with nvml_daemon(short_tmp, HealthConfig()) as rig:
        sim = rig.node.sim
        await registered(rig.node, 8)

        rig.model.emit_xid(1, 13)
        await asyncio.sleep(10 * POLL_INTERVAL_S)

        assert rig.backend.health_stats[1].ignored_xids == 1
        assert len(sim.healthy_ids(RESOURCE)) == 8


async def test_a_hung_gpu_never_stalls_the_daemon_and_turns_unhealthy(short_tmp: Path) -> None:
    async with nvml_daemon(short_tmp, HealthConfig(hang_timeout_s=0.5)) as rig:
        sim = rig.node.sim
        await registered(rig.node, 8)
        rig.model.block("nvmlDeviceGetMemoryInfo", gpu=0)
        reads_before = rig.model.calls[("nvmlDeviceGetMemoryInfo", 1)]

        started = time.monotonic()
        await sim.wait_for(lambda: sim.unhealthy_ids(RESOURCE) == rig.slices(0), timeout_s=5)

        # The hang threshold, then a poll or two (with room for a loaded machine).
        assert time.monotonic() - started < 0.5 + 1.5
        # The other GPU kept being read all along.
        assert rig.model.calls[("nvmlDeviceGetMemoryInfo", 1)] >= reads_before + 5
        assert rig.daemon.poller.failures == 0
        pod = await sim.admit_pod("meanwhile", [("c", 1)])
        assert set(pod.containers[0].device_ids) <= rig.slices(1)
