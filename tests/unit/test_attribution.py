"""Unit tests for deviceplugin.usage.attribution: the snapshot builder, and the evidence the
attribution rules are checked against (shared with tests/unit/test_charges.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.allocation import slice_grants
from deviceplugin.kubelet.checkpoint import DeviceCheckpoint, parse_checkpoint
from deviceplugin.model import (
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    GpuInfo,
    GpuPlan,
    GpuReading,
    Inventory,
    NodeReading,
    NodeSnapshot,
    ProcessSample,
    Slice,
    SliceId,
    allocation_id,
)
from deviceplugin.usage.attribution import (
    AttributionEvidence,
    SnapshotBuilder,
    mark_stale,
)

GI = 1 << 30
REPLICAS = 4
GPU_MEMORY = 80 * GI
SLICE_MEMORY = GPU_MEMORY // REPLICAS
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
HEALTH = DaemonHealth(registered=True, pod_resources_ok=True)

# ---------------------------------------------------------------------------------------------
# SnapshotBuilder


def gpu_info(index: int, uuid: str) -> GpuInfo:
    return GpuInfo(uuid, index, "NVIDIA A100-SXM4-80GB", GPU_MEMORY, minor=index)


def inventory(*gpus: tuple[GpuInfo, bool]) -> Inventory:
    plans: list[GpuPlan] = []
    slices: list[Slice] = []
    for info, healthy in gpus:
        plans.append(GpuPlan(info, REPLICAS, SLICE_MEMORY, 1 / REPLICAS))
        slices.extend(
            Slice(SliceId(info.uuid, n), info.index, None, SLICE_MEMORY, 1 / REPLICAS, healthy)
            for n in range(REPLICAS)
        )
    return Inventory.of(plans, slices)


def record(
    *slice_ids: str,
    namespace: str = "",
    pod: str = "",
    container: str = "",
    granted_by: Inventory | None = None,
) -> AllocationRecord:
    """An allocation of `slice_ids`, granted what they are in `granted_by` (default: the
    inventory of REPLICAS slices per GPU) as Allocate grants it."""
    by_id = (granted_by or inventory((gpu_info(0, UUID0), True), (gpu_info(1, UUID1), True))).by_id
    return AllocationRecord(
        allocation_id(slice_ids),
        tuple(sorted(slice_ids)),
        100.0,
        namespace=namespace,
        pod=pod,
        container=container,
        grants=slice_grants([by_id[s] for s in sorted(slice_ids) if s in by_id]),
    )


def sid(uuid: str, n: int) -> str:
    return str(SliceId(uuid, n))


def reading(
    gpu0: Sequence[ProcessSample] = (),
    gpu1: Sequence[ProcessSample] = (),
    *,
    healthy1: bool = True,
    sm0: float | None = None,
    sm1: float | None = None,
) -> NodeReading:
    return NodeReading(
        timestamp_s=0.0,
        gpus=(
            # Deliberately out of index order: the snapshot orders GPUs by index.
            GpuReading(
                gpu_info(1, UUID1), healthy=healthy1, sm_util_percent=sm1, processes=tuple(gpu1)
            ),
            GpuReading(gpu_info(0, UUID0), sm_util_percent=sm0, processes=tuple(gpu0)),
        ),
    )


INVENTORY = inventory((gpu_info(0, UUID0), True), (gpu_info(1, UUID1), True))
# A: two slices of GPU 0. B: one slice on each GPU. C: one slice of GPU 0, no processes.
A = record(sid(UUID0, 0), sid(UUID0, 1), namespace="ml", pod="train-0", container="worker")
B = record(sid(UUID0, 2), sid(UUID1, 0), namespace="ml", pod="infer-0", container="server")
C = record(sid(UUID0, 3), namespace="dev", pod="idle", container="main")


def build(
    builder: SnapshotBuilder,
    node: NodeReading,
    records: Sequence[AllocationRecord],
    pids: Mapping[int, str | None],
    *,
    inv: Inventory = INVENTORY,
    now_s: float = 10.0,
    previous_s: float | None = 9.0,
) -> tuple[NodeSnapshot, frozenset[str]]:
    return builder.build(
        node,
        inv,
        records,
        pids,
        now_s=now_s,
        wall_s=1_700_000_000.0,
        health=HEALTH,
        previous_reading_s=previous_s,
    )


def usage_of(snapshot: NodeSnapshot, rec: AllocationRecord, uuid: str) -> ContainerUsage:
    matches = [
        c
        for c in snapshot.containers
        if c.allocation_id == rec.allocation_id and c.gpu_uuid == uuid
    ]
    assert len(matches) == 1, matches
    return matches[0]


def test_processes_are_attributed_by_allocation() -> None:
    node = reading(
        gpu0=[
            ProcessSample(101, 3 * GI, 20.0),
            ProcessSample(102, 5 * GI, 30.0),
            ProcessSample(201, 1 * GI, 10.0),
        ]
    )
    pids = {101: A.allocation_id, 102: A.allocation_id, 201: B.allocation_id}
    snapshot, unknown = build(SnapshotBuilder("node-a", 5.0), node, [A, B, C], pids)

    assert unknown == frozenset()
    a0 = usage_of(snapshot, A, UUID0)
    assert [p.pid for p in a0.processes] == [101, 102]
    assert a0.memory_used_bytes == 8 * GI
    assert a0.sm_utilization_ratio == pytest.approx(0.5)
    b0 = usage_of(snapshot, B, UUID0)
    assert [p.pid for p in b0.processes] == [201]
    assert b0.memory_used_bytes == 1 * GI
    assert b0.sm_utilization_ratio == pytest.approx(0.1)
    assert snapshot.gpus[0].unattributed == ()


def test_limits_and_shares_scale_with_slices_per_gpu() -> None:
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [A, B, C], {})
    a0 = usage_of(snapshot, A, UUID0)
    assert (a0.slices, a0.memory_limit_bytes) == (2, 2 * SLICE_MEMORY)
    assert a0.compute_share_ratio == pytest.approx(0.5)
    # B holds one slice on each GPU: one ContainerUsage per GPU, each with one slice's worth.
    for uuid, index in ((UUID0, 0), (UUID1, 1)):
        b = usage_of(snapshot, B, uuid)
        assert (b.gpu_index, b.slices, b.memory_limit_bytes) == (index, 1, SLICE_MEMORY)
        assert b.compute_share_ratio == pytest.approx(0.25)


def test_all_slices_of_a_gpu_give_the_whole_gpu() -> None:
    whole = record(*(sid(UUID1, n) for n in range(REPLICAS)))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [whole], {})
    usage = usage_of(snapshot, whole, UUID1)
    assert usage.slices == REPLICAS
    assert usage.memory_limit_bytes == GPU_MEMORY
    assert usage.compute_share_ratio == pytest.approx(1.0)


def test_container_without_processes_is_present_with_zeros() -> None:
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [C], {}, previous_s=None)
    usage = usage_of(snapshot, C, UUID0)
    assert usage.processes == ()
    assert usage.memory_used_bytes == 0
    assert usage.sm_utilization_ratio == 0.0
    assert usage.memory_limit_bytes == SLICE_MEMORY
    assert len(snapshot.containers) == 1


def test_unknown_allocation_is_unattributed_and_reported() -> None:
    stranger = "0123456789abcdef"
    node = reading(gpu0=[ProcessSample(301, 2 * GI, 40.0), ProcessSample(101, GI, 5.0)])
    snapshot, unknown = build(
        SnapshotBuilder("n", 5.0), node, [A], {301: stranger, 101: A.allocation_id}
    )
    assert unknown == frozenset({stranger})
    assert [p.pid for p in snapshot.gpus[0].unattributed] == [301]
    assert all(301 not in {p.pid for p in c.processes} for c in snapshot.containers)
    assert all(c.allocation_id != stranger for c in snapshot.containers)
    assert usage_of(snapshot, A, UUID0).memory_used_bytes == GI


def test_process_without_allocation_id_is_unattributed() -> None:
    # 401 maps to None (no variable found); 402 is missing from the mapping altogether.
    node = reading(gpu0=[ProcessSample(401, GI, 50.0), ProcessSample(402, GI, 50.0)])
    snapshot, unknown = build(SnapshotBuilder("n", 5.0), node, [A], {401: None})
    assert unknown == frozenset()
    assert [p.pid for p in snapshot.gpus[0].unattributed] == [401, 402]
    assert usage_of(snapshot, A, UUID0).processes == ()


def test_process_on_a_gpu_without_slices_gets_a_zero_limit_usage() -> None:
    node = reading(gpu1=[ProcessSample(103, 4 * GI, 60.0)])
    snapshot, unknown = build(SnapshotBuilder("n", 5.0), node, [A], {103: A.allocation_id})
    assert unknown == frozenset()
    stray = usage_of(snapshot, A, UUID1)
    assert (stray.slices, stray.memory_limit_bytes, stray.compute_share_ratio) == (0, 0, 0.0)
    assert stray.memory_used_bytes == 4 * GI
    assert stray.sm_utilization_ratio == pytest.approx(0.6)
    assert [p.pid for p in stray.processes] == [103]
    assert usage_of(snapshot, A, UUID0).slices == 2
    assert snapshot.gpus[1].unattributed == ()


def test_slice_states_count_allocated_free_and_unhealthy() -> None:
    inv = inventory((gpu_info(0, UUID0), True), (gpu_info(1, UUID1), False))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(healthy1=False), [A, B], {}, inv=inv)
    gpu0, gpu1 = snapshot.gpus
    assert (gpu0.slices_total, gpu0.slices_allocated, gpu0.slices_unhealthy) == (4, 3, 0)
    assert gpu0.slices_free == 1
    # B's slice on the unhealthy GPU counts as unhealthy, not allocated; B keeps its limit there.
    assert (gpu1.slices_total, gpu1.slices_allocated, gpu1.slices_unhealthy) == (4, 0, 4)
    assert gpu1.slices_free == 0
    assert usage_of(snapshot, B, UUID1).memory_limit_bytes == SLICE_MEMORY


def test_a_running_allocation_keeps_its_grant_when_the_plan_reslices_its_gpu() -> None:
    # A was granted two slices of 4 (40Gi, 50%); a reload to 8 slices makes each slice 10Gi.
    infos = (gpu_info(0, UUID0), gpu_info(1, UUID1))
    resliced = Inventory.of(
        [GpuPlan(i, 8, GPU_MEMORY // 8, 1 / 8) for i in infos],
        [
            Slice(SliceId(i.uuid, n), i.index, None, GPU_MEMORY // 8, 1 / 8, True)
            for i in infos
            for n in range(8)
        ],
    )
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [A], {}, inv=resliced)
    a0 = usage_of(snapshot, A, UUID0)
    assert (a0.slices, a0.memory_limit_bytes, a0.compute_share_ratio) == (2, 40 * GI, 0.5)
    # Only its slices' count comes from the inventory.
    assert (snapshot.gpus[0].slices_total, snapshot.gpus[0].slices_allocated) == (8, 2)
    # An allocation made under the new plan gets the new plan.
    new = record(sid(UUID0, 4), granted_by=resliced)
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [A, new], {}, inv=resliced)
    assert usage_of(snapshot, new, UUID0).memory_limit_bytes == 10 * GI


def test_a_slice_held_twice_is_allocated_once() -> None:
    older = record(sid(UUID0, 0))
    newer = AllocationRecord("feedfacefeedface", (sid(UUID0, 0),), 200.0)
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [older, newer], {})
    assert snapshot.gpus[0].slices_allocated == 1
    assert snapshot.gpus[0].slices_free == 3


def test_slices_unknown_to_the_inventory_are_skipped() -> None:
    gone = record(sid("GPU-gone", 0), sid(UUID0, 1))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [gone], {})
    assert [(c.gpu_uuid, c.slices) for c in snapshot.containers] == [(UUID0, 1)]


def test_names_come_from_records_and_anonymous_ones_stay_empty() -> None:
    anonymous = record(sid(UUID0, 3))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [A, anonymous], {})
    a0 = usage_of(snapshot, A, UUID0)
    assert (a0.namespace, a0.pod, a0.container) == ("ml", "train-0", "worker")
    anon = usage_of(snapshot, anonymous, UUID0)
    assert (anon.namespace, anon.pod, anon.container) == ("", "", "")


def test_order_gpus_by_index_and_containers_by_gpu_then_names() -> None:
    z = record(sid(UUID0, 3), namespace="zz", pod="p", container="c")
    anonymous = record(sid(UUID1, 1))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [z, B, anonymous, A], {})
    assert [g.info.index for g in snapshot.gpus] == [0, 1]
    assert [(c.gpu_index, c.namespace, c.pod) for c in snapshot.containers] == [
        (0, "ml", "infer-0"),
        (0, "ml", "train-0"),
        (0, "zz", "p"),
        (1, "", ""),
        (1, "ml", "infer-0"),
    ]


def test_ties_in_names_are_ordered_by_allocation_id() -> None:
    one = record(sid(UUID0, 0))
    two = record(sid(UUID0, 1))
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(), [one, two], {})
    ids = [c.allocation_id for c in snapshot.containers]
    assert ids == sorted([one.allocation_id, two.allocation_id])


def test_missing_memory_and_utilisation_count_as_zero() -> None:
    node = reading(gpu0=[ProcessSample(101, None, None), ProcessSample(102, 2 * GI, 30.0)])
    snapshot, _ = build(
        SnapshotBuilder("n", 5.0), node, [A], {101: A.allocation_id, 102: A.allocation_id}
    )
    a0 = usage_of(snapshot, A, UUID0)
    assert a0.memory_used_bytes == 2 * GI
    assert a0.sm_utilization_ratio == pytest.approx(0.3)
    assert len(a0.processes) == 2


def test_utilisation_is_averaged_over_the_window_across_builds() -> None:
    builder = SnapshotBuilder("n", 5.0)
    pids = {101: A.allocation_id}

    def at(now_s: float, previous_s: float | None, percent: float) -> NodeSnapshot:
        node = reading(gpu0=[ProcessSample(101, GI, percent)], sm0=percent)
        return build(builder, node, [A], pids, now_s=now_s, previous_s=previous_s)[0]

    first = at(10.0, None, 80.0)
    assert usage_of(first, A, UUID0).sm_utilization_ratio == 0.0  # covers no time yet
    assert first.gpus[0].sm_utilization_ratio == 0.0
    second = at(11.0, 10.0, 50.0)
    assert usage_of(second, A, UUID0).sm_utilization_ratio == pytest.approx(0.5)
    third = at(13.0, 11.0, 20.0)  # 1 s at 50 % and 2 s at 20 %
    assert usage_of(third, A, UUID0).sm_utilization_ratio == pytest.approx(0.3)
    assert third.gpus[0].sm_utilization_ratio == pytest.approx(0.3)
    later = at(30.0, 13.0, 0.0)  # one long poll covering the whole window at 0 %
    assert usage_of(later, A, UUID0).sm_utilization_ratio == 0.0


def test_utilisation_ratios_are_clamped_to_one() -> None:
    node = reading(gpu0=[ProcessSample(101, GI, 90.0), ProcessSample(102, GI, 70.0)], sm0=130.0)
    pids = {101: A.allocation_id, 102: A.allocation_id}
    snapshot, _ = build(SnapshotBuilder("n", 5.0), node, [A], pids)
    assert usage_of(snapshot, A, UUID0).sm_utilization_ratio == 1.0
    assert snapshot.gpus[0].sm_utilization_ratio == 1.0


def test_gpu_without_utilisation_reports_none() -> None:
    snapshot, _ = build(SnapshotBuilder("n", 5.0), reading(sm0=40.0, sm1=None), [], {})
    assert snapshot.gpus[0].sm_utilization_ratio == pytest.approx(0.4)
    assert snapshot.gpus[1].sm_utilization_ratio is None


def test_a_departed_allocation_leaves_no_history_behind() -> None:
    builder = SnapshotBuilder("n", 60.0)
    busy = reading(gpu0=[ProcessSample(101, GI, 100.0)])
    build(builder, busy, [A], {101: A.allocation_id}, now_s=10.0, previous_s=9.0)
    build(builder, reading(), [], {}, now_s=11.0, previous_s=10.0)
    snapshot, _ = build(builder, reading(), [A], {}, now_s=12.0, previous_s=11.0)
    assert usage_of(snapshot, A, UUID0).sm_utilization_ratio == 0.0


def test_snapshot_carries_node_time_allocations_and_health() -> None:
    snapshot, _ = build(SnapshotBuilder("node-7", 5.0), reading(), [A, B], {})
    assert snapshot.node_name == "node-7"
    assert snapshot.taken_at_s == 1_700_000_000.0
    assert snapshot.allocations == (A, B)
    assert snapshot.health == HEALTH
    assert snapshot.stale is False
    assert snapshot.enforcement == ()
    assert [g.reading.info.uuid for g in snapshot.gpus] == [UUID0, UUID1]


def test_mark_stale_keeps_the_figures_and_replaces_health() -> None:
    node = reading(gpu0=[ProcessSample(101, GI, 10.0)])
    snapshot, _ = build(SnapshotBuilder("n", 5.0), node, [A], {101: A.allocation_id})
    failing = DaemonHealth(registered=True, poll_failures_consecutive=3)
    stale = mark_stale(snapshot, failing)
    assert stale.stale is True
    assert stale.health == failing
    assert dataclasses.replace(stale, stale=False, health=HEALTH) == snapshot
    assert snapshot.stale is False  # the original is unchanged


# ---------------------------------------------------------------------------------------------
# Attribution checked against the kubelet's checkpoint and the processes' pods

RESOURCE = "nvidia.com/vgpu"
POD_A = "aaaaaaaa-0000-0000-0000-000000000001"  # holds A (two slices of GPU 0)
POD_B = "bbbbbbbb-0000-0000-0000-000000000002"  # holds B (a slice of each GPU)
POD_M = "cccccccc-0000-0000-0000-000000000003"  # two containers, M1 and M2, both on GPU 1
POD_X = "dddddddd-0000-0000-0000-000000000004"  # holds nothing of ours
M1 = record(sid(UUID1, 2), namespace="ml", pod="multi", container="one")
M2 = record(sid(UUID1, 3), namespace="ml", pod="multi", container="two")
UNRECORDED = "0123456789abcdef"  # a well-formed ID that no container holds


def checkpoint_of(*holders: tuple[str, str, AllocationRecord]) -> DeviceCheckpoint:
    entries = [
        {
            "PodUID": pod,
            "ContainerName": container,
            "ResourceName": RESOURCE,
            "DeviceIDs": {"0": list(rec.slice_ids)},
            "AllocResp": "",
        }
        for pod, container, rec in holders
    ]
    blob = json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 0}).encode()
    checkpoint = parse_checkpoint(blob, RESOURCE)
    assert checkpoint.readable, checkpoint.reason
    return checkpoint


# C is in the daemon's book but not in the checkpoint (allocated to no pod the kubelet recorded).
CHECKPOINT = checkpoint_of(
    (POD_A, "worker", A), (POD_B, "server", B), (POD_M, "one", M1), (POD_M, "two", M2)
)
NO_PODS: dict[int, str] = {}


def evidence(
    pods: Mapping[int, str] = NO_PODS,
    checkpoint: DeviceCheckpoint = CHECKPOINT,
    *,
    trust_host: bool = False,
) -> AttributionEvidence:
    return AttributionEvidence(checkpoint, pods.get, trust_host_processes=trust_host)


a_id, b_id, c_id = A.allocation_id, B.allocation_id, C.allocation_id
m1_id, m2_id = M1.allocation_id, M2.allocation_id

# The build hands out the previous build's attribution while its inputs stay the same: whatever
# came before, a builder must attribute exactly as a new one would.
_PROCESS_SETS = (
    ((101, 102, 201, 401), (501, 502)),
    ((101, 102, 201, 401), (501, 502)),  # the same PIDs, other figures (see `_node`)
    ((101, 201), (501,)),
    ((), ()),
)
_TAGS = (
    {101: a_id, 102: None, 201: a_id, 401: c_id, 501: m1_id, 502: None},
    {101: a_id, 102: a_id, 201: None, 401: None, 501: m2_id, 502: m1_id},
)
_PODS: tuple[dict[int, str], ...] = (
    {101: POD_A, 102: POD_A, 201: POD_X, 501: POD_M, 502: POD_M},
    {101: POD_A, 102: POD_A, 201: POD_A, 501: POD_M},
    {},
)
_CGROUPS = {101: "/pa/c1", 102: "/pa/c1", 201: "/pa/c1", 501: "/pm/one", 502: "/pm/one"}
_CHECKPOINTS = (CHECKPOINT, checkpoint_of((POD_A, "worker", A)), DeviceCheckpoint.unreadable("x"))
_WALL_S = 1_700_000_000.0
_RECORDS = (
    (A, B, C, M1, M2),
    (A, dataclasses.replace(M1, listed=False, allocated_at_s=_WALL_S - 10.0), M2),
    (dataclasses.replace(A, pod="renamed"), B, C, M1, M2),
)
_INVENTORIES = (INVENTORY, inventory((gpu_info(0, UUID0), True), (gpu_info(1, UUID1), False)))


def _node(processes: int, tick: int) -> NodeReading:
    gpu0, gpu1 = _PROCESS_SETS[processes]
    util = 10.0 if processes == 1 else 0.0
    return reading(
        gpu0=[ProcessSample(pid, GI, util) for pid in gpu0],
        gpu1=[ProcessSample(pid, 2 * GI, util) for pid in gpu1],
        sm0=float(tick % 3),
    )


def _without_utilisation(snapshot: NodeSnapshot) -> NodeSnapshot:
    """The snapshot less what depends on earlier builds: the windows' averages."""
    return dataclasses.replace(
        snapshot,
        gpus=tuple(dataclasses.replace(g, sm_utilization_ratio=None) for g in snapshot.gpus),
        containers=tuple(
            dataclasses.replace(c, sm_utilization_ratio=0.0) for c in snapshot.containers
        ),
    )


# Each step changes one input (or none) and builds: what a stale attribution would get wrong.
_CHOICES = (
    len(_PROCESS_SETS),
    len(_TAGS),
    len(_PODS),
    len(_CHECKPOINTS),
    len(_RECORDS),
    len(_INVENTORIES),
    3,  # evidence: none, with a version, without one
    2,  # the wall clock: as it was, 20 s later (M1, unlisted, is then unconfirmed)
)


@settings(max_examples=300)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, len(_CHOICES)), st.integers(0, max(_CHOICES) - 1)),
        min_size=1,
        max_size=16,
    )
)
def test_a_builder_attributes_as_a_new_one_whatever_it_built_before(
    steps: list[tuple[int, int]],
) -> None:
    builder = SnapshotBuilder("n", 5.0)
    inputs = [0] * len(_CHOICES)
    inputs[6] = 1  # the daemon's case: evidence with the resolver's generation
    for tick, (which, value) in enumerate(steps):
        if which < len(_CHOICES):  # else: the same inputs again
            inputs[which] = value % _CHOICES[which]
        procs, tags, pods, ckpt, recs, inv, kind, later = inputs
        wall_s = _WALL_S + 20.0 * later
        evidence_ = (
            None
            if kind == 0
            else AttributionEvidence(
                _CHECKPOINTS[ckpt],
                _PODS[pods].get,
                cgroup_of=_CGROUPS.get,
                # The resolver's generation changes with its answers; here the pod table's.
                version=pods if kind == 1 else None,
            )
        )
        results = [
            b.build(
                _node(procs, tick),
                _INVENTORIES[inv],
                _RECORDS[recs],
                _TAGS[tags],
                now_s=float(tick),
                wall_s=wall_s,
                health=HEALTH,
                previous_reading_s=None,
                evidence=evidence_,
            )
            for b in (builder, SnapshotBuilder("n", 5.0))
        ]
        (seasoned, seasoned_unknown), (new, new_unknown) = results
        assert _without_utilisation(seasoned) == _without_utilisation(new)
        assert seasoned_unknown == new_unknown


@settings(max_examples=150)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 3),  # which process's utilisation changes (3: none)
            st.sampled_from([0.0, 25.0, 60.0]),
            st.floats(0.3, 0.7),  # seconds since the poll before
        ),
        min_size=1,
        max_size=30,
    )
)
def test_steady_builds_give_the_figures_of_full_builds(
    steps: list[tuple[int, float, float]],
) -> None:
    """A build whose charges are the last build's, with every average at its figure, only
    extends the windows: its snapshot must be the one a full build gives."""
    steady, full = SnapshotBuilder("n", 2.0), SnapshotBuilder("n", 2.0)
    utils = [10.0, 10.0, 30.0]
    tags = {101: a_id, 102: a_id, 201: b_id}
    now_s, previous_s = 100.0, None
    node = None
    for which, util, step_s in steps:
        if which < len(utils) or node is None:
            if which < len(utils):
                utils[which] = util
            node = reading(
                gpu0=[ProcessSample(101, GI, utils[0]), ProcessSample(102, GI, utils[1])],
                gpu1=[ProcessSample(201, GI, utils[2])],
                sm0=50.0,
            )
        now_s += step_s
        full._steady = None  # (a private detail: the reference builds every container in full)
        results = [
            b.build(
                node,
                INVENTORY,
                [A, B, C],
                tags,
                now_s=now_s,
                wall_s=_WALL_S,
                health=HEALTH,
                previous_reading_s=previous_s,
            )
            for b in (steady, full)
        ]
        assert results[0] == results[1]
        previous_s = now_s
