"""vgpu on a real kubelet v1.36.2 (containerd + runc when installed): registration, pods and
the environment their containers have, accounting, attribution evidence and enforcement.

Expectations are computed from the contracts (docs/design.md §3) and from what the kubelet
itself recorded (its device checkpoint), never from vgpu's own answers."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeMigDevice, FakeProcess, FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import (
    RESOURCE,
    Cluster,
    Daemon,
    container,
    containerd_missing,
    pod_manifest,
    wait_until,
)

GiB = 1024**3
A100 = gpu(0)  # 80 GiB: 20 GiB a slice
L4 = gpu(1, name="NVIDIA L4", memory_gib=24, numa_node=1)  # 6 GiB a slice
GPUS = FakeState(gpus=(A100, L4))
MIB_PER_SLICE = {A100.uuid: 20 * 1024, L4.uuid: 6 * 1024}
INDEX = {A100.uuid: 0, L4.uuid: 1}
CONFIG = """\
slicing: {replicas: 4}
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {action: kill, gracePeriod: 1s}
  compute: {action: throttle, window: 1s, period: 250ms}
"""


def allocation_id(device_ids: list[str]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def expected_env(device_ids: list[str]) -> dict[str, str]:
    """What Allocate must give a container holding `device_ids` (docs/design.md §3)."""
    per_gpu: dict[str, int] = {}
    for device in device_ids:
        uuid = device.split("::", 1)[0]
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    gpus = sorted(per_gpu, key=INDEX.__getitem__)
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(gpus),
        "VGPU_ALLOCATION_ID": allocation_id(device_ids),
    }
    for i, uuid in enumerate(gpus):
        env[f"VGPU_MEMORY_LIMIT_MIB_{i}"] = str(per_gpu[uuid] * MIB_PER_SLICE[uuid])
        env[f"VGPU_COMPUTE_SHARE_PERCENT_{i}"] = str(per_gpu[uuid] * 25)
    return env


def allocated(daemon: Daemon) -> int:
    return sum(g["slices"]["allocated"] for g in daemon.status()["gpus"])


def wait_allocated(daemon: Daemon, count: int, timeout_s: float = 20) -> None:
    wait_until(lambda: allocated(daemon) == count, timeout_s=timeout_s, what=f"{count} allocated")


@pytest.fixture
def vgpu(node: Cluster) -> Daemon:
    daemon = node.start_daemon(config=CONFIG, gpus=GPUS)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    return daemon


@pytest.fixture
def host_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test spawns on the host; resumed and killed when it ends."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(5)


def test_registration_node_capacity_and_allocatable_are_the_plan(vgpu: Daemon) -> None:
    node = vgpu.cluster
    status = vgpu.status()
    assert status["health"]["registered"] is True
    assert [g["slices"]["total"] for g in status["gpus"]] == [4, 4]
    assert node.capacity(RESOURCE) == 8 == node.allocatable(RESOURCE)


def test_pods_with_one_two_three_slices_run_with_their_env(vgpu: Daemon) -> None:
    node = vgpu.cluster
    for n in (1, 2, 3):
        node.create_pod(pod_manifest(f"slices-{n}", {RESOURCE: n}))
    for n in (1, 2, 3):
        node.wait_running(f"slices-{n}")
    seen: set[str] = set()
    for n in (1, 2, 3):
        devices = node.checkpoint_devices(f"slices-{n}", "main")
        assert len(devices) == n
        assert not seen & set(devices), "a slice handed to two pods"
        seen |= set(devices)
        env = node.container_env(f"slices-{n}", "main")
        want = expected_env(devices)
        assert {k: env.get(k) for k in want} == want
        hints = [k for k in env if re.fullmatch(r"VGPU_MEMORY_FRACTION_\d+", k)]
        assert len(hints) == want["NVIDIA_VISIBLE_DEVICES"].count(",") + 1
        assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    wait_allocated(vgpu, 6)


def test_pod_over_capacity_stays_pending_and_is_not_refused(vgpu: Daemon) -> None:
    node = vgpu.cluster
    node.create_pod(pod_manifest("too-big", {RESOURCE: 9}))  # accepted by the API server
    pod = node.assert_stays_pending("too-big", seconds=3)
    # The scheduler's reason; on a loaded machine the node may be briefly tainted not-ready
    # (a late heartbeat), and the scheduler says so until it tries the pod again.
    deadline = time.monotonic() + 30
    while True:
        scheduled = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        assert scheduled
        assert scheduled[0]["status"] == "False"
        assert scheduled[0]["reason"] == "Unschedulable"
        if f"Insufficient {RESOURCE}" in scheduled[0]["message"]:
            break
        assert time.monotonic() < deadline, scheduled[0]["message"]
        time.sleep(0.5)
        pod = node.pod("too-big")
    assert pod["status"]["phase"] == "Pending"
    assert allocated(vgpu) == 0


def test_deleted_pod_slices_are_no_longer_counted(vgpu: Daemon) -> None:
    node = vgpu.cluster
    node.create_pod(pod_manifest("short-lived", {RESOURCE: 2}))
    node.wait_running("short-lived")
    wait_allocated(vgpu, 2)
    node.delete_pod("short-lived", wait=False)
    deleted = time.monotonic()
    while allocated(vgpu) != 0:
        slices = [g["slices"] for g in vgpu.status()["gpus"]]
        assert all(s["unconfirmed"] == 0 for s in slices), slices
        assert time.monotonic() < deleted + 20, f"still counted: {slices}"
        time.sleep(0.1)
    print(f"slices of a deleted pod no longer counted after {time.monotonic() - deleted:.2f} s")
    node.wait_pod_gone("short-lived")
    assert vgpu.status()["allocations"] == []
    node.wait_allocatable(RESOURCE, 8)


def test_init_container_and_two_app_containers(vgpu: Daemon) -> None:
    node = vgpu.cluster
    node.create_pod(
        pod_manifest(
            "multi",
            containers=[container("main", {RESOURCE: 2}), container("helper", {RESOURCE: 1})],
            init_containers=[container("setup", {RESOURCE: 1}, command=["/bin/true"])],
        )
    )
    node.wait_running("multi")
    main = node.checkpoint_devices("multi", "main")
    helper = node.checkpoint_devices("multi", "helper")
    assert (len(main), len(helper)) == (2, 1)
    assert not set(main) & set(helper)
    for name, devices in (("main", main), ("helper", helper)):
        env = node.container_env("multi", name)
        want = expected_env(devices)
        assert {k: env.get(k) for k in want} == want
    # The init container's slice is reused by the app containers: 3 in use, not 4.
    wait_allocated(vgpu, 3)
    names = {(a["pod"], a["container"]) for a in vgpu.status()["allocations"]}
    assert {("multi", "main"), ("multi", "helper")} <= names


def test_finished_init_container_allocation_is_not_left_unnamed(vgpu: Daemon) -> None:
    node = vgpu.cluster
    node.create_pod(
        pod_manifest(
            "with-init",
            containers=[container("main", {RESOURCE: 2})],  # the init's slice and one more
            init_containers=[container("setup", {RESOURCE: 1}, command=["/bin/true"])],
        )
    )
    node.wait_running("with-init")

    def named() -> list[dict[str, Any]] | None:
        allocations = vgpu.status()["allocations"]
        return allocations if any(a["pod"] == "with-init" for a in allocations) else None

    wait_until(named, timeout_s=20, what="the pod's allocation named")
    time.sleep(1)
    allocations = vgpu.status()["allocations"]
    assert all(a["pod"] and a["container"] for a in allocations), allocations


def test_pod_resources_names_in_status_and_metrics(vgpu: Daemon) -> None:
    node = vgpu.cluster
    node.create_pod(pod_manifest("named", {RESOURCE: 1}))
    node.wait_running("named")
    devices = node.checkpoint_devices("named", "main")

    def record() -> dict[str, Any] | None:
        for a in vgpu.status()["allocations"]:
            if a["pod"] == "named":
                return dict(a)
        return None

    found = wait_until(record, timeout_s=20, what="allocation named after its pod")
    assert (found["namespace"], found["container"]) == ("default", "main")
    assert sorted(found["slice_ids"]) == devices
    assert found["allocation_id"] == allocation_id(devices)
    metrics = vgpu.metrics()
    assert 'pod="named"' in metrics, "no series names the pod"
    assert 'namespace="default"' in metrics


def _fake_state(processes: dict[str, list[FakeProcess]]) -> FakeState:
    return FakeState(
        gpus=tuple(
            dataclasses.replace(g, processes=tuple(processes.get(g.uuid, ()))) for g in GPUS.gpus
        )
    )


def test_memory_enforcement_kills_only_the_container_over_its_limit(
    vgpu: Daemon, host_processes: list[subprocess.Popen[bytes]]
) -> None:
    node = vgpu.cluster
    if node.runtime != "containerd":
        pytest.skip(f"needs real containers: {containerd_missing(node.bundle)}")
    node.create_pod(
        pod_manifest(
            "greedy",
            containers=[container("main", {RESOURCE: 1}), container("sidecar")],
        )
    )
    node.wait_running("greedy")
    devices = node.checkpoint_devices("greedy", "main")
    gpu_uuid = devices[0].split("::", 1)[0]
    alloc = allocation_id(devices)
    # Another pod, without slices, claims greedy's allocation.
    copycat = container("main")
    copycat["env"] = [{"name": "VGPU_ALLOCATION_ID", "value": alloc}]
    node.create_pod(pod_manifest("copycat", containers=[copycat]))
    node.wait_running("copycat")
    main_pid = node.container_init_pid("greedy", "main")
    sidecar_pid = node.container_init_pid("greedy", "sidecar")
    copycat_pid = node.container_init_pid("copycat", "main")
    host = subprocess.Popen(
        ["sleep", "300"], env={"PATH": os.environ["PATH"], "VGPU_ALLOCATION_ID": alloc}
    )
    host_processes.append(host)
    limit = MIB_PER_SLICE[gpu_uuid] * 1024**2
    big = limit + GiB
    # Phase 1: the container is within its limit; three others over it claim or sit beside it.
    node.write_gpus(
        _fake_state(
            {
                gpu_uuid: [
                    FakeProcess(pid=main_pid, used_memory_bytes=GiB),
                    FakeProcess(pid=sidecar_pid, used_memory_bytes=big),
                    FakeProcess(pid=copycat_pid, used_memory_bytes=big),
                    FakeProcess(pid=host.pid, used_memory_bytes=big),
                ]
            }
        )
    )

    def charged() -> dict[str, Any] | None:
        for c in vgpu.status()["containers"]:
            if c["pod"] == "greedy" and c["container"] == "main":
                return dict(c)
        return None

    usage = wait_until(charged, timeout_s=20, what="greedy/main's usage")
    time.sleep(2.5)  # longer than the grace period, many polls
    usage = wait_until(charged, timeout_s=5, what="greedy/main's usage")
    assert usage["memory_used_bytes"] == GiB, usage
    gpu_status = next(g for g in vgpu.status()["gpus"] if g["uuid"] == gpu_uuid)
    assert gpu_status["misattributed_processes"] == 2, json.dumps(gpu_status)  # copycat, host
    for pid in (main_pid, sidecar_pid, copycat_pid, host.pid):
        assert os.path.exists(f"/proc/{pid}"), f"pid {pid} was killed"
    assert host.poll() is None
    # Phase 2: the container itself goes over its limit: killed after the grace period.
    node.write_gpus(
        _fake_state(
            {
                gpu_uuid: [
                    FakeProcess(pid=main_pid, used_memory_bytes=big),
                    FakeProcess(pid=sidecar_pid, used_memory_bytes=big),
                    FakeProcess(pid=copycat_pid, used_memory_bytes=big),
                    FakeProcess(pid=host.pid, used_memory_bytes=big),
                ]
            }
        )
    )
    started = time.monotonic()
    wait_until(lambda: not os.path.exists(f"/proc/{main_pid}"), timeout_s=15, what="the kill")
    assert time.monotonic() - started >= 0.9  # not before the 1 s grace period

    def restarted() -> bool:
        statuses = node.pod("greedy")["status"]["containerStatuses"]
        main = next(s for s in statuses if s["name"] == "main")
        return bool(main["restartCount"] >= 1)

    wait_until(restarted, timeout_s=30, what="the kubelet restarting greedy/main")
    node.write_gpus(GPUS)
    for pid in (sidecar_pid, copycat_pid, host.pid):
        assert os.path.exists(f"/proc/{pid}"), f"pid {pid} was killed"
    sidecar = next(
        s for s in node.pod("greedy")["status"]["containerStatuses"] if s["name"] == "sidecar"
    )
    assert sidecar["restartCount"] == 0
    kills = [e for e in vgpu.status()["enforcement"] if e["kind"] == "memory"]
    assert [(e["pod"], e["container"], e["action"]) for e in kills] == [("greedy", "main", "kill")]
    log = vgpu.log()
    assert "action=kill" in log
    assert f"pid={main_pid}" in log


def test_busy_pair_on_one_gpu_the_smaller_share_is_throttled(vgpu: Daemon) -> None:
    node = vgpu.cluster
    if node.runtime != "containerd":
        pytest.skip(f"needs real containers: {containerd_missing(node.bundle)}")
    node.create_pod(pod_manifest("small", {RESOURCE: 1}))
    node.wait_running("small")
    node.create_pod(pod_manifest("large", {RESOURCE: 3}))
    node.wait_running("large")
    small = node.checkpoint_devices("small", "main")
    large = node.checkpoint_devices("large", "main")
    gpus = {d.split("::", 1)[0] for d in small + large}
    assert len(gpus) == 1, f"pack put them on {gpus}"
    small_pid = node.container_init_pid("small", "main")
    large_pid = node.container_init_pid("large", "main")
    node.write_gpus(
        _fake_state(
            {
                gpus.pop(): [
                    FakeProcess(pid=small_pid, used_memory_bytes=GiB, sm_demand_percent=100),
                    FakeProcess(pid=large_pid, used_memory_bytes=GiB, sm_demand_percent=100),
                ]
            }
        )
    )
    try:

        def throttled() -> dict[str, bool] | None:
            flags = {c["pod"]: bool(c["throttled"]) for c in vgpu.status()["containers"]}
            return flags if flags.get("small") else None

        flags = wait_until(throttled, timeout_s=20, what="small throttled")
        assert flags.get("large") is False
        assert ("small", "throttle") in {
            (e["pod"], e["action"]) for e in vgpu.status()["enforcement"]
        }
    finally:
        node.write_gpus(GPUS)
    # Released once the demand is gone; the container was never killed.
    wait_until(
        lambda: not any(c["throttled"] for c in vgpu.status()["containers"]),
        timeout_s=20,
        what="throttle released",
    )
    statuses = node.pod("small")["status"]["containerStatuses"]
    assert statuses[0]["restartCount"] == 0
    with open(f"/proc/{small_pid}/stat") as stat:
        assert stat.read().rsplit(")", 1)[1].split()[0] != "T"  # not left stopped


def test_container_with_a_full_gpu_slice_and_a_mig_slice_sees_both_devices(node: Cluster) -> None:
    """What the NVIDIA container toolkit would expose: NVIDIA_VISIBLE_DEVICES, or the
    volume-mounts list under /var/run/nvidia-container-devices, read in the real container."""
    if node.runtime != "containerd":
        pytest.skip(f"needs real containers: {containerd_missing(node.bundle)}")
    mig = FakeMigDevice(
        uuid="MIG-00000000-0000-4000-8000-000000000001",
        gpu_instance_id=1,
        compute_instance_id=0,
        profile="3g.40gb",
        memory_total_bytes=40 * GiB,
    )
    a100 = dataclasses.replace(A100, mig_enabled=True, mig_block=True, mig_devices=(mig,))
    node.start_daemon(
        config="slicing: {replicas: 4}\nmig: {strategy: mixed}\n", gpus=FakeState(gpus=(a100, L4))
    )
    node.wait_allocatable("nvidia.com/mig-3g.40gb", 1)
    node.wait_allocatable(RESOURCE, 4)
    node.create_pod(pod_manifest("both", {RESOURCE: 1, "nvidia.com/mig-3g.40gb": 1}))
    node.wait_running("both")
    pid = node.container_init_pid("both", "main")
    env = node.container_env("both", "main")
    listed = set(env.get("NVIDIA_VISIBLE_DEVICES", "").split(","))
    mounts = Path(f"/proc/{pid}/root/var/run/nvidia-container-devices")
    if mounts.is_dir():
        listed |= {p.name for p in mounts.iterdir()}
    assert {L4.uuid, mig.uuid} <= listed, (env.get("NVIDIA_VISIBLE_DEVICES"), listed)
