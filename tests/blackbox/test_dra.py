"""The daemon as a DRA driver, driven as the kubelet drives it: a fake plugin watcher that
registers it through its registration socket and calls NodePrepareResources and
NodeUnprepareResources (dra.v1 and dra.v1beta1) on its own socket, and a small fake API server
holding the claims and receiving the node's ResourceSlice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import stat
import time
import types
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin._proto.dra.v1 import api_pb2 as dra_v1
from deviceplugin._proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from deviceplugin._proto.dra.v1beta1 import api_pb2 as dra_v1beta1
from deviceplugin._proto.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from deviceplugin._proto.drahealth.v1alpha1 import api_pb2 as health_pb
from deviceplugin._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from deviceplugin._proto.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplugin._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from deviceplugin._proto.podresources.v1 import api_pb2 as podres
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as podres_grpc
from deviceplugin.app import Daemon
from deviceplugin.config import Config, DeviceIdStrategy
from deviceplugin.dra.settings import DraSettings
from deviceplugin.gpu.fake import FakeBackend, FakeProcess
from deviceplugin.kubelet.checkpoint import CheckpointReader
from deviceplugin.plugin.frontend import DevicePluginFrontend
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.plugin.resources import ResourcePlugins
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.plugin.tracker import AllocationTracker
from tests.blackbox.daemon_harness import (
    FAST,
    GiB,
    Node,
    Workloads,
    dra_frontend,
    eventually,
    gpu,
    running_daemon,
    with_processes,
)
from tests.support.fake_apiserver import FakeApiServer, allocated_claim

NODE = "test-node"
# Every gRPC call the tests make as the kubelet has a deadline: a stalled daemon fails the test
# with DEADLINE_EXCEEDED and the fake API server's state, never hangs it.
RPC_TIMEOUT_S = 30.0
GPU0 = gpu(0, name="NVIDIA A100-PCIE-40GB", memory_gib=40)
GPU1 = gpu(1, name="NVIDIA L4", memory_gib=24)


@pytest.fixture
def node(short_tmp: Path) -> Node:
    # A short directory: the kubelet's socket paths under it must fit a Unix socket address.
    return Node(short_tmp, [GPU0, GPU1])


def _dra(node: Node, api: FakeApiServer) -> DraSettings:
    return DraSettings(
        node_name=NODE,
        kubelet_root_dir=node.root / "kubelet",
        cdi_dir=node.root / "cdi",
        kubeconfig=api.kubeconfig(node.root / "kubeconfig"),
    )


@contextlib.asynccontextmanager
async def dra_daemon(
    node: Node,
    api: FakeApiServer,
    *,
    trust_host_processes: bool = True,
    dra: DraSettings | None = None,
    device_id_strategy: DeviceIdStrategy | None = None,
    config: Config | None = None,
) -> AsyncIterator[Daemon]:
    settings = dataclasses.replace(
        node.settings(config),
        dra=dra or _dra(node, api),
        trust_host_processes=trust_host_processes,
        device_id_strategy=device_id_strategy,
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield daemon
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def _register(settings: DraSettings) -> reg_pb.PluginInfo:
    """What the kubelet's plugin watcher does with a new socket in plugins_registry/."""
    await eventually(settings.registration_socket.exists, timeout_s=10)
    async with grpc.aio.insecure_channel(f"unix://{settings.registration_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info: reg_pb.PluginInfo = await stub.GetInfo(reg_pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        await stub.NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=True), timeout=RPC_TIMEOUT_S
        )
    return info


def _claim(uid: str, memory: str, compute: str, device: str = "gpu-0", **kw: Any) -> dict[str, Any]:
    return allocated_claim(
        f"claim-{uid}",
        uid,
        NODE,
        [
            {
                "request": "gpu",
                "device": device,
                "consumedCapacity": {"memory": memory, "compute": compute},
                "shareID": f"share-{uid}",
            }
        ],
        **kw,
    )


def _ref(pb: Any, uid: str) -> Any:
    return pb.Claim(namespace="default", uid=uid, name=f"claim-{uid}")


async def _prepare(socket: Path, uid: str, *, beta: bool = False) -> Any:
    pb, grpc_mod = (dra_v1beta1, dra_v1beta1_grpc) if beta else (dra_v1, dra_v1_grpc)
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = grpc_mod.DRAPluginStub(channel)
        response = await stub.NodePrepareResources(
            pb.NodePrepareResourcesRequest(claims=[_ref(pb, uid)]), timeout=RPC_TIMEOUT_S
        )
    return response.claims[uid]


async def _unprepare(socket: Path, uid: str) -> str:
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        response = await stub.NodeUnprepareResources(
            dra_v1.NodeUnprepareResourcesRequest(claims=[_ref(dra_v1, uid)]), timeout=RPC_TIMEOUT_S
        )
    return str(response.claims[uid].error)


def _spec(node: Node, uid: str) -> Path:
    return node.root / "cdi" / f"vgpu.dev-claim_{uid}.json"


def _env(spec: Path) -> dict[str, str]:
    doc = json.loads(spec.read_text())
    return dict(e.split("=", 1) for e in doc["devices"][0]["containerEdits"]["env"])


async def test_registers_publishes_its_slice_and_prepares_a_claim(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api) as daemon:
        info = await _register(settings)
        assert info.type == "DRAPlugin"
        assert info.name == "vgpu.dev"
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert info.endpoint == str(settings.service_socket)
        for sock in (settings.service_socket, settings.registration_socket):
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        await eventually(lambda: dra_frontend(daemon).registered)

        await eventually(lambda: len(api.slice_list()) == 1, timeout_s=10)
        published = api.slice_list()[0]
        assert published["spec"]["nodeName"] == NODE
        assert published["spec"]["pool"]["name"] == NODE
        assert published["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
        devices = {d["name"]: d for d in published["spec"]["devices"]}
        assert set(devices) == {"gpu-0", "gpu-1"}
        assert devices["gpu-0"]["capacity"]["memory"]["value"] == str(40 * GiB)
        assert devices["gpu-0"]["capacity"]["compute"]["value"] == "100"
        assert devices["gpu-1"]["attributes"]["productName"] == {"string": "NVIDIA L4"}

        api.put_claim(_claim("u-15", "15Gi", "30"))
        answer = await _prepare(settings.service_socket, "u-15")
        assert answer.error == ""
        (device,) = answer.devices
        assert device.device_name == "gpu-0"
        assert device.pool_name == NODE
        assert list(device.request_names) == ["gpu"]
        assert device.share_id == "share-u-15"
        assert list(device.cdi_device_ids) == ["vgpu.dev/claim=u-15", f"nvidia.com/gpu={GPU0.uuid}"]
        spec = _spec(node, "u-15")
        assert stat.S_IMODE(os.stat(spec).st_mode) == 0o600
        env = _env(spec)
        assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0.uuid
        assert env["VGPU_MEMORY_LIMIT_MIB_0"] == str(15 * 1024)
        assert env["VGPU_COMPUTE_SHARE_PERCENT_0"] == "30"
        allocation = env["VGPU_ALLOCATION_ID"]

        def container_limits() -> tuple[int, float] | None:
            snapshot = daemon.poller.snapshot
            for c in snapshot.containers if snapshot else ():
                if c.allocation_id == allocation:
                    return c.memory_limit_bytes, c.compute_share_ratio
            return None

        # The claim is an allocation like any other: limited to what it consumed.
        await eventually(lambda: container_limits() == (15 * GiB, 0.3), what="claim's limits")
        records = {r.allocation_id: r for r in daemon.book}
        assert records[allocation].pod == "pod-1"
        assert records[allocation].namespace == "default"
        assert (records[allocation].source, records[allocation].claim) == (
            "dra",
            "default/claim-u-15",
        )

        # Prepared twice (a kubelet retry): the same answer, from the checkpoint.
        again = await _prepare(settings.service_socket, "u-15", beta=True)
        assert list(again.devices[0].cdi_device_ids) == list(device.cdi_device_ids)

        assert await _unprepare(settings.service_socket, "u-15") == ""
        assert not spec.exists()
        assert allocation not in {r.allocation_id for r in daemon.book}
        # Unprepared twice: still fine.
        assert await _unprepare(settings.service_socket, "u-15") == ""
        await eventually(lambda: container_limits() is None, what="the claim gone")


def _reachable(root: object) -> list[object]:
    """Every object reachable from `root` through references (the daemon's parts, theirs...)."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen[id(obj)] = obj
        todo.extend(gc.get_referents(obj))
    return list(seen.values())


async def test_dra_mode_builds_no_device_plugin_part(node: Node, api: FakeApiServer) -> None:
    """In DRA mode the daemon serves the kubelet through its DRA sockets alone: no device-plugin
    socket or registration, no pod-resources tracker of the device-plugin kind, no reader of
    the kubelet's device checkpoint."""
    settings = _dra(node, api)
    async with dra_daemon(node, api) as daemon:
        await _register(settings)
        await eventually(lambda: dra_frontend(daemon).registered)
        await eventually(lambda: len(api.slice_list()) == 1, timeout_s=10)
        assert list(node.plugin_dir.iterdir()) == []  # no plugin socket
        device_plugin_parts = (
            DevicePluginFrontend,
            ResourcePlugins,
            PluginLifecycle,
            DevicePluginService,
            AllocationTracker,
            CheckpointReader,
        )
        built = [type(o).__name__ for o in _reachable(daemon) if isinstance(o, device_plugin_parts)]
        assert built == []
        # The check can fail: the same walk finds them in a device-plugin daemon.
    async with running_daemon(node) as plugins:
        await eventually(lambda: plugins.poller.snapshot is not None, what="the first poll")
        found = {type(o) for o in _reachable(plugins) if isinstance(o, device_plugin_parts)}
        assert found == set(device_plugin_parts)


def _allocation_info(daemon: Daemon) -> dict[str, dict[str, str]]:
    """vgpu_allocation_info's series, as GET /metrics serves them: allocation ID -> labels."""
    assert daemon.http is not None
    url = f"http://127.0.0.1:{daemon.http.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    found: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vgpu_allocation_info" and sample.value == 1:
                found[sample.labels["allocation_id"]] = dict(sample.labels)
    return found


async def test_metrics_name_a_prepared_claim_until_it_is_unprepared(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api) as daemon:
        await _register(settings)
        await eventually(lambda: len(api.slice_list()) == 1, timeout_s=10)
        api.put_claim(_claim("u-9", "9Gi", "20"))
        assert (await _prepare(settings.service_socket, "u-9")).error == ""
        allocation = _env(_spec(node, "u-9"))["VGPU_ALLOCATION_ID"]

        # The HTTP server answers from a thread of its own: a scrape from the loop is fine.
        await eventually(
            lambda: allocation in _allocation_info(daemon), what="the claim's allocation info"
        )
        labels = _allocation_info(daemon)[allocation]
        assert labels["node"] == NODE
        assert (labels["source"], labels["claim"]) == ("dra", "default/claim-u-9")
        assert (labels["namespace"], labels["pod"]) == ("default", "pod-1")

        assert await _unprepare(settings.service_socket, "u-9") == ""
        await eventually(
            lambda: allocation not in _allocation_info(daemon), what="the claim's series gone"
        )


async def test_a_claim_not_for_this_node_is_refused_with_its_reason(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api):
        await _register(settings)
        claim = _claim("u-x", "1Gi", "10")
        claim["status"]["allocation"]["devices"]["results"][0]["pool"] = "other-node"
        api.put_claim(claim)
        answer = await _prepare(settings.service_socket, "u-x")
        assert "other-node" in answer.error
        assert not _spec(node, "u-x").exists()
        missing = await _prepare(settings.service_socket, "u-missing")
        assert "claim-u-missing" in missing.error


async def test_a_prepared_claim_survives_a_daemon_restart(node: Node, api: FakeApiServer) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api):
        await _register(settings)
        api.put_claim(_claim("u-25", "25Gi", "50"))
        first = await _prepare(settings.service_socket, "u-25")
        assert first.error == ""
    # The claim is gone from the API server: what the new daemon answers comes from its
    # checkpoint, and the claim is held to its memory from the first poll.
    api.claims.clear()
    async with dra_daemon(node, api) as daemon:
        await _register(settings)
        again = await _prepare(settings.service_socket, "u-25")
        assert again.error == ""
        assert list(again.devices[0].cdi_device_ids) == list(first.devices[0].cdi_device_ids)
        env = _env(_spec(node, "u-25"))
        assert env["VGPU_MEMORY_LIMIT_MIB_0"] == str(25 * 1024)
        assert env["VGPU_ALLOCATION_ID"] in {r.allocation_id for r in daemon.book}
        assert await _unprepare(settings.service_socket, "u-25") == ""
        assert not _spec(node, "u-25").exists()


async def test_an_unhealthy_gpu_is_tainted_in_the_slice(node: Node, api: FakeApiServer) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api):
        await _register(settings)
        await eventually(lambda: len(api.slice_list()) == 1, timeout_s=10)
        node.write_gpus([dataclasses.replace(GPU0, healthy=False), GPU1])

        def taints() -> dict[str, Any]:
            devices = api.slice_list()[0]["spec"]["devices"]
            return {d["name"]: d.get("taints") for d in devices}

        await eventually(lambda: taints()["gpu-0"] is not None, timeout_s=10)
        assert taints() == {
            "gpu-0": [{"key": "vgpu.dev/unhealthy", "effect": "NoSchedule"}],
            "gpu-1": None,
        }
        assert api.slice_list()[0]["spec"]["pool"]["generation"] == 2


async def test_a_claim_is_held_to_the_memory_it_consumed_and_its_neighbour_is_not(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    workloads = Workloads()
    try:
        async with dra_daemon(node, api) as daemon:
            await _register(settings)
            api.put_claim(_claim("u-15", "15Gi", "30"))
            api.put_claim(_claim("u-25", "25Gi", "70", pod="pod-2"))
            for uid in ("u-15", "u-25"):
                assert (await _prepare(settings.service_socket, uid)).error == ""
            small = workloads.spawn(_env(_spec(node, "u-15")))
            big = workloads.spawn(_env(_spec(node, "u-25")))
            # 16Gi against a claim of 15Gi: over; 20Gi against 25Gi: within.
            node.write_gpus(
                [
                    with_processes(
                        GPU0, FakeProcess(small, 16 * GiB, 10), FakeProcess(big, 20 * GiB, 10)
                    ),
                    GPU1,
                ]
            )
            await eventually(lambda: not _alive(small), 15, "the over-claim process killed")
            assert _alive(big)

            def kills() -> list[tuple[str, str, int]]:
                snapshot = daemon.poller.snapshot
                return [
                    (e.namespace, e.pod, e.count)
                    for e in (snapshot.enforcement if snapshot else ())
                    if e.kind == "memory" and e.action == "kill"
                ]

            # Counted once, under the claim's namespace and pod.
            await eventually(lambda: kills() == [("default", "pod-1", 1)], 10, "the kill counted")
    finally:
        workloads.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_slice_deleted_by_someone_else_is_published_again(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api):
        await _register(settings)
        await eventually(lambda: len(api.slice_list()) == 1 and api.watches > 0, timeout_s=10)
        name = api.slice_list()[0]["metadata"]["name"]
        api.delete_slice(name)
        await eventually(lambda: len(api.slice_list()) == 1, timeout_s=10, what="the slice back")
        assert api.slice_list()[0]["metadata"]["name"] == name


async def test_the_health_stream_reports_a_gpu_turning_unhealthy(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api):
        await _register(settings)
        async with grpc.aio.insecure_channel(f"unix://{settings.service_socket}") as channel:
            stub = health_grpc.DRAResourceHealthStub(channel)
            stream = stub.NodeWatchResources(
                health_pb.NodeWatchResourcesRequest(), timeout=RPC_TIMEOUT_S
            )
            first = await asyncio.wait_for(stream.read(), 10)
            health = {d.device.device_name: d.health for d in first.devices}
            assert health == {"gpu-0": health_pb.HEALTHY, "gpu-1": health_pb.HEALTHY}
            assert {d.device.pool_name for d in first.devices} == {NODE}
            node.write_gpus([dataclasses.replace(GPU0, healthy=False), GPU1])
            while True:
                update = await asyncio.wait_for(stream.read(), 10)
                health = {d.device.device_name: d.health for d in update.devices}
                if health["gpu-0"] == health_pb.UNHEALTHY:
                    break
            assert health["gpu-1"] == health_pb.HEALTHY
            stream.cancel()


async def test_a_process_outside_the_claims_pods_is_refused_not_charged(
    node: Node, api: FakeApiServer
) -> None:
    """Design §12 in DRA mode: the claim's allocation ID in a process's environment is not
    enough; the process must run in a pod the claim is reserved for. A host process here is in
    no pod: its claim is refused and counted, and nothing is killed for it."""
    settings = _dra(node, api)
    workloads = Workloads()
    try:
        async with dra_daemon(node, api, trust_host_processes=False) as daemon:
            await _register(settings)
            api.put_claim(_claim("u-15", "15Gi", "30"))
            assert (await _prepare(settings.service_socket, "u-15")).error == ""
            intruder = workloads.spawn(_env(_spec(node, "u-15")))
            node.write_gpus([with_processes(GPU0, FakeProcess(intruder, 16 * GiB, 10)), GPU1])

            def misattributed() -> int:
                snapshot = daemon.poller.snapshot
                return sum(len(g.misattributed) for g in (snapshot.gpus if snapshot else ()))

            await eventually(lambda: misattributed() == 1, 10, "the claim refused")
            await asyncio.sleep(3)  # past the grace period
            assert _alive(intruder)
            snapshot = daemon.poller.snapshot
            assert snapshot is not None
            assert not [e for e in snapshot.enforcement if e.count]
    finally:
        workloads.close()


def test_serve_in_dra_mode_without_a_node_name_or_a_readable_kubeconfig_says_what_to_do(
    node: Node,
) -> None:
    from tests.blackbox.daemon_harness import serve_args
    from tests.blackbox.test_cli_interface import run_cli

    no_node = run_cli("serve", "--kubelet-api", "dra", *serve_args(node), env={"NODE_NAME": ""})
    assert no_node.returncode == 2
    assert "--kubelet-api dra needs --node-name" in no_node.stderr
    missing = node.root / "no-such-kubeconfig"
    bad = run_cli(
        "serve", "--kubelet-api", "dra", "--node-name", NODE, "--kubeconfig", str(missing),
        "--metrics-address", "127.0.0.1:0", *serve_args(node),
    )  # fmt: skip
    assert bad.returncode == 2
    assert f"cannot read the API server's address and credentials from {missing}" in bad.stderr
    assert "set --kubeconfig" in bad.stderr


async def test_a_reloaded_request_policy_is_published(node: Node, api: FakeApiServer) -> None:
    config_path = node.root / "config.yaml"
    config_path.write_text("dra: {compute: {default: 10}}\n")
    from deviceplugin.reload import read_config

    loaded = read_config(config_path)
    settings = dataclasses.replace(
        node.settings(dataclasses.replace(loaded.config, enforcement=FAST)),
        dra=_dra(node, api),
        config_path=config_path,
        config_hash=loaded.hash,
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))

    def compute_default() -> str:
        slices = api.slice_list()
        if not slices:
            return ""
        return str(
            slices[0]["spec"]["devices"][0]["capacity"]["compute"]["requestPolicy"]["default"]
        )

    try:
        await _register(settings.dra)  # type: ignore[arg-type]
        await eventually(lambda: compute_default() == "10", timeout_s=10, what="default 10")
        config_path.write_text("dra: {compute: {default: 20}}\n")
        await eventually(lambda: compute_default() == "20", timeout_s=15, what="default 20")
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def test_compute_shares_of_two_claims_are_held_in_the_fake_gpu(
    node: Node, api: FakeApiServer
) -> None:
    """Claims of 25 and 75 compute, both processes wanting the whole GPU: the smaller claim is
    throttled (a duty cycle), the larger is not."""
    settings = _dra(node, api)
    workloads = Workloads()
    try:
        async with dra_daemon(node, api) as daemon:
            await _register(settings)
            api.put_claim(_claim("u-small", "4Gi", "25"))
            api.put_claim(_claim("u-big", "4Gi", "75", pod="pod-2"))
            for uid in ("u-small", "u-big"):
                assert (await _prepare(settings.service_socket, uid)).error == ""
            small = workloads.spawn(_env(_spec(node, "u-small")))
            big = workloads.spawn(_env(_spec(node, "u-big")))
            node.write_gpus(
                [
                    with_processes(GPU0, FakeProcess(small, GiB, 100), FakeProcess(big, GiB, 100)),
                    GPU1,
                ]
            )

            def duty(pod: str) -> float | None:
                snapshot = daemon.poller.snapshot
                for c in snapshot.containers if snapshot else ():
                    if c.pod == pod:
                        return c.duty_cycle_ratio
                return None

            def shares() -> dict[str, float]:
                snapshot = daemon.poller.snapshot
                return {
                    c.pod: c.compute_share_ratio for c in (snapshot.containers if snapshot else ())
                }

            await eventually(lambda: shares() == {"pod-1": 0.25, "pod-2": 0.75}, 10, "shares")
            await eventually(lambda: duty("pod-1") is not None, 15, "the 25% claim throttled")
            assert duty("pod-2") is None
    finally:
        workloads.close()


async def test_a_claim_the_api_server_never_answers_fails_that_claim_not_the_kubelet(
    node: Node, api: FakeApiServer
) -> None:
    """A claim GET that the API server never answers: NodePrepareResources returns after the
    driver's API timeout with that claim's error, naming the API server and the timeout, and
    the daemon goes on preparing other claims."""
    settings = dataclasses.replace(_dra(node, api), api_timeout_s=1.0)
    async with dra_daemon(node, api, dra=settings):
        await _register(settings)
        api.put_claim(_claim("u-stall", "1Gi", "10"))
        api.stall_claims.add(("default", "claim-u-stall"))
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await _prepare(settings.service_socket, "u-stall")
        assert loop.time() - started < 10, "the stalled GET held the kubelet's call"
        assert answer.error.startswith("get ResourceClaim default/claim-u-stall: ")
        assert f"the API server at {api.url} did not answer within 1s" in answer.error
        assert not _spec(node, "u-stall").exists()
        api.put_claim(_claim("u-ok", "1Gi", "10", pod="pod-2"))
        assert (await _prepare(settings.service_socket, "u-ok")).error == ""


async def test_stalled_claims_cost_one_api_timeout_and_hold_up_no_other_call(
    node: Node, api: FakeApiServer
) -> None:
    """Three claims the API server never answers, in one NodePrepareResources: the call returns
    after one API timeout, not three; while it waits, another claim is unprepared at once."""
    settings = dataclasses.replace(_dra(node, api), api_timeout_s=1.5)
    async with dra_daemon(node, api, dra=settings):
        await _register(settings)
        api.put_claim(_claim("u-ok", "1Gi", "10"))
        assert (await _prepare(settings.service_socket, "u-ok")).error == ""
        stalled = ["u-s1", "u-s2", "u-s3"]
        for uid in stalled:
            api.put_claim(_claim(uid, "1Gi", "10"))
            api.stall_claims.add(("default", f"claim-{uid}"))
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with grpc.aio.insecure_channel(f"unix://{settings.service_socket}") as channel:
            call = dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1.NodePrepareResourcesRequest(claims=[_ref(dra_v1, u) for u in stalled]),
                timeout=RPC_TIMEOUT_S,
            )
            await asyncio.sleep(0.3)  # the GETs are out
            assert await _unprepare(settings.service_socket, "u-ok") == ""
            assert loop.time() - started < 1.5, "the unprepare waited for the stalled GETs"
            assert not _spec(node, "u-ok").exists()
            answer = await call
        # One timeout (1.5 s) for the three; one after the other they take 4.5 s at least.
        assert loop.time() - started < 4.0
        for uid in stalled:
            assert "did not answer within 1.5s" in answer.claims[uid].error
            assert not _spec(node, uid).exists()


def test_a_client_stalled_mid_request_holds_up_nobody_else(api: FakeApiServer) -> None:
    """The fake API server itself: a client that sent a write's headers but not its body (the
    daemon, on the test's own event loop, between two writes) must not keep the test from the
    server's state, nor the server from other requests."""
    import socket
    import threading

    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as stalled:
        stalled.sendall(
            b"POST /apis/resource.k8s.io/v1/resourceslices HTTP/1.1\r\n"
            b"Host: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        deadline = time.monotonic() + 5
        while ("POST", "/apis/resource.k8s.io/v1/resourceslices") not in api.requests:
            assert time.monotonic() < deadline, "the fake API server did not take the request"
            time.sleep(0.02)
        found: list[object] = []
        reader = threading.Thread(target=lambda: found.append(api.slice_list()), daemon=True)
        reader.start()
        reader.join(5)
        assert found == [[]], "the fake API server's state stayed locked by a stalled request"
        url = f"http://{host}:{port}/api/v1/nodes/{NODE}"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert json.loads(response.read())["metadata"]["name"] == NODE


class _PodResources(podres_grpc.PodResourcesListerServicer):
    """The kubelet's pod-resources List, with its DRA entries: (pod, container) -> claims."""

    def __init__(self) -> None:
        self.users: dict[tuple[str, str], list[str]] = {}

    async def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        pods: dict[str, Any] = {}
        for (pod, container), claims in self.users.items():
            entry = pods.setdefault(pod, podres.PodResources(name=pod, namespace="default"))
            entry.containers.add(
                name=container,
                dynamic_resources=[
                    podres.DynamicResource(
                        claim_name=claim,
                        claim_namespace="default",
                        claim_resources=[
                            podres.ClaimResource(
                                driver_name="vgpu.dev", pool_name=NODE, device_name="gpu-0"
                            )
                        ],
                    )
                    for claim in claims
                ],
            )
        return podres.ListPodResourcesResponse(pod_resources=list(pods.values()))

    async def GetAllocatableResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    async def Get(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")


async def test_a_pod_joining_a_prepared_claim_is_named_and_becomes_its_evidence(
    node: Node, api: FakeApiServer
) -> None:
    """A claim shared by two pods: the kubelet prepares it for the first and, for the second,
    only lists it in pod-resources. The second pod is read from the claim's reservedFor and
    named with the claim, so its container's processes are the claim's too."""
    settings = _dra(node, api)
    pod_resources = _PodResources()
    server = grpc.aio.server()
    podres_grpc.add_PodResourcesListerServicer_to_server(pod_resources, server)
    server.add_insecure_port(f"unix://{node.podres_socket}")
    await server.start()
    try:
        async with dra_daemon(node, api) as daemon:
            await _register(settings)
            claim = _claim("u-shared", "15Gi", "30")
            api.put_claim(claim)
            assert (await _prepare(settings.service_socket, "u-shared")).error == ""
            pod_resources.users[("pod-1", "main")] = ["claim-u-shared"]
            allocation = _env(_spec(node, "u-shared"))["VGPU_ALLOCATION_ID"]

            def named() -> tuple[str, str]:
                record = {r.allocation_id: r for r in daemon.book}[allocation]
                return record.pod, record.container

            await eventually(lambda: named() == ("pod-1", "main"), 10, "the claim named")
            # The second pod: reserved by the scheduler, listed by the kubelet, not prepared.
            claim["status"]["reservedFor"].append(
                {"resource": "pods", "name": "pod-2", "uid": "uid-pod-2"}
            )
            api.put_claim(claim)
            pod_resources.users[("pod-2", "main")] = ["claim-u-shared"]
            await eventually(lambda: named() == ("pod-1,pod-2", "main"), 15, "pod-2 named")
            owners = {(o.pod_uid, o.container) for o in dra_frontend(daemon).evidence().entries}
            assert owners == {("uid-pod-1", "main"), ("uid-pod-2", "main")}
    finally:
        await server.stop(None)


async def test_a_reload_asking_for_device_ids_by_index_says_the_dra_driver_ignores_it(
    node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _dra(node, api)
    async with dra_daemon(node, api) as daemon:
        await _register(settings)
        assert "deviceIDStrategy index is ignored" not in caplog.text
        config = daemon.config
        by_index = dataclasses.replace(
            config,
            allocation=dataclasses.replace(
                config.allocation, device_id_strategy=DeviceIdStrategy.INDEX
            ),
        )
        await daemon.apply_config(by_index)
        assert "config reload: deviceIDStrategy index is ignored: the DRA driver" in caplog.text
        api.put_claim(_claim("u-idx", "10Gi", "50"))
        assert (await _prepare(settings.service_socket, "u-idx")).error == ""
        assert _env(_spec(node, "u-idx"))["NVIDIA_VISIBLE_DEVICES"] == GPU0.uuid


async def test_the_dra_driver_names_gpus_by_uuid_whatever_the_device_id_strategy(
    node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    # NVIDIA's DRA driver names GPUs by UUID; deviceIDStrategy belongs to the device plugins.
    settings = _dra(node, api)
    async with dra_daemon(node, api, device_id_strategy=DeviceIdStrategy.INDEX):
        await _register(settings)
        api.put_claim(_claim("u-idx", "10Gi", "50"))
        answer = await _prepare(settings.service_socket, "u-idx")
        assert answer.error == ""
        (device,) = answer.devices
        assert f"nvidia.com/gpu={GPU0.uuid}" in device.cdi_device_ids
        assert _env(_spec(node, "u-idx"))["NVIDIA_VISIBLE_DEVICES"] == GPU0.uuid
    assert "deviceIDStrategy index is ignored: the DRA driver names GPUs by UUID" in caplog.text
