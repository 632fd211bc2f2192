"""Resources on a real kubelet v1.36.2 with Kubernetes' fake CRI (quick: no process starts;
the runtime logs each container's env and CDI devices as the kubelet sent them): MIG mixed
with several resources, a container holding a full-GPU slice and a MIG slice, GPU health, and
live reloads while pods hold slices."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time

from deviceplugin.gpu.fake import FakeMigDevice, FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import RESOURCE, Cluster, Daemon, pod_manifest, wait_until

RUNTIME = "fakecri"
GiB = 1024**3
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
FAST = "enforcement: {pollInterval: 100ms, idlePollInterval: 100ms}\n"
MIXED = "slicing: {replicas: 4}\nmig: {strategy: mixed}\n" + FAST


def mig_device(gi: int, profile: str, memory_gib: int) -> FakeMigDevice:
    return FakeMigDevice(
        uuid=f"MIG-00000000-0000-4000-8000-{gi:012d}",
        gpu_instance_id=gi,
        compute_instance_id=0,
        profile=profile,
        memory_total_bytes=memory_gib * GiB,
    )


L4 = gpu(0, name="NVIDIA L4", memory_gib=24)  # 6 GiB a slice at 4 replicas
A100_MIG = dataclasses.replace(
    gpu(1),
    mig_enabled=True,
    mig_block=True,
    mig_devices=(
        mig_device(1, "3g.40gb", 40),
        mig_device(2, "1g.10gb", 10),
        mig_device(3, "1g.10gb", 10),
    ),
)
MIG_NODE = FakeState(gpus=(L4, A100_MIG))


def allocation_id(device_ids: list[str]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def key(uuid: str) -> str:
    """A device's UUID as an env key suffix: upper-case, [^A-Z0-9] made `_`."""
    return re.sub(r"[^A-Z0-9]", "_", uuid.upper())


def allocated(daemon: Daemon) -> int:
    return sum(g["slices"]["allocated"] for g in daemon.status()["gpus"])


def run_pod(node: Cluster, name: str, limits: dict[str, int]) -> None:
    node.create_pod(pod_manifest(name, limits))
    node.wait_running(name)


def test_mig_mixed_registers_one_resource_per_profile(node: Cluster) -> None:
    node.start_daemon(config=MIXED, gpus=MIG_NODE)
    node.wait_allocatable(RESOURCE, 4, capacity=4)
    node.wait_allocatable(MIG_3G, 1, capacity=1)
    node.wait_allocatable(MIG_1G, 2, capacity=2)


def test_full_gpu_slice_and_mig_slice_in_one_container_get_every_limit(node: Cluster) -> None:
    node.start_daemon(config=MIXED, gpus=MIG_NODE)
    node.wait_allocatable(MIG_3G, 1)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "both", {RESOURCE: 1, MIG_3G: 1})
    full = node.checkpoint_devices("both", "main", RESOURCE)
    mig = node.checkpoint_devices("both", "main", MIG_3G)
    assert (len(full), len(mig)) == (1, 1)
    env = node.container_env("both", "main")  # as the kubelet merged the two answers
    for devices, mib in ((full, 6 * 1024), (mig, 40 * 1024)):
        device = key(devices[0].split("::", 1)[0])
        assert env.get(f"VGPU_ALLOCATION_ID_{device}") == allocation_id(devices), env
        assert env.get(f"VGPU_MEMORY_LIMIT_MIB_{device}") == str(mib), env


def test_cdi_cri_names_every_device_of_a_container_holding_two_resources(
    node: Cluster,
) -> None:
    config = MIXED + "allocation: {deviceListStrategy: [cdi-cri]}\n"
    node.start_daemon(config=config, gpus=MIG_NODE)
    node.wait_allocatable(MIG_3G, 1)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "cdi", {RESOURCE: 1, MIG_3G: 1})
    requests = [
        r
        for r in node.create_container_requests()
        if r.pod == "default/cdi" and r.container == "main"
    ]
    assert requests, node.fakecri_log()[-2000:]
    assert set(requests[-1].cdi_devices) == {
        f"nvidia.com/gpu={L4.uuid}",
        f"nvidia.com/gpu={A100_MIG.mig_devices[0].uuid}",
    }


def test_device_ids_by_index_reach_the_runtime_for_a_gpu_and_a_mig_device(
    node: Cluster,
) -> None:
    # NVIDIA's names: the L4 is GPU 0, the 3g.40gb the first MIG device (slot 0) of GPU 1.
    config = MIXED + "allocation: {deviceListStrategy: [envvar, cdi-cri]}\n"
    node.start_daemon(config=config, gpus=MIG_NODE, env={"VGPU_DEVICE_ID_STRATEGY": "index"})
    node.wait_allocatable(MIG_3G, 1)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "byindex", {RESOURCE: 1, MIG_3G: 1})
    requests = [
        r
        for r in node.create_container_requests()
        if r.pod == "default/byindex" and r.container == "main"
    ]
    assert requests, node.fakecri_log()[-2000:]
    assert set(requests[-1].cdi_devices) == {"nvidia.com/gpu=0", "nvidia.com/gpu=1:0"}
    env = node.container_env("byindex", "main")  # one of the two answers' lists
    assert env.get("NVIDIA_VISIBLE_DEVICES") in ("0", "1:0"), env
    # The daemon's own keys keep the UUIDs.
    assert f"VGPU_ALLOCATION_ID_{key(L4.uuid)}" in env, env


def test_gpu_turned_unhealthy_leaves_allocatable(node: Cluster) -> None:
    two = FakeState(gpus=(gpu(0), gpu(1)))
    node.start_daemon(config="slicing: {replicas: 4}\n" + FAST, gpus=two)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    node.write_gpus(FakeState(gpus=(gpu(0), dataclasses.replace(gpu(1), healthy=False))))
    node.wait_allocatable(RESOURCE, 4, capacity=8)
    run_pod(node, "on-healthy", {RESOURCE: 4})
    assert all(d.startswith(gpu(0).uuid) for d in node.checkpoint_devices("on-healthy", "main"))
    node.create_pod(pod_manifest("no-room", {RESOURCE: 1}))
    node.assert_stays_pending("no-room", seconds=2)
    node.write_gpus(two)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    node.wait_running("no-room")


def test_reload_more_replicas_while_a_pod_holds_slices(node: Cluster) -> None:
    one = FakeState(gpus=(gpu(0),))
    daemon = node.start_daemon(config="slicing: {replicas: 4}\n" + FAST, gpus=one)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "holder", {RESOURCE: 2})
    held = node.checkpoint_devices("holder", "main")
    daemon.write_config("slicing: {replicas: 8}\n" + FAST)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    run_pod(node, "newcomer", {RESOURCE: 6})
    assert not set(held) & set(node.checkpoint_devices("newcomer", "main"))
    wait_until(lambda: allocated(daemon) == 8, timeout_s=20, what="8 allocated")
    node.create_pod(pod_manifest("no-room", {RESOURCE: 1}))
    node.assert_stays_pending("no-room", seconds=2)


def test_rename_while_a_pod_holds_slices_never_offers_them_again(node: Cluster) -> None:
    renamed = "example.com/vgpu-renamed"
    one = FakeState(gpus=(gpu(0),))
    daemon = node.start_daemon(config="slicing: {replicas: 4}\n" + FAST, gpus=one)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "holder", {RESOURCE: 3})
    daemon.write_config(f"resourceName: {renamed}\nslicing: {{replicas: 4}}\n" + FAST)
    wait_until(lambda: node.allocatable(renamed) is not None, timeout_s=20, what="new name")
    time.sleep(2)  # several node status updates
    assert node.allocatable(renamed) == 1  # the three held slices are not offered
    node.create_pod(pod_manifest("second", {renamed: 2}))
    node.assert_stays_pending("second", seconds=2)
    node.delete_pod("holder")
    node.wait_allocatable(renamed, 4)
    node.wait_running("second")


def test_mig_strategy_reload_while_a_pod_holds_slices(node: Cluster) -> None:
    daemon = node.start_daemon(config="slicing: {replicas: 4}\n" + FAST, gpus=MIG_NODE)
    node.wait_allocatable(RESOURCE, 4)
    assert not node.allocatable(MIG_3G)  # none, or left at 0 by an earlier plugin
    run_pod(node, "holder", {RESOURCE: 2})
    held = node.checkpoint_devices("holder", "main")
    daemon.write_config(MIXED)
    node.wait_allocatable(MIG_3G, 1)
    node.wait_allocatable(MIG_1G, 2)
    node.wait_allocatable(RESOURCE, 4)
    run_pod(node, "on-mig", {MIG_1G: 2})
    wait_until(
        lambda: {a["pod"] for a in daemon.status()["allocations"]} == {"holder", "on-mig"},
        timeout_s=20,
        what="both pods' allocations",
    )
    assert node.checkpoint_devices("holder", "main") == held
    assert node.pod("holder")["status"]["phase"] == "Running"
