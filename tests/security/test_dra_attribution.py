"""DRA mode's attribution evidence on a node whose container names are known (the kubelet's
container log links, as on every real node): a claim's processes stand only from the
containers the kubelet's pod-resources DRA entries list with the claim, in the pods the claim
is reserved for. The claim's own container is held to what it consumed; a sidecar of the same
pod that copies the claim's allocation ID is refused, and gets nothing killed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from deviceplugin.dra.claims import ClaimDevice, PreparedClaim, claim_owners, claim_record
from deviceplugin.model import Inventory, NodeSnapshot, ProcessSample
from deviceplugin.usage.containerlogs import ContainerLogIndex
from deviceplugin.usage.procs import AllocationResolver
from tests.blackbox.daemon_harness import GiB
from tests.security.cgroup_support import cid
from tests.security.test_attribution_attacks import POD_UID, FakeProc, cgroupfs, kills, v2
from tests.security.test_tags_per_container import link, snapshot_with
from tests.unit.test_attribution import INVENTORY, UUID0

CLAIM = PreparedClaim(
    uid="11111111-2222-4333-8444-555555555555",
    namespace="ml",
    name="gpu-15",
    devices=(ClaimDevice("gpu", "gpu-0", UUID0, 0, 0, 80 * GiB, 15 * GiB, 30.0, "share-1"),),
    pods=(("victim", POD_UID),),
)


def snapshot_of(
    resolver: AllocationResolver,
    users: Mapping[str, Sequence[tuple[str, str]]],
    processes: list[ProcessSample],
) -> NodeSnapshot:
    # The DRA driver's evidence: its prepared claims and pod-resources' names.
    checkpoint = claim_owners([CLAIM], users)
    return snapshot_with(
        resolver,
        processes,
        checkpoint,
        Inventory.of(INVENTORY.plans, ()),
        [claim_record(CLAIM, "main")],
    )


def _node(tmp_path: Path) -> AllocationResolver:
    proc = FakeProc(tmp_path / "proc")
    logs = tmp_path / "logs"
    link(logs, "main", cid("main"))
    link(logs, "sidecar", cid("sidecar"))
    alloc = CLAIM.allocation_id
    proc.add(101, v2(cgroupfs(POD_UID, "main")), alloc)
    proc.add(102, v2(cgroupfs(POD_UID, "sidecar")), alloc)  # a copied allocation ID
    return AllocationResolver(proc.root, container_logs=ContainerLogIndex(logs))


def test_the_claims_container_is_held_to_its_memory_a_copying_sidecar_is_refused(
    tmp_path: Path,
) -> None:
    resolver = _node(tmp_path)
    users = {CLAIM.uid: [("victim", "main")]}  # pod-resources: main uses the claim
    snapshot = snapshot_of(
        resolver, users, [ProcessSample(101, 16 * GiB, 10.0), ProcessSample(102, 5 * GiB, 10.0)]
    )
    (usage,) = snapshot.containers
    assert (usage.pod, usage.container) == ("victim", "main")
    assert [p.pid for p in usage.processes] == [101]
    assert usage.memory_limit_bytes == 15 * GiB
    assert [p.pid for p in snapshot.gpus[0].misattributed] == [102]
    # 16Gi against a claim of 15Gi: the claim's own process is killed, the sidecar never.
    assert [k.pid for k in kills(snapshot)] == [101]


def test_before_pod_resources_names_the_claims_containers_nothing_is_killed(
    tmp_path: Path,
) -> None:
    """Fail closed: with the kubelet's container names known but no pod-resources entry for
    the claim yet, no container is the claim's: both claims are refused, nothing killed."""
    resolver = _node(tmp_path)
    snapshot = snapshot_of(
        resolver, {}, [ProcessSample(101, 16 * GiB, 10.0), ProcessSample(102, 5 * GiB, 10.0)]
    )
    assert sorted(p.pid for p in snapshot.gpus[0].misattributed) == [101, 102]
    assert kills(snapshot) == []
