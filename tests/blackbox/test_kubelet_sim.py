"""The kubelet simulator against a minimal device plugin defined here, over real Unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import re
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.kubelet.proto import (
    DEVICE_PLUGIN_VERSION,
    HEALTHY,
    KUBELET_SOCKET,
    UNHEALTHY,
    dp,
    dp_grpc,
    podres,
    podres_grpc,
)
from deviceplugin.sim.kubelet import (
    CHECKPOINT_FILE,
    AdmissionError,
    KubeletSimulator,
    choose_devices,
    is_extended_resource_name,
)
from deviceplugin.sim.records import ContainerGrant
from deviceplugin.sim.runoptions import merge_run_options, toolkit_devices

RESOURCE = "nvidia.com/vgpu"
ENDPOINT = "fake.sock"
# id -> NUMA nodes; d3 reports no topology.
DEVICES: dict[str, tuple[int, ...]] = {"d0": (0,), "d1": (0,), "d2": (1,), "d3": ()}


def last_ones(available: list[str], size: int) -> list[str]:
    return available[-size:]


class FakePlugin(dp_grpc.DevicePluginServicer):
    """A device plugin with a fixed device list that records every call it gets."""

    def __init__(
        self,
        devices: dict[str, tuple[int, ...]] | None = None,
        *,
        pre_start_required: bool = False,
        preferred_available: bool = False,
        preference: Callable[[list[str], int], list[str]] = last_ones,
    ) -> None:
        self.numa = dict(DEVICES if devices is None else devices)
        self.health = dict.fromkeys(self.numa, HEALTHY)
        self.options = dp.DevicePluginOptions(
            pre_start_required=pre_start_required,
            get_preferred_allocation_available=preferred_available,
        )
        self.preference = preference
        self.calls: list[tuple[str, Any]] = []
        self.fail_allocate_at: int | None = None  # the Allocate call (0-based) that fails
        self.streams_cancelled = 0
        self._allocations = 0
        self._version = 0
        self._ended = False
        self._condition = asyncio.Condition()

    def called(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    async def set_health(self, device_id: str, health: str) -> None:
        self.health[device_id] = health
        async with self._condition:
            self._version += 1
            self._condition.notify_all()

    async def end_streams(self) -> None:
        async with self._condition:
            self._ended = True
            self._condition.notify_all()

    def _news(self, seen: int) -> bool:
        return self._version != seen or self._ended

    def _list(self) -> dp.ListAndWatchResponse:
        return dp.ListAndWatchResponse(
            devices=[
                dp.Device(
                    ID=device_id,
                    health=self.health[device_id],
                    topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=n) for n in nodes])
                    if nodes
                    else None,
                )
                for device_id, nodes in self.numa.items()
            ]
        )

    async def GetDevicePluginOptions(  # noqa: N802
        self, request: dp.Empty, context: Any
    ) -> dp.DevicePluginOptions:
        self.calls.append(("GetDevicePluginOptions", request))
        return self.options

    async def ListAndWatch(  # noqa: N802
        self, request: dp.Empty, context: Any
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        self.calls.append(("ListAndWatch", request))
        seen = -1
        try:
            while True:
                async with self._condition:
                    await self._condition.wait_for(functools.partial(self._news, seen))
                    if self._ended:
                        return
                    seen = self._version
                    response = self._list()
                yield response
        except asyncio.CancelledError:
            self.streams_cancelled += 1
            raise

    async def GetPreferredAllocation(  # noqa: N802
        self, request: dp.PreferredAllocationRequest, context: Any
    ) -> dp.PreferredAllocationResponse:
        self.calls.append(("GetPreferredAllocation", request))
        return dp.PreferredAllocationResponse(
            container_responses=[
                dp.ContainerPreferredAllocationResponse(
                    deviceIDs=self.preference(list(r.available_deviceIDs), r.allocation_size)
                )
                for r in request.container_requests
            ]
        )

    async def Allocate(  # noqa: N802
        self, request: dp.AllocateRequest, context: Any
    ) -> dp.AllocateResponse:
        self.calls.append(("Allocate", request))
        index, self._allocations = self._allocations, self._allocations + 1
        if index == self.fail_allocate_at:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "device d9 is not known")
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(
                    envs={"FAKE_DEVICES": ",".join(r.devices_ids)},
                    mounts=[dp.Mount(container_path="/c", host_path="/h", read_only=True)],
                    devices=[
                        dp.DeviceSpec(container_path="/dev/x", host_path="/dev/x", permissions="rw")
                    ],
                    annotations={"fake/ids": ",".join(r.devices_ids)},
                    cdi_devices=[dp.CDIDevice(name=f"fake.com/dev={i}") for i in r.devices_ids],
                )
                for r in request.container_requests
            ]
        )

    async def PreStartContainer(  # noqa: N802
        self, request: dp.PreStartContainerRequest, context: Any
    ) -> dp.PreStartContainerResponse:
        self.calls.append(("PreStartContainer", request))
        return dp.PreStartContainerResponse()


@dataclass
class Node:
    root: Path
    sim: KubeletSimulator
    servers: list[Any] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.root / "dp"

    @property
    def podres_socket(self) -> Path:
        return self.root / "pr" / "kubelet.sock"

    async def serve(self, plugin: FakePlugin, endpoint: str = ENDPOINT) -> Any:
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
        server.add_insecure_port(f"unix://{self.dir / endpoint}")
        await server.start()
        self.servers.append(server)
        return server

    async def register(
        self,
        endpoint: str = ENDPOINT,
        resource: str = RESOURCE,
        version: str = DEVICE_PLUGIN_VERSION,
        options: dp.DevicePluginOptions | None = None,
    ) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.dir / KUBELET_SOCKET}") as channel:
            stub = dp_grpc.RegistrationStub(channel)
            await stub.Register(
                dp.RegisterRequest(
                    version=version, endpoint=endpoint, resource_name=resource, options=options
                ),
                timeout=5,
            )

    async def plug(
        self, plugin: FakePlugin, endpoint: str = ENDPOINT, resource: str = RESOURCE
    ) -> Any:
        server = await self.serve(plugin, endpoint)
        await self.register(endpoint, resource)
        await self.sim.wait_for(lambda: self.sim.is_registered(resource))
        return server


@pytest.fixture
async def node(short_tmp: Path) -> AsyncIterator[Node]:
    sim = KubeletSimulator(short_tmp / "dp", short_tmp / "pr" / "kubelet.sock", dial_timeout_s=0.5)
    n = Node(short_tmp, sim)
    await sim.start()
    try:
        yield n
    finally:
        await sim.stop()
        for server in n.servers:
            await server.stop(None)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """For conditions on the plugin's side, which the simulator does not announce."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def pod_resources(node: Node) -> AsyncIterator[Any]:
    """A pod-resources client, like the daemon's, on the simulator's socket."""
    async with grpc.aio.insecure_channel(f"unix://{node.podres_socket}") as channel:
        yield podres_grpc.PodResourcesListerStub(channel)


# --- pure helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("nvidia.com/vgpu", True),
        ("example.com/gpu-slice", True),
        ("vgpu", False),
        ("kubernetes.io/vgpu", False),
        ("example.kubernetes.io/vgpu", False),
        ("requests.example.com/vgpu", False),
        ("Example.com/vgpu", False),
        ("nvidia.com/a/b", False),
        ("nvidia.com/", False),
        ("nvidia.com/-bad", False),
        ("nvidia.com/" + "x" * 64, False),
    ],
)
def test_extended_resource_names(name: str, valid: bool) -> None:
    assert is_extended_resource_name(name) is valid


@pytest.mark.parametrize(
    ("preferred", "chosen", "valid"),
    [
        (["c", "a"], ["c", "a"], True),
        ([], ["a", "b"], False),
        (["zz", "yy"], ["a", "b"], False),
        (["c"], ["c", "a"], False),
        (["c", "c"], ["c", "a"], False),
        (["d", "c", "b"], ["d", "c"], False),
    ],
)
def test_choose_devices_keeps_the_usable_part_of_a_preference(
    preferred: list[str], chosen: list[str], valid: bool
) -> None:
    assert choose_devices(["a", "b", "c", "d"], preferred, 2) == (chosen, valid)


# --- start, registration -------------------------------------------------------------------------


async def test_start_removes_stale_files_but_keeps_checkpoint_and_directories(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugin_dir = short_tmp / "dp"
    (plugin_dir / "sub").mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(plugin_dir / "old-plugin.sock"))
    stale.close()
    (plugin_dir / "leftover").write_text("x")
    (plugin_dir / CHECKPOINT_FILE).write_text("not json")
    sim = KubeletSimulator(plugin_dir)
    with caplog.at_level(logging.WARNING):
        await sim.start()
    try:
        names = sorted(p.name for p in plugin_dir.iterdir())
        assert names == sorted([CHECKPOINT_FILE, KUBELET_SOCKET, "sub"])
        mode = (plugin_dir / KUBELET_SOCKET).stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600
        assert "checkpoint" in caplog.text
        assert sim.pods() == []
    finally:
        await sim.stop()
    assert not (plugin_dir / KUBELET_SOCKET).exists()


def test_socket_paths_over_the_limit_are_refused() -> None:
    with pytest.raises(ValueError, match="107"):
        KubeletSimulator(Path("/tmp") / ("x" * 100))


@pytest.mark.parametrize(
    ("version", "resource", "error"),
    [
        ("v1alpha1", RESOURCE, 'requested API version "v1alpha1" is not supported by kubelet'),
        (DEVICE_PLUGIN_VERSION, "vgpu", 'the ResourceName "vgpu" is invalid'),
        (DEVICE_PLUGIN_VERSION, "kubernetes.io/vgpu", "is invalid"),
    ],
)
async def test_bad_registration_is_refused(
    node: Node, version: str, resource: str, error: str
) -> None:
    plugin = FakePlugin()
    await node.serve(plugin)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await node.register(resource=resource, version=version)
    assert error in (caught.value.details() or "")
    event = node.sim.registrations[-1]
    assert (event.resource_name, event.version, event.accepted) == (resource, version, False)
    assert error in event.error
    assert plugin.calls == []
    assert not node.sim.is_registered(resource)


async def test_registration_fails_when_the_plugin_cannot_be_dialled(node: Node) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await node.register(endpoint="nobody.sock")
    assert "failed to dial device plugin" in (caught.value.details() or "")
    assert not node.sim.registrations[-1].accepted
    assert not node.sim.is_registered(RESOURCE)


async def test_registration_dials_back_reads_options_and_watches_devices(node: Node) -> None:
    plugin = FakePlugin(pre_start_required=False, preferred_available=False)
    await node.serve(plugin)
    # The request's own options are ignored: the kubelet asks the plugin.
    await node.register(options=dp.DevicePluginOptions(pre_start_required=True))
    assert plugin.calls[0][0] == "GetDevicePluginOptions"
    event = node.sim.registrations[-1]
    assert (event.accepted, event.endpoint, event.error) == (True, ENDPOINT, "")
    options = node.sim.options(RESOURCE)
    assert options is not None
    assert not options.pre_start_required
    await node.sim.wait_for(lambda: node.sim.is_registered(RESOURCE))
    devices = node.sim.devices(RESOURCE)
    assert {i: (d.health, d.numa_nodes) for i, d in devices.items()} == {
        "d0": (HEALTHY, (0,)),
        "d1": (HEALTHY, (0,)),
        "d2": (HEALTHY, (1,)),
        "d3": (HEALTHY, ()),
    }
    assert node.sim.healthy_ids(RESOURCE) == set(DEVICES)
    assert node.sim.list_and_watch_updates(RESOURCE) == 1
    assert (node.sim.capacity(RESOURCE), node.sim.allocatable(RESOURCE)) == (4, 4)
    await node.sim.admit_pod("p", [("c", 1)])
    assert plugin.called("PreStartContainer") == []


async def test_health_changes_are_followed(node: Node) -> None:
    plugin = FakePlugin()
    await node.plug(plugin)
    await plugin.set_health("d1", UNHEALTHY)
    await node.sim.wait_for(lambda: node.sim.unhealthy_ids(RESOURCE) == {"d1"})
    assert node.sim.devices(RESOURCE)["d1"].health == UNHEALTHY
    assert node.sim.list_and_watch_updates(RESOURCE) == 2
    assert (node.sim.capacity(RESOURCE), node.sim.allocatable(RESOURCE)) == (4, 3)
    await plugin.set_health("d1", HEALTHY)
    await node.sim.wait_for(lambda: not node.sim.unhealthy_ids(RESOURCE))
    assert node.sim.healthy_ids(RESOURCE) == set(DEVICES)


async def test_a_new_registration_replaces_the_endpoint(node: Node) -> None:
    first = FakePlugin()
    await node.plug(first, endpoint="a.sock")
    second = FakePlugin({"e0": (0,), "e1": (1,)})
    await node.serve(second, "b.sock")
    await node.register(endpoint="b.sock")
    await node.sim.wait_for(lambda: set(node.sim.devices(RESOURCE)) == {"e0", "e1"})
    await eventually(lambda: first.streams_cancelled == 1)
    assert node.sim.is_registered(RESOURCE)
    assert node.sim.healthy_ids(RESOURCE) == {"e0", "e1"}
    pod = await node.sim.admit_pod("p", [("c", 2)])
    assert pod.containers[0].device_ids == ("e0", "e1")
    assert first.called("Allocate") == []


@pytest.mark.parametrize("how", ["plugin exits", "stream returns"])
async def test_stream_end_marks_devices_unhealthy(node: Node, how: str) -> None:
    plugin = FakePlugin()
    server = await node.plug(plugin)
    if how == "plugin exits":
        await server.stop(None)
    else:
        await plugin.end_streams()
    await node.sim.wait_for(lambda: not node.sim.is_registered(RESOURCE))
    assert node.sim.healthy_ids(RESOURCE) == set()
    assert node.sim.unhealthy_ids(RESOURCE) == set(DEVICES)
    assert all(d.health == UNHEALTHY for d in node.sim.devices(RESOURCE).values())
    assert node.sim.allocatable(RESOURCE) == 0
    with pytest.raises(AdmissionError, match="no healthy devices present"):
        await node.sim.admit_pod("p", [("c", 1)])
    # The kubelet never reopens the stream itself.
    await asyncio.sleep(0.1)
    assert len(plugin.called("ListAndWatch")) == 1


async def test_wait_for_names_what_it_waited_for(node: Node) -> None:
    with pytest.raises(TimeoutError, match=r"is_registered\(\"example.com/none\"\)"):
        await node.sim.wait_for(lambda: node.sim.is_registered("example.com/none"), timeout_s=0.05)


# --- admission -----------------------------------------------------------------------------------


async def test_admission_uses_the_plugins_preference(node: Node) -> None:
    plugin = FakePlugin(preferred_available=True)
    await node.plug(plugin)
    pod = await node.sim.admit_pod("p", [("c", 2)])
    (request,) = plugin.called("GetPreferredAllocation")
    (container_request,) = request.container_requests
    assert list(container_request.available_deviceIDs) == ["d0", "d1", "d2", "d3"]
    assert list(container_request.must_include_deviceIDs) == []
    assert container_request.allocation_size == 2
    grant = pod.containers[0]
    assert grant.device_ids == ("d2", "d3")
    assert grant.preferred == ("d2", "d3")
    (allocate,) = plugin.called("Allocate")
    assert [list(r.devices_ids) for r in allocate.container_requests] == [["d2", "d3"]]
    assert grant.envs == {"FAKE_DEVICES": "d2,d3"}
    assert grant.mounts == (("/c", "/h", True),)
    assert grant.devices == (("/dev/x", "/dev/x", "rw"),)
    assert grant.annotations == {"fake/ids": "d2,d3"}
    assert grant.cdi_devices == ("fake.com/dev=d2", "fake.com/dev=d3")
    assert (pod.namespace, pod.name, grant.name, grant.resource_name) == (
        "default",
        "p",
        "c",
        RESOURCE,
    )
    # The next container is offered only what is left.
    await node.sim.admit_pod("q", [("c", 1)])
    second = plugin.called("GetPreferredAllocation")[1].container_requests[0]
    assert list(second.available_deviceIDs) == ["d0", "d1"]


async def test_admission_without_preference_takes_the_first_free_devices(node: Node) -> None:
    plugin = FakePlugin()
    await node.plug(plugin)
    pod = await node.sim.admit_pod("p", [("a", 1), ("b", 2)], namespace="ns")
    a, b = pod.containers
    assert (a.device_ids, b.device_ids) == (("d0",), ("d1", "d2"))
    assert (a.preferred, b.preferred) == ((), ())
    assert plugin.called("GetPreferredAllocation") == []
    # One Allocate per container, each with one container request.
    assert [len(r.container_requests) for r in plugin.called("Allocate")] == [1, 1]
    assert node.sim.allocated_ids(RESOURCE) == {"d0", "d1", "d2"}
    assert node.sim.get_pod("ns", "p") == pod


@pytest.mark.parametrize(
    ("preference", "expected"),
    [
        (lambda available, size: ["nope", "d9"], ("d0", "d1")),
        (lambda available, size: [], ("d0", "d1")),
        (lambda available, size: ["d3"], ("d3", "d0")),
        (lambda available, size: ["d3", "d2", "d1"], ("d3", "d2")),
    ],
    ids=["unknown-ids", "empty", "too-few", "too-many"],
)
async def test_an_unusable_preference_falls_back(
    node: Node,
    caplog: pytest.LogCaptureFixture,
    preference: Callable[[list[str], int], list[str]],
    expected: tuple[str, ...],
) -> None:
    plugin = FakePlugin(preferred_available=True, preference=preference)
    await node.plug(plugin)
    with caplog.at_level(logging.WARNING, logger="deviceplugin.sim.kubelet"):
        pod = await node.sim.admit_pod("p", [("c", 2)])
    assert pod.containers[0].device_ids == expected
    assert pod.containers[0].preferred == tuple(preference([], 2))
    assert "preferred allocation not usable" in caplog.text


async def test_insufficient_devices_are_refused(node: Node) -> None:
    plugin = FakePlugin()
    await node.plug(plugin)
    with pytest.raises(AdmissionError) as caught:
        await node.sim.admit_pod("big", [("c", 5)])
    assert RESOURCE in caught.value.message
    assert "Requested: 5, Available: 4" in caught.value.message
    assert caught.value.reason == "UnexpectedAdmissionError"
    await node.sim.admit_pod("three", [("c", 3)])
    with pytest.raises(AdmissionError, match="Requested: 2, Available: 1"):
        await node.sim.admit_pod("two", [("c", 2)])
    assert len(plugin.called("Allocate")) == 1
    assert [p.name for p in node.sim.pods()] == ["three"]


async def test_unregistered_resource_is_refused(node: Node) -> None:
    with pytest.raises(AdmissionError, match=r"cannot allocate unregistered device example\.com/x"):
        await node.sim.admit_pod("p", [("c", 1)], resource_name="example.com/x")


async def test_allocate_error_rejects_the_pod_and_keeps_nothing(node: Node) -> None:
    plugin = FakePlugin()
    await node.plug(plugin)
    plugin.fail_allocate_at = 1
    with pytest.raises(AdmissionError) as caught:
        await node.sim.admit_pod("p", [("a", 1), ("b", 2)])
    assert "device d9 is not known" in caught.value.message
    assert "InvalidArgument" in caught.value.message
    assert node.sim.pods() == []
    assert node.sim.allocated_ids(RESOURCE) == set()
    pod = await node.sim.admit_pod("all", [("c", 4)])
    assert pod.containers[0].device_ids == ("d0", "d1", "d2", "d3")


async def test_pre_start_container_is_called_when_required(node: Node) -> None:
    plugin = FakePlugin(pre_start_required=True)
    await node.plug(plugin)
    await node.sim.admit_pod("p", [("a", 1), ("b", 2)])
    assert [list(r.devices_ids) for r in plugin.called("PreStartContainer")] == [
        ["d0"],
        ["d1", "d2"],
    ]
    # After every Allocate of the pod, as the kubelet starts containers after admission.
    names = [name for name, _ in plugin.calls if name in {"Allocate", "PreStartContainer"}]
    assert names == ["Allocate", "Allocate", "PreStartContainer", "PreStartContainer"]


async def test_delete_pod_frees_its_devices(node: Node) -> None:
    await node.plug(FakePlugin())
    await node.sim.admit_pod("all", [("c", 4)])
    with pytest.raises(AdmissionError):
        await node.sim.admit_pod("more", [("c", 1)])
    await node.sim.delete_pod("default", "all")
    assert node.sim.pods() == []
    pod = await node.sim.admit_pod("more", [("c", 4)])
    assert len(pod.containers[0].device_ids) == 4
    with pytest.raises(KeyError):
        await node.sim.delete_pod("default", "all")


# --- restarts and the checkpoint -----------------------------------------------------------------


async def test_restart_cleans_sockets_keeps_allocations_and_waits_for_reregistration(
    node: Node,
) -> None:
    plugin = FakePlugin()
    server = await node.plug(plugin)
    held = await node.sim.admit_pod("held", [("c", 2)], namespace="prod")
    # A hard link keeps the old socket's inode alive, so a recreated socket has another one.
    old_socket = node.root / "old-kubelet.sock"
    old_socket.hardlink_to(node.dir / KUBELET_SOCKET)
    await node.sim.restart()
    assert not (node.dir / ENDPOINT).exists()
    assert (node.dir / KUBELET_SOCKET).stat().st_ino != old_socket.stat().st_ino
    assert (node.dir / CHECKPOINT_FILE).exists()
    assert node.sim.pods() == [held]
    assert not node.sim.is_registered(RESOURCE)
    assert node.sim.list_and_watch_updates(RESOURCE) == 0
    await eventually(lambda: plugin.streams_cancelled == 1)
    with pytest.raises(AdmissionError, match="no healthy devices present"):
        await node.sim.admit_pod("early", [("c", 1)])
    # The plugin notices its socket is gone, serves again and registers again.
    await server.stop(None)
    await node.plug(plugin)
    assert len(plugin.called("ListAndWatch")) == 2
    after = await node.sim.admit_pod("after", [("c", 2)])
    assert after.containers[0].device_ids == ("d2", "d3")
    assert [p.name for p in node.sim.pods()] == ["held", "after"]


async def test_a_new_kubelet_process_reads_the_checkpoint(node: Node) -> None:
    await node.plug(FakePlugin())
    held = await node.sim.admit_pod("held", [("a", 1), ("b", 2), ("none", 0)], namespace="prod")
    await node.sim.stop()
    document = json.loads((node.dir / CHECKPOINT_FILE).read_text())
    entries = document["Data"]["PodDeviceEntries"]
    assert {(e["ContainerName"], e["PodUID"]) for e in entries} == {
        ("a", held.uid),
        ("b", held.uid),
    }
    assert document["Data"]["RegisteredDevices"] == {RESOURCE: sorted(DEVICES)}
    fresh = KubeletSimulator(node.dir, node.podres_socket)
    await fresh.start()
    try:
        assert fresh.pods() == [held]
        assert fresh.healthy_ids(RESOURCE) == set()
        with pytest.raises(AdmissionError, match="no healthy devices present"):
            await fresh.admit_pod("early", [("c", 1)])
        async with pod_resources(node) as client:
            response = await client.Get(
                podres.GetPodResourcesRequest(pod_name="held", pod_namespace="prod")
            )
        b = response.pod_resources.containers[1]
        assert [(list(d.device_ids), [n.ID for n in d.topology.nodes]) for d in b.devices] == [
            (["d1"], [0]),
            (["d2"], [1]),
        ]
    finally:
        await fresh.stop()


# --- pod-resources -------------------------------------------------------------------------------


async def test_pod_resources_list_allocatable_and_get(node: Node) -> None:
    plugin = FakePlugin()
    await node.plug(plugin)
    await node.sim.admit_pod("p", [("a", 1), ("b", 2)], namespace="ns")
    await node.sim.admit_pod("q", [("c", 1)])
    await plugin.set_health("d0", UNHEALTHY)
    await node.sim.wait_for(lambda: node.sim.unhealthy_ids(RESOURCE) == {"d0"})
    async with pod_resources(node) as client:
        listed = await client.List(podres.ListPodResourcesRequest())
        summary = {
            (p.namespace, p.name): [
                (
                    c.name,
                    [
                        (d.resource_name, list(d.device_ids), d.HasField("topology"))
                        for d in c.devices
                    ],
                )
                for c in p.containers
            ]
            for p in listed.pod_resources
        }
        assert summary == {
            ("ns", "p"): [
                ("a", [(RESOURCE, ["d0"], True)]),
                ("b", [(RESOURCE, ["d1"], True), (RESOURCE, ["d2"], True)]),
            ],
            ("default", "q"): [("c", [(RESOURCE, ["d3"], False)])],
        }

        allocatable = await client.GetAllocatableResources(podres.AllocatableResourcesRequest())
        assert [
            (list(d.device_ids), [n.ID for n in d.topology.nodes]) for d in allocatable.devices
        ] == [(["d1"], [0]), (["d2"], [1]), (["d3"], [])]
        assert {d.resource_name for d in allocatable.devices} == {RESOURCE}

        got = await client.Get(podres.GetPodResourcesRequest(pod_name="p", pod_namespace="ns"))
        assert [c.name for c in got.pod_resources.containers] == ["a", "b"]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.Get(podres.GetPodResourcesRequest(pod_name="p", pod_namespace="default"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

        await node.sim.delete_pod("ns", "p")
        listed = await client.List(podres.ListPodResourcesRequest())
        assert [p.name for p in listed.pod_resources] == ["q"]


# --- command line --------------------------------------------------------------------------------


async def test_command_line_runs_until_sigterm(short_tmp: Path) -> None:
    plugin_dir = short_tmp / "dp"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "deviceplugin.sim.kubelet",
        "--dir",
        str(plugin_dir),
        "--pod-resources-socket",
        str(short_tmp / "pr.sock"),
        stderr=asyncio.subprocess.PIPE,
    )
    node = Node(short_tmp, KubeletSimulator(plugin_dir))  # only for its plugin helpers
    try:
        await eventually((plugin_dir / KUBELET_SOCKET).exists, timeout_s=10)
        plugin = FakePlugin()
        await node.serve(plugin)
        await node.register()
        await eventually(lambda: len(plugin.called("ListAndWatch")) == 1)
        await plugin.set_health("d2", UNHEALTHY)
        await asyncio.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 10)
        for server in node.servers:
            await server.stop(None)
    log = stderr.decode()
    assert process.returncode == 0, log
    assert f"registration accepted resource={RESOURCE}" in log
    assert "unhealthy=['d2']" in log
    assert not (plugin_dir / KUBELET_SOCKET).exists()
    assert not (short_tmp / "pr.sock").exists()


async def test_admission_needs_a_running_kubelet(short_tmp: Path) -> None:
    sim = KubeletSimulator(short_tmp / "dp")
    with pytest.raises(RuntimeError):
        await sim.admit_pod("p", [("c", 1)])


# --- a container holding several resources, through the kubelet's merge ----------------------


def _env_suffix(uuid: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", uuid.upper())


async def test_a_container_with_a_full_gpu_slice_and_a_mig_slice_gets_every_device_and_limit(
    short_tmp: Path,
) -> None:
    # The kubelet keeps one value per env key across a container's resources: what differs per
    # resource must be under keys of its own, and the device list must reach the container
    # runtime in a form the kubelet merges (the mounts), not only in one env value.
    from tests.blackbox.daemon_harness import Node as DaemonNode
    from tests.blackbox.daemon_harness import gpu, registered, running_daemon
    from tests.blackbox.test_mig import LAYOUT, MIG_1G, mig_gpu, mixed

    node = DaemonNode(short_tmp, [gpu(0, name="NVIDIA L4", memory_gib=24), mig_gpu(1, *LAYOUT)])
    await node.sim.start()
    try:
        async with running_daemon(node, mixed()):
            await registered(node, 4)
            await registered(node, 2, MIG_1G)
            pod = await node.sim.admit_pod("p", [("c", {RESOURCE: 1, MIG_1G: 1})])
            by_resource = {g.resource_name: g for g in pod.containers}
            full = by_resource[RESOURCE].device_ids[0].rsplit("::", 1)[0]
            mig = by_resource[MIG_1G].device_ids[0].rsplit("::", 1)[0]
            for _ in range(8):  # the kubelet's order of resources is Go's map order: any
                options = node.sim.container_run_options("default", "p", "c")
                assert sorted(toolkit_devices(options, accept_volume_mounts=True)) == sorted(
                    [full, mig]
                )
                envs = options.envs
                expected = {
                    full: ("6144", "25", by_resource[RESOURCE].envs["VGPU_ALLOCATION_ID"]),
                    mig: ("10240", "100", by_resource[MIG_1G].envs["VGPU_ALLOCATION_ID"]),
                }
                for uuid, (mib, percent, allocation) in expected.items():
                    suffix = _env_suffix(uuid)
                    assert envs[f"VGPU_MEMORY_LIMIT_MIB_{suffix}"] == mib
                    assert envs[f"VGPU_COMPUTE_SHARE_PERCENT_{suffix}"] == percent
                    assert envs[f"VGPU_ALLOCATION_ID_{suffix}"] == allocation
                per_device = [c for c in options.conflicts if _env_suffix(full) in c or
                              _env_suffix(mig) in c]  # fmt: skip
                assert per_device == []
    finally:
        await node.sim.stop()


def test_the_merge_keeps_one_value_per_env_key_and_every_distinct_mount_and_cdi_device() -> None:
    def grant(resource: str, device: str, share: str) -> ContainerGrant:
        return ContainerGrant(
            "c",
            resource,
            (f"{device}::0",),
            {"NVIDIA_VISIBLE_DEVICES": device, "SHARE": share, "SAME": "x"},
            ((f"/var/run/nvidia-container-devices/{device}", "/dev/null", True),),
            (),
            {},
            (f"nvidia.com/gpu={device}",),
            (),
        )

    grants = [grant("a.com/x", "GPU-A", "25"), grant("b.com/y", "MIG-B", "100")]
    seen_first = set()
    for seed in range(16):
        options = merge_run_options(grants, random.Random(seed))
        first = options.envs["NVIDIA_VISIBLE_DEVICES"]
        seen_first.add(first)
        assert options.envs["SHARE"] == ("25" if first == "GPU-A" else "100")
        assert sorted(options.conflicts) == ["env NVIDIA_VISIBLE_DEVICES", "env SHARE"]
        assert options.envs["SAME"] == "x"
        assert sorted(options.cdi_devices) == ["nvidia.com/gpu=GPU-A", "nvidia.com/gpu=MIG-B"]
        assert sorted(toolkit_devices(options, accept_volume_mounts=True)) == ["GPU-A", "MIG-B"]
        assert toolkit_devices(options, accept_volume_mounts=False) == [first]
        assert (
            toolkit_devices(options, accept_volume_mounts=False, accept_envvar_unprivileged=False)
            == []
        )
    assert seen_first == {"GPU-A", "MIG-B"}  # either resource may come first
