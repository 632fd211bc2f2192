"""Allocation tags are checked per container: a sidecar that copies the GPU container's
allocation ID never gets the GPU container's process killed, and a container the kubelet does
not know cannot name an allocation at all. The kubelet's container names come from its
container log links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deviceplugin.kubelet.checkpoint import DeviceCheckpoint, parse_checkpoint
from deviceplugin.model import (
    AllocationRecord,
    DaemonHealth,
    Inventory,
    NodeSnapshot,
    ProcessSample,
)
from deviceplugin.usage.attribution import AttributionEvidence, SnapshotBuilder
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree
from deviceplugin.usage.containerlogs import ContainerLogIndex, parse_links
from deviceplugin.usage.procs import AllocationResolver
from tests.blackbox.daemon_harness import GiB
from tests.security.cgroup_support import cid, subtree
from tests.security.test_attribution_attacks import (
    POD_UID,
    RESOURCE,
    VICTIM,
    FakeProc,
    cgroupfs,
    checkpoint_blob,
    kills,
    v2,
)
from tests.unit.test_attribution import INVENTORY, reading


def link(logs: Path, container: str, container_id: str) -> None:
    """The kubelet's log link for a container of the victim's pod (namespace ml, pod victim)."""
    logs.mkdir(exist_ok=True)
    target = f"/var/log/pods/ml_victim_{POD_UID}/{container}/0.log"
    os.symlink(target, logs / f"victim_ml_{container}-{container_id}.log")


def snapshot_of(resolver: AllocationResolver, processes: list[ProcessSample]) -> NodeSnapshot:
    checkpoint = parse_checkpoint(checkpoint_blob((POD_UID, "main", VICTIM.slice_ids)), RESOURCE)
    return snapshot_with(resolver, processes, checkpoint, INVENTORY, [VICTIM])


def snapshot_with(
    resolver: AllocationResolver,
    processes: list[ProcessSample],
    checkpoint: DeviceCheckpoint,
    inventory: Inventory,
    allocations: list[AllocationRecord],
) -> NodeSnapshot:
    """One poll of GPU 0 running `processes`, attributed with `checkpoint` as the evidence."""
    tags = resolver.resolve({p.pid for p in processes})
    evidence = AttributionEvidence(
        checkpoint,
        resolver.pod_uid_of,
        cgroup_of=resolver.cgroup_of,
        container_of=resolver.container_of,
        containers_known=resolver.containers_known,
        version=resolver.generation,
    )
    snapshot, _ = SnapshotBuilder("n", 5.0).build(
        reading(gpu0=processes),
        inventory,
        allocations,
        tags,
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=DaemonHealth(),
        previous_reading_s=9.0,
        evidence=evidence,
    )
    return snapshot


def test_a_sidecar_copying_the_gpu_containers_id_gets_it_nothing_killed(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    logs = tmp_path / "logs"
    link(logs, "main", cid("main"))
    link(logs, "sidecar", cid("sidecar"))
    proc.add(101, v2(cgroupfs(POD_UID, "main")), VICTIM.allocation_id)  # 19 of its 20 GiB
    proc.add(102, v2(cgroupfs(POD_UID, "sidecar")), VICTIM.allocation_id)  # a copied ID: 5 GiB
    proc.add(103, v2(cgroupfs(POD_UID, "unknown")), VICTIM.allocation_id)  # no kubelet link
    resolver = AllocationResolver(proc.root, container_logs=ContainerLogIndex(logs))
    snapshot = snapshot_of(
        resolver,
        [
            ProcessSample(101, 19 * GiB, 10.0),
            ProcessSample(102, 5 * GiB, 10.0),
            ProcessSample(103, 5 * GiB, 10.0),
        ],
    )
    (usage,) = snapshot.containers
    assert [p.pid for p in usage.processes] == [101]
    assert [p.pid for p in snapshot.gpus[0].misattributed] == [102, 103]
    assert dict(snapshot.gpus[0].unattributed_pods) == {102: POD_UID, 103: POD_UID}
    assert kills(snapshot) == []


def test_the_gpu_container_itself_is_still_held_to_its_limit(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    logs = tmp_path / "logs"
    link(logs, "main", cid("main"))
    proc.add(101, v2(cgroupfs(POD_UID, "main")), VICTIM.allocation_id)
    proc.add(104, v2(cgroupfs(POD_UID, "main")))  # no tag, its container's: charged
    resolver = AllocationResolver(proc.root, container_logs=ContainerLogIndex(logs))
    snapshot = snapshot_of(
        resolver, [ProcessSample(101, 19 * GiB, 10.0), ProcessSample(104, 5 * GiB, 10.0)]
    )
    (usage,) = snapshot.containers
    assert usage.memory_used_bytes == 24 * GiB
    assert [k.pid for k in kills(snapshot)] == [101]


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup-v2", "cgroup-v1"])
def test_real_cgroups_a_sidecar_with_a_copied_id_kills_nothing(
    tmp_path: Path, version: int
) -> None:
    logs = tmp_path / "logs"
    link(logs, "main", cid("main"))
    link(logs, "sidecar", cid("sidecar"))
    env = {"VGPU_ALLOCATION_ID": VICTIM.allocation_id}
    with subtree(version) as tree:
        pod = f"{tree.name}/kubepods/besteffort/pod{POD_UID}"
        main = tree.spawn(f"{pod}/{cid('main')}", env)
        sidecar = tree.spawn(f"{pod}/{cid('sidecar')}", env)
        resolver = AllocationResolver(
            Path("/proc"),
            tree=KubeletTree(CgroupLayout("cgroupfs", tree.name)),
            container_logs=ContainerLogIndex(logs),
        )
        snapshot = snapshot_of(
            resolver, [ProcessSample(main, 19 * GiB, 10.0), ProcessSample(sidecar, 5 * GiB, 10.0)]
        )
        (usage,) = snapshot.containers
        assert [p.pid for p in usage.processes] == [main]
        assert [p.pid for p in snapshot.gpus[0].misattributed] == [sidecar]
        assert kills(snapshot) == []


def test_the_kubelets_own_container_log_links_name_their_containers() -> None:
    """Links exactly as a v1.36 kubelet with containerd made them in /var/log/containers."""
    links = {
        "large_default_main-dabb738cd5602eb15c7e6fa3632ec94b6ad98ebcf47bc155eb2f76820ce5365e.log": (
            "/var/log/pods/default_large_80196a4c-5190-4580-8165-f45fca71d176/main/0.log"
        ),
        "small_default_main-346975af325e0b40aca539eac5cf6b0ca5311b58db845186618ebe6d845e8617.log": (
            "/var/log/pods/default_small_6351d021-9d83-4fef-84c8-2fb16570f56c/main/0.log"
        ),
    }
    assert parse_links(links) == {
        "dabb738cd5602eb15c7e6fa3632ec94b6ad98ebcf47bc155eb2f76820ce5365e": (
            "80196a4c-5190-4580-8165-f45fca71d176",
            "main",
        ),
        "346975af325e0b40aca539eac5cf6b0ca5311b58db845186618ebe6d845e8617": (
            "6351d021-9d83-4fef-84c8-2fb16570f56c",
            "main",
        ),
    }
