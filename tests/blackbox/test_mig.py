"""GPUs in MIG mode, end to end through the kubelet simulator: the strategies, several resources
per node, Allocate for MIG slices, a memory kill on a MIG slice, a layout change at run time and
a kubelet restart with two resources."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from deviceplugin.config import (
    Config,
    EnforcementConfig,
    GpuMatch,
    MemoryEnforcement,
    MigConfig,
    MigStrategy,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.gpu.fake import FakeGpu, FakeMigDevice, FakeProcess
from deviceplugin.kubelet.proto import HEALTHY, UNHEALTHY
from deviceplugin.sim.kubelet import AdmissionError
from tests.blackbox.daemon_harness import (
    FAST,
    RESOURCE,
    GiB,
    Node,
    Workloads,
    eventually,
    gpu,
    plugins,
    registered,
    running_daemon,
)
from tests.blackbox.test_cli import run_cli
from tests.blackbox.test_enforcement_daemon import Serve

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"


def mig_device(gi: int, profile: str, memory_gib: int, *processes: FakeProcess) -> FakeMigDevice:
    return FakeMigDevice(
        uuid=f"MIG-00000000-0000-4000-8000-{gi:012d}",
        gpu_instance_id=gi,
        compute_instance_id=0,
        profile=profile,
        memory_total_bytes=memory_gib * GiB,
        processes=tuple(processes),
    )


def mig_gpu(index: int, *devices: FakeMigDevice) -> FakeGpu:
    return dataclasses.replace(
        gpu(index, name="NVIDIA A100-SXM4-80GB"),
        mig_enabled=True,
        mig_block=True,
        mig_devices=tuple(devices),
    )


# One full GPU, and an A100 partitioned into one 3g.40gb and two 1g.10gb devices.
LAYOUT = (
    mig_device(1, "3g.40gb", 40),
    mig_device(2, "1g.10gb", 10),
    mig_device(3, "1g.10gb", 10),
)


def mixed(**overrides: object) -> Config:
    config = Config(enforcement=FAST, mig=MigConfig(strategy=MigStrategy.MIXED))
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def mig_node(node: Node) -> Node:
    node.write_gpus([gpu(0, name="NVIDIA L4", memory_gib=24), mig_gpu(1, *LAYOUT)])
    return node


async def test_mixed_registers_one_resource_per_profile(mig_node: Node) -> None:
    async with running_daemon(mig_node, mixed()):
        await registered(mig_node, 4)  # the full GPU, 4 slices
        await registered(mig_node, 1, MIG_3G)
        await registered(mig_node, 2, MIG_1G)
        sim = mig_node.sim
        assert set(sim.devices(MIG_1G)) == {f"{d.uuid}::0" for d in LAYOUT[1:]}
        assert set(sim.devices(MIG_3G)) == {f"{LAYOUT[0].uuid}::0"}
        # The full GPUs' resource never lists a MIG device, nor the MIG GPU itself.
        assert all(d.startswith("GPU-00000000-0000-4000-8000-000000000000::") for d in
                   sim.devices(RESOURCE))  # fmt: skip
        # Each resource has its own owner-only socket.
        for resource in (RESOURCE, MIG_1G, MIG_3G):
            assert mig_node.plugin_socket(resource).stat().st_mode & 0o777 == 0o600


async def test_allocate_on_a_mig_slice_gives_its_uuid_and_its_share_of_memory(
    mig_node: Node,
) -> None:
    config = mixed(
        slicing=SlicingConfig(
            overrides=(SliceOverride(GpuMatch(profile="1g.10gb"), SliceRule(replicas=2)),)
        )
    )
    async with running_daemon(mig_node, config):
        await registered(mig_node, 4, MIG_1G)
        pod = await mig_node.sim.admit_pod("p", [("c", 1)], resource_name=MIG_1G)
        (grant,) = pod.containers
        (device_id,) = grant.device_ids
        uuid = device_id.split("::")[0]
        assert uuid in {d.uuid for d in LAYOUT[1:]}
        assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert grant.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(10 * 1024 // 2)
        assert grant.envs["VGPU_COMPUTE_SHARE_PERCENT_0"] == "50"


async def test_a_container_may_hold_a_full_gpu_slice_and_a_mig_slice(mig_node: Node) -> None:
    async with running_daemon(mig_node, mixed(), pod_resources_interval_s=0.2) as daemon:
        await registered(mig_node, 1, MIG_3G)
        await registered(mig_node, 4)
        pod = await mig_node.sim.admit_pod("p", [("c", {RESOURCE: 1, MIG_3G: 1})])
        by_resource = {g.resource_name: g for g in pod.containers}
        assert by_resource[MIG_3G].envs["NVIDIA_VISIBLE_DEVICES"] == LAYOUT[0].uuid
        assert by_resource[RESOURCE].envs["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        # The daemon learns both allocations from pod-resources, with the pod's name.
        await eventually(
            lambda: sorted((r.pod, r.container) for r in daemon.book) == [("p", "c")] * 2,
            10,
            "both allocations named",
        )


async def test_single_advertises_mig_devices_under_the_one_resource(node: Node) -> None:
    layout = (mig_device(1, "1g.10gb", 10), mig_device(2, "1g.10gb", 10))
    node.write_gpus([gpu(0, name="NVIDIA L4", memory_gib=24), mig_gpu(1, *layout)])
    config = Config(enforcement=FAST, mig=MigConfig(strategy=MigStrategy.SINGLE))
    async with running_daemon(node, config):
        await registered(node, 6)
        devices = set(node.sim.devices(RESOURCE))
        assert {f"{d.uuid}::0" for d in layout} <= devices
        assert not node.plugin_socket(MIG_1G).exists()


async def test_single_with_two_profiles_leaves_the_mig_gpus_out(
    mig_node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="deviceplugin.poller")
    config = Config(enforcement=FAST, mig=MigConfig(strategy=MigStrategy.SINGLE))
    async with running_daemon(mig_node, config) as daemon:
        await registered(mig_node, 4)
        excluded = [p for p in daemon.inventory.value.plans if p.gpu.is_mig_device]
        assert excluded
        assert all("1g.10gb, 3g.40gb" in p.excluded_reason for p in excluded)
    assert "found 1g.10gb, 3g.40gb" in caplog.text


async def test_none_leaves_the_mig_gpu_out(mig_node: Node) -> None:
    async with running_daemon(mig_node, Config(enforcement=FAST)):
        await registered(mig_node, 4)
        assert not mig_node.plugin_socket(MIG_1G).exists()
        assert not mig_node.sim.is_registered(MIG_1G)


async def test_a_kubelet_restart_re_registers_every_resource(mig_node: Node) -> None:
    async with running_daemon(mig_node, mixed()):
        await registered(mig_node, 4)
        await registered(mig_node, 2, MIG_1G)
        await registered(mig_node, 1, MIG_3G)
        pod = await mig_node.sim.admit_pod("p", [("c", {RESOURCE: 1, MIG_1G: 1})])
        before = len(mig_node.sim.registrations)
        await mig_node.sim.restart()
        await registered(mig_node, 4)
        await registered(mig_node, 2, MIG_1G)
        await registered(mig_node, 1, MIG_3G)
        again = {e.resource_name for e in mig_node.sim.registrations[before:] if e.accepted}
        assert again == {RESOURCE, MIG_1G, MIG_3G}
        # The kubelet's checkpoint kept the pod's grants of both resources.
        assert mig_node.sim.get_pod("default", "p") == pod
        (mig_grant,) = [g for g in pod.containers if g.resource_name == MIG_1G]
        assert mig_node.sim.allocated_ids(MIG_1G) == set(mig_grant.device_ids)


async def test_a_layout_change_follows_and_held_slices_turn_unhealthy_then_go(
    mig_node: Node,
) -> None:
    sim = mig_node.sim
    async with running_daemon(mig_node, mixed(), pod_resources_interval_s=0.2) as daemon:
        await registered(mig_node, 1, MIG_3G)
        await sim.admit_pod("p", [("c", 1)], resource_name=MIG_3G)
        # The daemon has learnt from pod-resources that the kubelet holds it.
        await eventually(lambda: [r.pod for r in daemon.book] == ["p"], 10, "allocation named")
        # mig-parted re-partitions the GPU: the 3g.40gb device goes, a 2g.20gb one comes.
        new_layout = (mig_device(4, "2g.20gb", 20), *LAYOUT[1:])
        mig_node.write_gpus([mig_node.gpus[0], mig_gpu(1, *new_layout)])
        await registered(mig_node, 1, "nvidia.com/mig-2g.20gb")
        held = f"{LAYOUT[0].uuid}::0"
        await sim.wait_for(lambda: sim.unhealthy_ids(MIG_3G) == {held}, timeout_s=10)
        assert sim.devices(MIG_3G)[held].health == UNHEALTHY
        assert mig_node.plugin_socket(MIG_3G).exists()
        # A new pod cannot get it.
        with pytest.raises(AdmissionError):
            await sim.admit_pod("q", [("c", 1)], resource_name=MIG_3G)
        # Once the kubelet frees it, the resource goes.
        await sim.delete_pod("default", "p")
        await eventually(
            lambda: not mig_node.plugin_socket(MIG_3G).exists(), 15, "the 3g.40gb endpoint gone"
        )
        assert sim.devices("nvidia.com/mig-2g.20gb")[f"{new_layout[0].uuid}::0"].health == HEALTHY


async def test_a_mig_slice_over_its_memory_limit_is_killed(
    mig_node: Node, workloads: Workloads
) -> None:
    config = mixed(
        enforcement=EnforcementConfig(
            poll_interval_s=0.05, memory=MemoryEnforcement(grace_period_s=0.2)
        )
    )
    sim = mig_node.sim
    async with running_daemon(mig_node, config, pod_resources_interval_s=0.2) as daemon:
        await registered(mig_node, 1, MIG_3G)
        pod = await sim.admit_pod("p", [("c", 1)], resource_name=MIG_3G)
        envs = pod.containers[0].envs
        hog = workloads.spawn({"VGPU_ALLOCATION_ID": envs["VGPU_ALLOCATION_ID"]})
        bystander = workloads.spawn()
        over = FakeProcess(hog, 41 * GiB)  # the slice holds 40 GiB
        layout = (
            mig_device(1, "3g.40gb", 40, over),
            mig_device(2, "1g.10gb", 10, FakeProcess(bystander, 9 * GiB)),
            LAYOUT[2],
        )
        mig_node.write_gpus([mig_node.gpus[0], mig_gpu(1, *layout)])
        await eventually(lambda: not _alive(hog), 10, "the over-limit process killed")
        assert _alive(bystander)

        def kills() -> list[tuple[str, int]]:
            snapshot = daemon.poller.snapshot
            assert snapshot is not None
            return [
                (e.gpu_uuid, e.count)
                for e in snapshot.enforcement
                if e.kind == "memory" and e.action == "kill"
            ]

        # The process dies during the poll that kills it; the snapshot that counts the kill is
        # published when that poll ends.
        await eventually(lambda: kills() == [(LAYOUT[0].uuid, 1)], 10, "the kill counted")
        assert _alive(bystander)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


# --- NVIDIA's config file with MIG resources: check-config and serve ---------------------------

NVIDIA_MIXED = """\
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 2
      - name: nvidia.com/mig-1g.10gb
        replicas: 3
"""


def test_check_config_plans_mig_resources_of_an_nvidia_file(mig_node: Node) -> None:
    config = mig_node.root / "nvidia.yaml"
    config.write_text(NVIDIA_MIXED)
    result = run_cli("check-config", str(config), "--backend", f"fake:{mig_node.state_file}")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "MIG strategy mixed" in out
    assert "total: 2 slices of nvidia.com/gpu on 1 of 2 GPUs" in out
    assert "total: 6 slices of nvidia.com/mig-1g.10gb on 2 MIG devices" in out
    assert "total: 1 slices of nvidia.com/mig-3g.40gb on 1 MIG devices" in out
    small = [line for line in out.splitlines() if "MIG 1g.10gb" in line]
    assert len(small) == 2
    assert all(line.split()[-4:] == ["3", "3.3Gi", "not", "enforced"] for line in small)
    assert "MIG slices: memory limits are enforced; compute is not measurable per MIG" in out


async def test_serve_with_an_nvidia_file_registers_each_mig_profile(mig_node: Node) -> None:
    serve = Serve(mig_node, NVIDIA_MIXED)
    try:
        await serve.start()
        await registered(mig_node, 2, "nvidia.com/gpu")
        await registered(mig_node, 6, MIG_1G)
        await registered(mig_node, 1, MIG_3G)
        pod = await mig_node.sim.admit_pod("p", [("c", 2)], resource_name=MIG_1G)
        # Two slices of one 1g.10gb device (the preferred allocation packs them).
        (grant,) = pod.containers
        assert len({d.split("::")[0] for d in grant.device_ids}) == 1
        assert grant.envs["VGPU_MEMORY_LIMIT_MIB_0"] == str(2 * (10 * 1024 // 3))
        code, err = await serve.stop()
        assert code == 0, err
    finally:
        await serve.kill_if_running()


def test_demo_shows_a_gpu_in_mig_mode_in_the_slice_map() -> None:
    result = run_cli("demo", "--duration", "0.5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "not sliced: MIG mode is enabled; its MIG devices are sliced instead" in out
    assert "  MIG 1g.10gb  GI 9" in out
    assert "nvidia.com/mig-1g.10gb: 2 slices x 5Gi memory, compute not enforced" in out
    assert "plugin registered and 4 nvidia.com/mig-1g.10gb slices" in out
    assert "embeddings/encoder" in out
    assert "all 3 resources re-registered" in out


async def test_one_resource_s_broken_stream_leaves_the_others_alone(mig_node: Node) -> None:
    sim = mig_node.sim
    async with running_daemon(mig_node, mixed()) as daemon:
        await registered(mig_node, 4)
        await registered(mig_node, 2, MIG_1G)
        await registered(mig_node, 1, MIG_3G)
        before = len(sim.registrations)

        await sim.break_stream(MIG_1G)
        await registered(mig_node, 2, MIG_1G)

        again = [e.resource_name for e in sim.registrations[before:] if e.accepted]
        assert again == [MIG_1G]
        assert sim.is_registered(RESOURCE)
        assert sim.is_registered(MIG_3G)
        endpoint = plugins(daemon).resources.get(MIG_1G)
        assert endpoint is not None
        assert endpoint.lifecycle.stats.last_restart_reason == "ListAndWatch stream ended"
        assert plugins(daemon).lifecycle.stats.registrations == 1
