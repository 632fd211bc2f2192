"""Polls that find nothing changed do no more than they must: the slice inventory is not built
again, and the kubelet is not sent the device list again; pod-resources refreshes reuse one
connection. With nothing allocated and no GPU process the GPUs are read every
`idlePollInterval`, and pod-resources is not asked at all."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import grpc
import pytest

from deviceplugin import incremental, slicing
from deviceplugin._proto.podresources.v1.api_pb2 import ListPodResourcesRequest
from deviceplugin._proto.podresources.v1.api_pb2_grpc import PodResourcesListerStub
from deviceplugin.app import Daemon
from deviceplugin.config import (
    DEFAULT_RESOURCE_NAME,
    Config,
    EnforcementConfig,
    MigConfig,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.gpu.fake import FakeBackend, FakeProcess
from deviceplugin.kubelet.limits import device_list_problem
from deviceplugin.kubelet.podresources import (
    ContainerDevices,
    PodResourcesClient,
)
from deviceplugin.localgrpc import local_channel
from deviceplugin.model import Inventory, NodeReading
from deviceplugin.sim.kubelet import KubeletSimulator
from tests.blackbox.daemon_harness import (
    FAST,
    RESOURCE,
    TWO_GPUS,
    GiB,
    HangingBackend,
    Node,
    Workloads,
    eventually,
    gpu,
    plugins,
    registered,
    running_daemon,
    with_processes,
)


async def test_idle_polls_neither_rebuild_the_inventory_nor_resend_the_device_list(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Inventory] = []
    build = slicing.build_inventory

    def counting_build(
        reading: NodeReading,
        cfg: SlicingConfig,
        *,
        mig: MigConfig | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
    ) -> Inventory:
        inventory = build(reading, cfg, mig=mig, resource_name=resource_name)
        built.append(inventory)
        return inventory

    monkeypatch.setattr(incremental, "build_inventory", counting_build)
    async with running_daemon(node) as daemon:  # polls every 50 ms
        await registered(node, 8)
        builds, updates = len(built), node.sim.list_and_watch_updates(RESOURCE)
        inventory = daemon.inventory.value
        polled_s = daemon.poller.last_success_wall_s
        await eventually(
            lambda: daemon.poller.last_success_wall_s > polled_s + 0.5, what="ten more polls"
        )
        assert len(built) == builds
        assert node.sim.list_and_watch_updates(RESOURCE) == updates
        assert daemon.inventory.value is inventory

        # A change is still seen at the next poll: built once more, sent once more.
        node.write_gpus((TWO_GPUS[0], gpu(1, name="NVIDIA L4", memory_gib=24, healthy=False)))
        await node.sim.wait_for(lambda: len(node.sim.unhealthy_ids(RESOURCE)) == 4)
        assert len(built) == builds + 1
        assert node.sim.list_and_watch_updates(RESOURCE) == updates + 1


async def test_idle_polls_do_not_size_the_device_list_again_but_a_gpu_change_does(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[str | None] = []

    def counting_check(plans: object, cfg: SlicingConfig) -> str | None:
        problem = device_list_problem(plans, cfg)  # type: ignore[arg-type]
        checks.append(problem)
        return problem

    monkeypatch.setattr("deviceplugin.poller.device_list_problem", counting_check)
    # 1 GiB slices: 80 and 24 slices on the two GPUs.
    config = Config(
        slicing=SlicingConfig(default=SliceRule(memory_per_slice_bytes=GiB)), enforcement=FAST
    )
    async with running_daemon(node, config) as daemon:  # polls every 50 ms
        await registered(node, 104)
        checked = len(checks)
        polled_s = daemon.poller.last_success_wall_s
        await eventually(
            lambda: daemon.poller.last_success_wall_s > polled_s + 0.5, what="ten more polls"
        )
        assert len(checks) == checked

        # A GPU whose slices would not fit is still refused at the next poll: the poll fails
        # and the kubelet keeps the last device list.
        node.write_gpus((TWO_GPUS[0], gpu(1, name="NVIDIA L4", memory_gib=2000)))
        await eventually(lambda: daemon.poller.failures >= 2, what="the refused polls")
        assert len(checks) == checked + 1
        assert checks[-1] is not None
        assert "GPU 1" in checks[-1]
        assert len(node.sim.devices(RESOURCE)) == 104
        assert daemon.poller.last_success_wall_s > polled_s

        # Back to a GPU that fits: checked once more, and polling recovers.
        node.write_gpus(TWO_GPUS)
        await eventually(lambda: daemon.poller.failures == 0, what="polling to recover")
        assert len(checks) == checked + 2
        assert checks[-1] is None


class _CountingProxy:
    """A unix-socket proxy in front of the simulated kubelet's pod-resources socket, counting the
    connections made through it; `stop` drops the listener and every open connection, as a
    kubelet restart does."""

    def __init__(self, listen: Path, upstream: Path) -> None:
        self.listen, self.upstream = listen, upstream
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._relay, path=str(self.listen))

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()
        self.listen.unlink(missing_ok=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_unix_connection(str(self.upstream))
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_pod_resources_refreshes_share_one_connection_and_reconnect_after_a_restart(
    short_tmp: Path,
) -> None:
    sim = KubeletSimulator(short_tmp / "dp", short_tmp / "podres.sock")
    await sim.start()
    proxy = _CountingProxy(short_tmp / "proxy.sock", short_tmp / "podres.sock")
    await proxy.start()
    client = PodResourcesClient(proxy.listen, timeout_s=2.0)
    try:
        for _ in range(3):
            assert await client.list_container_devices() == []
        assert proxy.connections == 1

        # The kubelet goes away: the refresh fails; once it is back the next one answers at
        # once, over a new connection, without waiting out a reconnect backoff.
        await proxy.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await client.list_container_devices()
        await proxy.start()
        assert await client.list_container_devices() == []
        assert proxy.connections == 2
    finally:
        await client.close()
        await proxy.stop()
        await sim.stop()


async def _channel_in_reconnect_backoff(socket: Path) -> grpc.aio.Channel:
    """A channel with the client's settings whose connection to the missing socket failed: its
    subchannel waits out gRPC's reconnect backoff, as a channel closed while the kubelet was down
    may for a moment after its close."""
    channel = local_channel(socket)
    with pytest.raises(grpc.aio.AioRpcError, match="No such file"):
        await PodResourcesListerStub(channel).List(ListPodResourcesRequest(), timeout=2.0)
    return channel


async def test_a_refresh_after_the_kubelet_is_back_is_not_failed_by_an_earlier_channels_backoff(
    short_tmp: Path,
) -> None:
    socket = short_tmp / "podres.sock"
    stale = await _channel_in_reconnect_backoff(socket)
    sim = KubeletSimulator(short_tmp / "dp", socket)
    await sim.start()
    client = PodResourcesClient(socket, timeout_s=2.0)
    try:
        assert await client.list_container_devices() == []
    finally:
        await client.close()
        await stale.close()
        await sim.stop()


async def test_the_dra_claim_lookup_after_the_kubelet_is_back_is_not_failed_by_a_backoff(
    short_tmp: Path,
) -> None:
    socket = short_tmp / "podres.sock"
    stale = await _channel_in_reconnect_backoff(socket)
    sim = KubeletSimulator(short_tmp / "dp", socket)
    await sim.start()
    client = PodResourcesClient(socket, timeout_s=2.0)
    try:
        assert await client.claim_users("vgpu.dev") == {}
    finally:
        await client.close()
        await stale.close()
        await sim.stop()


def _polls(daemon: Daemon) -> float:
    """Polls so far, as /metrics counts them."""
    count = daemon.metrics.registry.get_sample_value(
        "vgpu_poll_duration_seconds_count", {"node": "test-node"}
    )
    assert count is not None
    return count


async def _polls_during(daemon: Daemon, seconds: float) -> float:
    before = _polls(daemon)
    await asyncio.sleep(seconds)
    return _polls(daemon) - before


IDLE_AFTER_1S = EnforcementConfig(poll_interval_s=0.05, idle_poll_interval_s=1.0)


async def test_with_nothing_allocated_and_no_gpu_process_the_gpus_are_read_at_the_idle_interval(
    node: Node,
) -> None:
    async with running_daemon(node, Config(enforcement=IDLE_AFTER_1S)) as daemon:
        await registered(node, 8)
        await eventually(lambda: daemon.poller.idle, what="the first idle poll")
        # 50 ms polls would make 30 in 1.5 s; the idle interval makes one or two.
        assert await _polls_during(daemon, 1.5) <= 2
        # /status says so.
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        assert (snapshot.health.polling_idle, snapshot.health.poll_interval_s) == (True, 1.0)

        # An Allocate ends the idle wait at once: the new container is in the next snapshot
        # long before the idle interval is out, and the GPUs are read at pollInterval again.
        before = _polls(daemon)
        pod = await node.sim.admit_pod("train", [("main", 1)])
        allocation_id = pod.containers[0].envs["VGPU_ALLOCATION_ID"]

        def measured() -> bool:
            snapshot = daemon.poller.snapshot
            assert snapshot is not None
            return any(c.allocation_id == allocation_id for c in snapshot.containers)

        await eventually(
            measured,
            timeout_s=0.6,
            what="the container in a snapshot",
        )
        assert _polls(daemon) > before
        assert not daemon.poller.idle
        assert await _polls_during(daemon, 0.5) >= 4
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        assert (snapshot.health.polling_idle, snapshot.health.poll_interval_s) == (False, 0.05)


async def test_an_allocate_answered_during_the_poll_that_finds_the_node_idle_is_not_missed(
    node: Node,
) -> None:
    workloads = Workloads()
    backend = HangingBackend(FakeBackend(node.state_file))
    busy = (with_processes(TWO_GPUS[0], FakeProcess(workloads.spawn(), GiB)), TWO_GPUS[1])
    node.write_gpus(busy)
    try:
        config = Config(enforcement=IDLE_AFTER_1S)
        async with running_daemon(node, config, backend=backend) as daemon:
            await registered(node, 8)
            await eventually(lambda: not daemon.poller.idle, what="a busy poll")
            # A poll starts and hangs; meanwhile the process goes and a pod is admitted. The poll
            # then sees no process, and no allocation in the book it was handed: the node must
            # not count as idle for that.
            backend.hang.set()
            await asyncio.to_thread(backend.hanging.wait, 5)
            node.write_gpus(TWO_GPUS)
            pod = await node.sim.admit_pod("train", [("main", 1)])
            allocation_id = pod.containers[0].envs["VGPU_ALLOCATION_ID"]
            backend.hang.clear()
            backend.release.set()

            def measured() -> bool:
                snapshot = daemon.poller.snapshot
                assert snapshot is not None
                return any(c.allocation_id == allocation_id for c in snapshot.containers)

            await eventually(measured, timeout_s=0.8, what="the container in a snapshot")
            assert not daemon.poller.idle
    finally:
        workloads.close()


async def test_a_gpu_process_outside_every_allocation_brings_back_the_fast_poll(
    node: Node,
) -> None:
    workloads = Workloads()
    try:
        async with running_daemon(node, Config(enforcement=IDLE_AFTER_1S)) as daemon:
            await registered(node, 8)
            await eventually(lambda: daemon.poller.idle, what="the first idle poll")

            # A process no container of ours owns (a host job): seen at the next idle poll,
            # and read every pollInterval from then on, while it runs.
            pid = workloads.spawn()
            node.write_gpus((with_processes(TWO_GPUS[0], FakeProcess(pid, GiB)), TWO_GPUS[1]))
            await eventually(lambda: not daemon.poller.idle, timeout_s=3, what="a busy poll")
            assert await _polls_during(daemon, 0.5) >= 4

            # It is gone: idle again.
            node.write_gpus(TWO_GPUS)
            await eventually(lambda: daemon.poller.idle, what="idle again")
            assert await _polls_during(daemon, 1.5) <= 2
    finally:
        workloads.close()


async def test_an_idle_poll_interval_below_the_poll_interval_means_always_the_poll_interval(
    node: Node,
) -> None:
    config = Config(enforcement=EnforcementConfig(poll_interval_s=0.05, idle_poll_interval_s=0.05))
    async with running_daemon(node, config) as daemon:
        await registered(node, 8)
        await eventually(lambda: daemon.poller.idle, what="the first idle poll")
        assert await _polls_during(daemon, 0.5) >= 4


async def test_a_long_idle_interval_does_not_fail_healthz(node: Node) -> None:
    # 20 polls of 50 ms, or 10 s, would be the limit without the idle interval.
    config = Config(enforcement=EnforcementConfig(poll_interval_s=0.05, idle_poll_interval_s=30.0))
    async with running_daemon(node, config) as daemon:
        await registered(node, 8)
        await eventually(lambda: daemon.poller.idle, what="the first idle poll")
        polled_s = daemon.poller.last_success_wall_s
        daemon.poller.last_success_wall_s = polled_s - 20  # as if idle for 20 s
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        daemon.poller.snapshot = dataclasses.replace(
            snapshot,
            health=dataclasses.replace(snapshot.health, last_poll_success_s=polled_s - 20),
        )
        ok, reason = daemon.healthz()
        assert ok, reason
        daemon.poller.snapshot = dataclasses.replace(
            snapshot,
            health=dataclasses.replace(snapshot.health, last_poll_success_s=polled_s - 200),
        )
        ok, reason = daemon.healthz()
        assert not ok
        assert "limit 150s" in reason


async def test_pod_resources_is_asked_while_allocations_are_held_and_not_while_none_are(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[float] = []
    ask = PodResourcesClient.list_container_devices

    async def counting_ask(client: PodResourcesClient) -> list[ContainerDevices]:
        asked.append(asyncio.get_running_loop().time())
        return await ask(client)

    monkeypatch.setattr(PodResourcesClient, "list_container_devices", counting_ask)
    async with running_daemon(node, pod_resources_interval_s=0.2) as daemon:
        await registered(node, 8)
        await eventually(lambda: plugins(daemon).tracker.refreshes >= 1, what="the first ask")
        await asyncio.sleep(1.0)
        # Nothing allocated: asked once at the start, not every 200 ms.
        assert len(asked) == 1

        await node.sim.admit_pod("train", [("main", 1)])
        await eventually(lambda: len(asked) >= 5, timeout_s=3, what="asks every 200 ms")
        assert any(record.pod == "train" for record in daemon.book)
