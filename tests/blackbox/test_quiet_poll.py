"""Polls that find nothing changed do no more than they must: the slice inventory is not built
again, and the kubelet is not sent the device list again; pod-resources refreshes reuse one
connection."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from deviceplugin import incremental, slicing
from deviceplugin.config import (
    DEFAULT_RESOURCE_NAME,
    Config,
    MigConfig,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.kubelet.limits import device_list_problem
from deviceplugin.kubelet.podresources import PodResourcesClient
from deviceplugin.model import Inventory, NodeReading
from deviceplugin.sim.kubelet import KubeletSimulator
from tests.blackbox.daemon_harness import (
    FAST,
    RESOURCE,
    TWO_GPUS,
    GiB,
    Node,
    eventually,
    gpu,
    registered,
    running_daemon,
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
