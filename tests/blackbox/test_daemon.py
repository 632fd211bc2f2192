"""The daemon end to end, driven through the kubelet simulator as the kubelet would drive it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from deviceplugin.config import (
    AllocationConfig,
    AllocationPolicy,
    Config,
    DeviceIdStrategy,
    DeviceListStrategy,
    GpuMatch,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.kubelet.proto import HEALTHY, UNHEALTHY, dp, dp_grpc
from deviceplugin.sim.kubelet import AdmissionError, ContainerGrant
from tests.blackbox.daemon_harness import (
    FAST,
    RESOURCE,
    TWO_GPUS,
    GiB,
    Node,
    eventually,
    gpu,
    plugins,
    registered,
    running_daemon,
)


async def plugin_call(node: Node, method: str, request: object) -> object:
    """Call the plugin's own socket directly, as a misbehaving kubelet could."""
    async with grpc.aio.insecure_channel(f"unix://{node.plugin_socket()}") as channel:
        stub = dp_grpc.DevicePluginStub(channel)
        return await getattr(stub, method)(request, timeout=5)


# --- registration and the device list ------------------------------------------------------


async def test_registers_and_advertises_four_slices_per_gpu_by_default(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        event = node.sim.registrations[-1]
        assert event.accepted
        assert event.version == "v1beta1"
        assert event.resource_name == RESOURCE
        devices = node.sim.devices(RESOURCE)
        assert set(devices) == {f"{g.uuid}::{n}" for g in TWO_GPUS for n in range(4)}
        assert all(d.health == HEALTHY for d in devices.values())
        # NUMA topology travels with every slice.
        assert devices[f"{TWO_GPUS[1].uuid}::3"].numa_nodes == (1,)
        assert devices[f"{TWO_GPUS[0].uuid}::0"].numa_nodes == (0,)


async def test_socket_is_owner_only(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        assert node.plugin_socket().stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            Config(slicing=SlicingConfig(default=SliceRule(replicas=2)), enforcement=FAST),
            {0: 2, 1: 2},
        ),
        (
            Config(
                slicing=SlicingConfig(default=SliceRule(memory_per_slice_bytes=8 * GiB)),
                enforcement=FAST,
            ),
            {0: 10, 1: 3},
        ),
        (
            Config(
                slicing=SlicingConfig(
                    default=SliceRule(replicas=4),
                    overrides=(SliceOverride(GpuMatch(model="*L4*"), SliceRule(replicas=1)),),
                ),
                enforcement=FAST,
            ),
            {0: 4, 1: 1},
        ),
    ],
    ids=["replicas-2", "memory-per-slice-8Gi", "override-by-model"],
)
async def test_device_list_follows_the_slicing_config(
    node: Node, config: Config, expected: dict[int, int]
) -> None:
    async with running_daemon(node, config):
        await registered(node, sum(expected.values()))
        per_gpu = {g.index: 0 for g in TWO_GPUS}
        for device_id in node.sim.devices(RESOURCE):
            uuid = device_id.rsplit("::", 1)[0]
            per_gpu[next(g.index for g in TWO_GPUS if g.uuid == uuid)] += 1
        assert per_gpu == expected


async def test_custom_resource_name(node: Node) -> None:
    config = Config(resource_name="example.com/gpu-slice", enforcement=FAST)
    async with running_daemon(node, config):
        await registered(node, 8, resource="example.com/gpu-slice")
        assert node.plugin_socket("example.com/gpu-slice").exists()


async def test_mig_gpu_is_left_out(node: Node) -> None:
    node.write_gpus((gpu(0), gpu(1, mig=True)))
    async with running_daemon(node):
        await registered(node, 4)
        assert all(d.startswith(gpu(0).uuid) for d in node.sim.devices(RESOURCE))


# --- allocation ------------------------------------------------------------------------------


async def test_pack_keeps_a_container_on_one_gpu_and_env_describes_it(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        pod = await node.sim.admit_pod("train", [("main", 3)])
        grant = pod.containers[0]
        gpus = {d.rsplit("::", 1)[0] for d in grant.device_ids}
        assert len(gpus) == 1
        assert grant.preferred == grant.device_ids
        (uuid,) = gpus
        env = grant.envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
        expected_id = hashlib.sha256(",".join(sorted(grant.device_ids)).encode()).hexdigest()[:16]
        assert env["VGPU_ALLOCATION_ID"] == expected_id
        memory_gib = 80 if uuid == TWO_GPUS[0].uuid else 24
        assert int(env["VGPU_MEMORY_LIMIT_MIB_0"]) == 3 * (memory_gib * 1024 // 4)
        assert env["VGPU_COMPUTE_SHARE_PERCENT_0"] == "75"


async def test_pack_fills_the_gpu_already_in_use(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        first = await node.sim.admit_pod("a", [("c", 1)])
        second = await node.sim.admit_pod("b", [("c", 2)])
        gpu_of = {d.rsplit("::", 1)[0] for d in first.containers[0].device_ids}
        assert {d.rsplit("::", 1)[0] for d in second.containers[0].device_ids} == gpu_of


async def test_spread_puts_slices_on_distinct_gpus(node: Node) -> None:
    config = Config(allocation=AllocationConfig(policy=AllocationPolicy.SPREAD), enforcement=FAST)
    async with running_daemon(node, config):
        await registered(node, 8)
        pod = await node.sim.admit_pod("spread", [("c", 2)])
        grant = pod.containers[0]
        assert len({d.rsplit("::", 1)[0] for d in grant.device_ids}) == 2
        # Ordinals follow GPU index order.
        assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == f"{TWO_GPUS[0].uuid},{TWO_GPUS[1].uuid}"
        assert int(grant.envs["VGPU_MEMORY_LIMIT_MIB_0"]) == 80 * 1024 // 4
        assert int(grant.envs["VGPU_MEMORY_LIMIT_MIB_1"]) == 24 * 1024 // 4


STRATEGY_CASES: dict[DeviceListStrategy, Callable[[ContainerGrant, str], bool]] = {
    DeviceListStrategy.ENVVAR: lambda g, uuid: g.envs["NVIDIA_VISIBLE_DEVICES"] == uuid,
    DeviceListStrategy.VOLUME_MOUNTS: lambda g, uuid: (
        (f"/var/run/nvidia-container-devices/{uuid}", "/dev/null", True) in g.mounts
        and g.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    ),
    DeviceListStrategy.CDI_ANNOTATIONS: lambda g, uuid: (
        f"nvidia.com/gpu={uuid}" in g.annotations.values()
        and all(k.startswith("cdi.k8s.io/") for k in g.annotations)
    ),
    DeviceListStrategy.CDI_CRI: lambda g, uuid: g.cdi_devices == (f"nvidia.com/gpu={uuid}",),
    DeviceListStrategy.DEVICE_SPECS: lambda g, uuid: (
        {
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
        }
        <= {d[0] for d in g.devices}
        and any(d[0] in ("/dev/nvidia0", "/dev/nvidia1") for d in g.devices)
    ),
}


@pytest.mark.parametrize("strategy", list(STRATEGY_CASES), ids=lambda s: s.value)
async def test_every_device_list_strategy_reaches_the_container(
    node: Node, strategy: DeviceListStrategy
) -> None:
    config = Config(allocation=AllocationConfig(device_list_strategy=(strategy,)), enforcement=FAST)
    async with running_daemon(node, config):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
        uuid = grant.device_ids[0].rsplit("::", 1)[0]
        assert STRATEGY_CASES[strategy](grant, uuid), grant
        assert grant.envs["VGPU_ALLOCATION_ID"]


async def test_devices_by_index_reach_the_container(node: Node) -> None:
    allocation = AllocationConfig(
        policy=AllocationPolicy.SPREAD,
        device_id_strategy=DeviceIdStrategy.INDEX,
        device_list_strategy=(DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_CRI),
    )
    async with running_daemon(node, Config(allocation=allocation, enforcement=FAST)):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 2)])).containers[0]
        assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "0,1"
        assert grant.cdi_devices == ("nvidia.com/gpu=0", "nvidia.com/gpu=1")
        suffix = TWO_GPUS[0].uuid.upper().replace("-", "_")
        assert grant.envs[f"VGPU_ALLOCATION_ID_{suffix}"] == grant.envs["VGPU_ALLOCATION_ID"]


async def test_the_device_id_flag_wins_over_the_config_file_and_its_reloads(node: Node) -> None:
    by_uuid = Config(allocation=AllocationConfig(device_id_strategy=DeviceIdStrategy.UUID))
    async with running_daemon(node, by_uuid, device_id_strategy=DeviceIdStrategy.INDEX) as daemon:
        await registered(node, 8)
        first = (await node.sim.admit_pod("a", [("c", 1)])).containers[0]
        assert first.envs["NVIDIA_VISIBLE_DEVICES"] in ("0", "1")
        await daemon.apply_config(dataclasses.replace(by_uuid, enforcement=FAST))
        assert daemon.config.allocation.device_id_strategy is DeviceIdStrategy.INDEX
        second = (await node.sim.admit_pod("b", [("c", 1)])).containers[0]
        assert second.envs["NVIDIA_VISIBLE_DEVICES"] in ("0", "1")


async def test_every_container_of_a_pod_gets_its_own_allocation(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        pod = await node.sim.admit_pod("multi", [("a", 1), ("b", 2)])
        a, b = pod.containers
        assert not set(a.device_ids) & set(b.device_ids)
        assert a.envs["VGPU_ALLOCATION_ID"] != b.envs["VGPU_ALLOCATION_ID"]


async def test_unknown_device_id_is_refused_with_invalid_argument(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        request = dp.AllocateRequest(
            container_requests=[
                dp.ContainerAllocateRequest(devices_ids=[f"{TWO_GPUS[0].uuid}::0", "GPU-nope::0"])
            ]
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await plugin_call(node, "Allocate", request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope::0" in (caught.value.details() or "")


async def test_node_runs_out_of_slices(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        await node.sim.admit_pod("big", [("c", 8)])
        with pytest.raises(AdmissionError):
            await node.sim.admit_pod("late", [("c", 1)])


# --- health ----------------------------------------------------------------------------------


async def test_unhealthy_gpu_reaches_kubelet_and_its_slices_are_refused(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        sick = TWO_GPUS[1]
        node.write_gpus(
            (TWO_GPUS[0], gpu(1, name="NVIDIA L4", memory_gib=24, numa_node=1, healthy=False))
        )
        sim = node.sim
        await sim.wait_for(
            lambda: sim.unhealthy_ids(RESOURCE) == {f"{sick.uuid}::{n}" for n in range(4)}
        )
        assert all(
            d.health == UNHEALTHY
            for i, d in sim.devices(RESOURCE).items()
            if i.startswith(sick.uuid)
        )
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=[f"{sick.uuid}::2"])]
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await plugin_call(node, "Allocate", request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{sick.uuid}::2" in (caught.value.details() or "")
        # The healthy GPU keeps serving.
        pod = await sim.admit_pod("still-works", [("c", 2)])
        assert all(d.startswith(TWO_GPUS[0].uuid) for d in pod.containers[0].device_ids)
        # And it comes back.
        node.write_gpus(TWO_GPUS)
        await sim.wait_for(lambda: not sim.unhealthy_ids(RESOURCE))


async def test_malformed_state_file_keeps_the_last_good_device_list(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        updates = node.sim.list_and_watch_updates(RESOURCE)
        node.state_file.write_text("{not json")
        await asyncio.sleep(0.3)
        assert node.sim.is_registered(RESOURCE)
        assert len(node.sim.healthy_ids(RESOURCE)) == 8
        assert node.sim.list_and_watch_updates(RESOURCE) == updates


# --- the kubelet's and the plugin's life cycles ----------------------------------------------


async def test_kubelet_restart_reregisters_with_allocations_intact(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        held = (await node.sim.admit_pod("before", [("c", 2)])).containers[0]
        before = len(node.sim.registrations)
        await node.sim.restart()
        sim = node.sim
        await sim.wait_for(lambda: len(sim.registrations) > before and sim.is_registered(RESOURCE))
        await registered(node, 8)
        assert plugins(daemon).lifecycle.stats.last_restart_reason
        # The pod admitted before the restart still holds its slices ...
        assert [p.name for p in sim.pods()] == ["before"]
        assert sim.pods()[0].containers[0].device_ids == held.device_ids
        # ... and new pods are admitted around them.
        after = (await sim.admit_pod("after", [("c", 2)])).containers[0]
        assert not set(after.device_ids) & set(held.device_ids)
        assert daemon.book.get(held.envs["VGPU_ALLOCATION_ID"]) is not None


async def test_broken_stream_makes_the_plugin_register_again(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        held = (await node.sim.admit_pod("before", [("c", 1)])).containers[0]
        before = len(node.sim.registrations)
        await node.sim.break_stream(RESOURCE)
        assert not node.sim.is_registered(RESOURCE)
        # The kubelet never re-opens the stream: the plugin must notice and register again.
        sim = node.sim
        await sim.wait_for(lambda: len(sim.registrations) > before and sim.is_registered(RESOURCE))
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == 8)
        assert plugins(daemon).lifecycle.stats.last_restart_reason == "ListAndWatch stream ended"
        assert sim.pods()[0].containers[0].device_ids == held.device_ids


async def test_plugin_restart_recovers_its_allocations_from_pod_resources(node: Node) -> None:
    async with running_daemon(node):
        await registered(node, 8)
        held = (await node.sim.admit_pod("web", [("server", 2)], namespace="prod")).containers[0]
    await node.sim.wait_for(lambda: not node.sim.is_registered(RESOURCE))
    assert not node.plugin_socket().exists()
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        allocation = held.envs["VGPU_ALLOCATION_ID"]
        await eventually(lambda: daemon.book.get(allocation) is not None)
        record = daemon.book.get(allocation)
        assert record is not None
        assert (record.namespace, record.pod, record.container) == ("prod", "web", "server")
        assert set(record.slice_ids) == set(held.device_ids)
        more = (await node.sim.admit_pod("next", [("c", 1)])).containers[0]
        assert not set(more.device_ids) & set(held.device_ids)


async def test_daemon_waits_for_a_kubelet_that_is_not_there_yet(short_tmp: Path) -> None:
    node = Node(short_tmp, TWO_GPUS)
    async with running_daemon(node) as daemon:
        await asyncio.sleep(0.3)
        assert not plugins(daemon).lifecycle.registered
        assert plugins(daemon).lifecycle.stats.registration_failures >= 1
        await node.sim.start()
        try:
            await registered(node, 8)
        finally:
            await node.sim.stop()


async def test_kubelet_restarts_in_quick_succession_never_stop_the_daemon(node: Node) -> None:
    # Restarts land while the plugin is serving again after the previous one, including between
    # its bind and its chmod: it must keep re-registering, never die.
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        for _ in range(15):
            await node.sim.restart()
            await asyncio.sleep(0.003)
        # It may register once more than needed (it saw kubelet.sock of the restart before the
        # one that answered), never once too few.
        await eventually(lambda: plugins(daemon).lifecycle.registered)
        await registered(node, 8)
        assert len(node.sim.healthy_ids(RESOURCE)) == 8
