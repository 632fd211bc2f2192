"""Per-container usage through the whole daemon: attribution, the exporter and /status."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.app import Daemon
from deviceplugin.gpu.fake import FakeProcess
from tests.blackbox.daemon_harness import (
    RESOURCE,
    TWO_GPUS,
    GiB,
    Node,
    Workloads,
    eventually,
    registered,
    running_daemon,
    with_processes,
)

CONTRACT_METRICS = {
    "vgpu_gpu_info",
    "vgpu_gpu_healthy",
    "vgpu_gpu_memory_total_bytes",
    "vgpu_gpu_memory_used_bytes",
    "vgpu_gpu_utilization_ratio",
    "vgpu_slices",
    "vgpu_container_gpu_memory_used_bytes",
    "vgpu_container_gpu_memory_limit_bytes",
    "vgpu_container_sm_utilization_ratio",
    "vgpu_container_compute_share_ratio",
    "vgpu_container_throttled_seconds_total",
    "vgpu_enforcement_actions_total",
    "vgpu_allocate_duration_seconds",
    "vgpu_poll_duration_seconds",
    "vgpu_kubelet_registrations_total",
}


def get(daemon: Daemon, path: str) -> tuple[int, str]:
    assert daemon.http is not None
    url = f"http://127.0.0.1:{daemon.http.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def container_value(
    text: str, metric: str, *, pod: str | None = None, allocation_id: str | None = None
) -> float | None:
    for labels, value in samples(text).get(metric, []):
        if pod is not None and labels.get("pod") != pod:
            continue
        if allocation_id is not None and labels.get("allocation_id") != allocation_id:
            continue
        return value
    return None


async def test_container_usage_reaches_metrics_under_its_pod(
    node: Node, workloads: Workloads
) -> None:
    async with running_daemon(node, pod_resources_interval_s=0.5) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("train", [("main", 2)], namespace="ml")).containers[0]
        gpu = next(g for g in TWO_GPUS if grant.device_ids[0].startswith(g.uuid))
        other = next(g for g in TWO_GPUS if g is not gpu)
        worker = workloads.spawn(grant.envs)
        stranger = workloads.spawn()
        node.write_gpus(
            [
                with_processes(gpu, FakeProcess(worker, 3 * GiB, 40)),
                with_processes(other, FakeProcess(stranger, 1 * GiB, 10)),
            ]
        )
        allocation = grant.envs["VGPU_ALLOCATION_ID"]

        def named() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                c.pod == "train" and c.memory_used_bytes == 3 * GiB for c in snap.containers
            )

        await eventually(named, timeout_s=10)
        status, text = get(daemon, "/metrics")
        assert status == 200
        found = [
            labels
            for labels, _ in samples(text)["vgpu_container_gpu_memory_used_bytes"]
            if labels["allocation_id"] == allocation
        ]
        assert found == [
            {
                "node": "test-node",
                "namespace": "ml",
                "pod": "train",
                "container": "main",
                "gpu_uuid": gpu.uuid,
                "allocation_id": allocation,
            }
        ]
        assert container_value(text, "vgpu_container_gpu_memory_used_bytes", pod="train") == (
            3 * GiB
        )
        limit = 2 * (gpu.memory_total_bytes // 4)
        assert container_value(text, "vgpu_container_gpu_memory_limit_bytes", pod="train") == limit
        assert container_value(text, "vgpu_container_compute_share_ratio", pod="train") == 0.5
        # The process without the allocation's env belongs to nobody, and is counted as such.
        unattributed = {
            labels["gpu_uuid"]: value
            for labels, value in samples(text)["vgpu_gpu_unattributed_processes"]
        }
        assert unattributed == {gpu.uuid: 0, other.uuid: 1}
        families = list(text_string_to_metric_families(text))
        # The parser names a counter's family without its _total suffix.
        exposed = {f.name for f in families} | {
            f.name + "_total" for f in families if f.type == "counter"
        }
        assert exposed >= CONTRACT_METRICS, CONTRACT_METRICS - exposed
        status, body = get(daemon, "/healthz")
        assert status == 200, body


async def test_utilisation_is_measured_from_the_process(node: Node, workloads: Workloads) -> None:
    async with running_daemon(node, pod_resources_interval_s=0.5) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("busy", [("c", 1)])).containers[0]
        gpu = next(g for g in TWO_GPUS if grant.device_ids[0].startswith(g.uuid))
        pid = workloads.spawn(grant.envs)
        node.write_gpus(
            [with_processes(gpu, FakeProcess(pid, GiB, 60)) if g is gpu else g for g in TWO_GPUS]
        )

        def busy() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                c.pod == "busy" and c.sm_utilization_ratio > 0.3 for c in snap.containers
            )

        await eventually(busy, timeout_s=10)


async def test_pod_resources_down_keeps_metrics_and_allocation_until_names_return(
    node: Node, workloads: Workloads
) -> None:
    # The daemon asks pod-resources through a link that does not exist yet: unreachable.
    link = node.root / "podres-link.sock"
    async with running_daemon(
        node, pod_resources_interval_s=0.3, pod_resources_socket=link
    ) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("web", [("srv", 1)])).containers[0]
        gpu = next(g for g in TWO_GPUS if grant.device_ids[0].startswith(g.uuid))
        pid = workloads.spawn(grant.envs)
        node.write_gpus(
            [with_processes(gpu, FakeProcess(pid, GiB, 10)) if g is gpu else g for g in TWO_GPUS]
        )
        allocation = grant.envs["VGPU_ALLOCATION_ID"]

        def measured() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                c.allocation_id == allocation and c.memory_used_bytes == GiB
                for c in snap.containers
            )

        await eventually(measured, timeout_s=10)
        _, text = get(daemon, "/metrics")
        labels = [
            labels
            for labels, value in samples(text)["vgpu_container_gpu_memory_used_bytes"]
            if labels["allocation_id"] == allocation and value == GiB
        ]
        assert [(lb["namespace"], lb["pod"], lb["container"]) for lb in labels] == [("", "", "")]
        assert samples(text)["vgpu_pod_resources_up"][0][1] == 0
        assert len(samples(text)["vgpu_gpu_memory_used_bytes"]) == 2  # GPU figures keep flowing
        # pod-resources answers again: the same series gain their names.
        assert node.sim.pod_resources_socket is not None
        link.symlink_to(node.sim.pod_resources_socket)

        def named() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                c.allocation_id == allocation
                and (c.namespace, c.pod, c.container) == ("default", "web", "srv")
                for c in snap.containers
            )

        await eventually(named, timeout_s=10)


async def test_deleted_pod_drops_its_series(node: Node, workloads: Workloads) -> None:
    async with running_daemon(node, pod_resources_interval_s=0.3) as daemon:
        await registered(node, 8)
        await node.sim.admit_pod("gone", [("c", 1)])
        await node.sim.admit_pod("stays", [("c", 1)])

        def pods() -> set[str]:
            snap = daemon.poller.snapshot
            return {c.pod for c in snap.containers} if snap else set()

        await eventually(lambda: pods() == {"gone", "stays"}, timeout_s=10)
        await node.sim.delete_pod("default", "gone")
        await eventually(lambda: pods() == {"stays"}, timeout_s=10)
        _, text = get(daemon, "/metrics")
        assert {
            labels["pod"] for labels, _ in samples(text)["vgpu_container_gpu_memory_limit_bytes"]
        } == {"stays"}


async def test_malformed_state_file_mid_run_keeps_usage_flowing(
    node: Node, workloads: Workloads
) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        node.state_file.write_text('{"gpus": [{"uuid": 1}]}')
        polls = daemon.poller.last_success_wall_s
        await eventually(lambda: daemon.poller.last_success_wall_s > polls, timeout_s=5)
        assert daemon.poller.snapshot is not None
        assert not daemon.poller.snapshot.stale
        assert len(daemon.poller.snapshot.gpus) == 2
        status, _ = get(daemon, "/healthz")
        assert status == 200


async def test_status_json_and_cli_against_the_running_daemon(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        await node.sim.admit_pod("nb", [("jupyter", 1)])
        await eventually(
            lambda: (
                daemon.poller.snapshot is not None
                and any(c.pod == "nb" for c in daemon.poller.snapshot.containers)
            )
        )
        status, body = get(daemon, "/status")
        assert status == 200
        doc = json.loads(body)
        assert [g["uuid"] for g in doc["gpus"]] == [g.uuid for g in TWO_GPUS]
        assert daemon.http is not None
        # As `--metrics-address` gives it, and as a browser's address bar does.
        for address in (f"127.0.0.1:{daemon.http.port}", f"http://127.0.0.1:{daemon.http.port}/"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "deviceplugin",
                "status",
                "--address",
                address,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()
            view = out.decode()
            assert "NVIDIA L4" in view
            assert "default/nb/jupyter" in view
            assert all(len(line) <= 80 for line in view.splitlines())
        assert RESOURCE  # the view is of this resource's slices
