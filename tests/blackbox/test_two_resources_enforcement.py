"""A container holding a full-GPU slice and a MIG slice (MIG strategy mixed), end to end through
the kubelet simulator, which merges its two Allocate answers as the kubelet does: its process on
the MIG device is held to the MIG slice's memory limit, whichever resource's
`VGPU_ALLOCATION_ID` the merge kept."""

from __future__ import annotations

from pathlib import Path

from deviceplugin.config import EnforcementConfig, MemoryEnforcement
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.sim.runoptions import RunOptions
from tests.blackbox.daemon_harness import (
    RESOURCE,
    GiB,
    Node,
    Workloads,
    eventually,
    gpu,
    registered,
    running_daemon,
)
from tests.blackbox.test_mig import LAYOUT, MIG_1G, mig_device, mig_gpu, mixed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_process_on_the_mig_slice_of_a_two_resource_container_is_held_to_its_limit(
    short_tmp: Path,
) -> None:
    node = Node(short_tmp, [gpu(0, name="NVIDIA L4", memory_gib=24), mig_gpu(1, *LAYOUT)])
    config = mixed(
        enforcement=EnforcementConfig(
            poll_interval_s=0.05, memory=MemoryEnforcement(grace_period_s=0.2)
        )
    )
    workloads = Workloads()
    await node.sim.start()
    try:
        async with running_daemon(node, config, pod_resources_interval_s=0.2) as daemon:
            await registered(node, 4)
            await registered(node, 2, MIG_1G)
            pod = await node.sim.admit_pod("p", [("c", {RESOURCE: 1, MIG_1G: 1})])
            by_resource = {g.resource_name: g for g in pod.containers}
            full_id = by_resource[RESOURCE].envs["VGPU_ALLOCATION_ID"]
            mig_id = by_resource[MIG_1G].envs["VGPU_ALLOCATION_ID"]
            mig_uuid = by_resource[MIG_1G].device_ids[0].rsplit("::", 1)[0]
            # The merge in which the full-GPU answer's `VGPU_ALLOCATION_ID` won (the kubelet's
            # order is Go's map order): the one where that ID alone charges the MIG device
            # to an allocation that holds nothing there.
            options: RunOptions | None = None
            for _ in range(64):
                merged = node.sim.container_run_options("default", "p", "c")
                if merged.envs["VGPU_ALLOCATION_ID"] == full_id:
                    options = merged
                    break
            assert options is not None, "the merge never kept the full-GPU answer's ID"
            hog = workloads.spawn(options.envs)
            at = next(n for n, d in enumerate(LAYOUT) if d.uuid == mig_uuid)
            devices = list(LAYOUT)
            devices[at] = mig_device(
                devices[at].gpu_instance_id,
                devices[at].profile,
                10,
                FakeProcess(hog, 11 * GiB),  # the 1g.10gb slice holds 10 GiB
            )
            node.write_gpus([node.gpus[0], mig_gpu(1, *devices)])
            await eventually(lambda: not _alive(hog), 10, "the over-limit process killed")

            def kills() -> list[tuple[str, str, int]]:
                snapshot = daemon.poller.snapshot
                assert snapshot is not None
                return [
                    (e.allocation_id, e.gpu_uuid, e.count)
                    for e in snapshot.enforcement
                    if e.kind == "memory" and e.action == "kill"
                ]

            # Counted to the MIG slice's allocation, on the MIG device.
            await eventually(lambda: kills() == [(mig_id, mig_uuid, 1)], 10, "the kill counted")
            snapshot = daemon.poller.snapshot
            assert snapshot is not None
            assert not any(c.allocation_id == full_id and c.gpu_uuid == mig_uuid
                           for c in snapshot.containers)  # fmt: skip
    finally:
        workloads.close()
        await node.sim.stop()
