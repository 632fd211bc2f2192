"""Unit tests for deviceplugin.usage.charges: the attribution rules of docs/design.md §12, one
process at a time (`attribute`) and through a build with evidence."""

from __future__ import annotations

import dataclasses

import pytest

from deviceplugin.kubelet.checkpoint import DeviceCheckpoint
from deviceplugin.model import ProcessSample
from deviceplugin.usage.attribution import SnapshotBuilder
from deviceplugin.usage.charges import attribute
from tests.unit.test_attribution import (
    GI,
    HEALTH,
    INVENTORY,
    M1,
    M2,
    POD_A,
    POD_B,
    POD_M,
    POD_X,
    UNRECORDED,
    UUID0,
    UUID1,
    A,
    B,
    C,
    a_id,
    b_id,
    build,
    c_id,
    checkpoint_of,
    evidence,
    m1_id,
    m2_id,
    reading,
    usage_of,
)

# (what, tag, pod, GPU) -> (attributed to by its own tag, misattributed). A process whose
# tag does not stand may still be charged by its container cgroup (see the build tests).
RULES: list[tuple[str, str | None, str | None, str, str | None, bool]] = [
    ("honest", a_id, POD_A, UUID0, a_id, False),
    ("honest, the other GPU of its allocation", b_id, POD_B, UUID1, b_id, False),
    ("honest, one of several containers", m1_id, POD_M, UUID1, m1_id, False),
    ("honest, the other container", m2_id, POD_M, UUID1, m2_id, False),
    ("honest tag on a GPU its pod holds nothing of", a_id, POD_A, UUID1, a_id, False),
    ("spoofed ID, pod with one allocation here", b_id, POD_A, UUID0, None, True),
    ("spoofed ID, pod without allocations", a_id, POD_X, UUID0, None, True),
    ("spoofed ID, pod with several allocations here", b_id, POD_M, UUID1, None, True),
    ("host process, recorded ID", a_id, None, UUID0, None, True),
    ("host process, unrecorded ID", c_id, None, UUID0, None, True),
    ("host process, no ID", None, None, UUID0, None, False),
    ("no or invalid ID, pod with one allocation here", None, POD_A, UUID0, None, False),
    ("unrecorded ID, pod with one allocation here", UNRECORDED, POD_A, UUID0, None, True),
    ("no or invalid ID, pod with several allocations here", None, POD_M, UUID1, None, False),
    ("no ID, pod holding nothing on this GPU", None, POD_A, UUID1, None, False),
    ("unrecorded ID, pod holding nothing on this GPU", UNRECORDED, POD_A, UUID1, None, True),
    ("no ID, pod without allocations", None, POD_X, UUID0, None, False),
]


@pytest.mark.parametrize(
    ("tag", "pod", "gpu", "expected", "refused"),
    [row[1:] for row in RULES],
    ids=[row[0] for row in RULES],
)
def test_attribution_rules(
    tag: str | None, pod: str | None, gpu: str, expected: str | None, refused: bool
) -> None:
    assert attribute(tag, pod, gpu, evidence()) == (expected, refused)


@pytest.mark.parametrize(
    ("tag", "pod", "gpu"), [row[1:4] for row in RULES], ids=[row[0] for row in RULES]
)
def test_without_a_readable_checkpoint_every_claim_stands(
    tag: str | None, pod: str | None, gpu: str
) -> None:
    for checkpoint in (DeviceCheckpoint(), DeviceCheckpoint.unreadable("no checkpoint at x")):
        assert attribute(tag, pod, gpu, evidence(checkpoint=checkpoint)) == (tag, False)


def test_trusted_host_processes_keep_their_claims_but_pods_are_still_checked() -> None:
    trusting = evidence(trust_host=True)
    assert attribute(a_id, None, UUID0, trusting) == (a_id, False)
    assert attribute(c_id, None, UUID0, trusting) == (c_id, False)
    assert attribute(b_id, POD_A, UUID0, trusting) == (None, True)
    assert attribute(a_id, POD_X, UUID0, trusting) == (None, True)


def test_a_readable_empty_checkpoint_refuses_every_claim() -> None:
    empty = evidence(checkpoint=checkpoint_of())
    assert attribute(a_id, None, UUID0, empty) == (None, True)
    assert attribute(a_id, POD_A, UUID0, empty) == (None, True)
    assert attribute(None, POD_A, UUID0, empty) == (None, False)


def test_build_with_evidence_refuses_spoofed_claims_and_counts_them() -> None:
    node = reading(
        gpu0=[
            ProcessSample(101, 2 * GI, 10.0),  # A's own process
            ProcessSample(102, 1 * GI, 10.0),  # A's process that cleared its environment
            ProcessSample(201, 30 * GI, 90.0),  # another pod, naming A
            ProcessSample(202, 1 * GI, 0.0),  # another pod, naming an unrecorded ID
            ProcessSample(401, 1 * GI, 0.0),  # a host process naming C (not recorded)
            ProcessSample(402, 1 * GI, 0.0),  # a host process naming A
        ],
        gpu1=[ProcessSample(501, 1 * GI, 0.0)],  # pod M, no ID: ambiguous between M1 and M2
    )
    tags = {101: a_id, 102: None, 201: a_id, 202: UNRECORDED, 401: c_id, 402: a_id, 501: None}
    pods = {101: POD_A, 102: POD_A, 201: POD_X, 202: POD_X, 501: POD_M}
    cgroups = {101: "/kubepods/podA/ctr1", 102: "/kubepods/podA/ctr1", 501: "/kubepods/podM/c"}
    records = [A, B, C, M1, M2]
    builder = SnapshotBuilder("n", 5.0)
    snapshot, unknown = builder.build(
        node,
        INVENTORY,
        records,
        tags,
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=HEALTH,
        previous_reading_s=9.0,
        evidence=dataclasses.replace(evidence(pods), cgroup_of=cgroups.get),
    )
    a0 = usage_of(snapshot, A, UUID0)
    assert [p.pid for p in a0.processes] == [101, 102]
    assert a0.memory_used_bytes == 3 * GI  # the spoofers' 31 GiB are not charged to A
    assert a0.sm_utilization_ratio == pytest.approx(0.2)
    assert usage_of(snapshot, C, UUID0).processes == ()  # a host process's tag is refused
    assert [p.pid for p in snapshot.gpus[0].unattributed] == [201, 202, 401, 402]
    assert [p.pid for p in snapshot.gpus[1].unattributed] == [501]
    assert [p.pid for p in snapshot.gpus[0].misattributed] == [201, 202, 401, 402]
    assert snapshot.gpus[1].misattributed == ()  # no tag: nothing refused
    assert snapshot.gpus[0].unattributed_pods == ((201, POD_X), (202, POD_X))
    assert snapshot.gpus[1].unattributed_pods == ((501, POD_M),)
    assert unknown == frozenset()  # refused tags ask pod-resources nothing
    for pid in (201, 202, 401, 402, 501):
        assert all(pid not in {p.pid for p in c.processes} for c in snapshot.containers)


def test_build_with_an_unreadable_checkpoint_is_todays_build() -> None:
    node = reading(gpu0=[ProcessSample(101, GI, 10.0), ProcessSample(201, GI, 10.0)])
    tags = {101: a_id, 201: UNRECORDED}
    pods = {101: POD_A, 201: POD_X}
    unreadable = evidence(pods, DeviceCheckpoint.unreadable("no checkpoint at /x"))
    plain = build(SnapshotBuilder("n", 5.0), node, [A], tags)
    checked = SnapshotBuilder("n", 5.0).build(
        node,
        INVENTORY,
        [A],
        tags,
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=HEALTH,
        previous_reading_s=9.0,
        evidence=unreadable,
    )
    assert checked == plain
    assert plain[1] == frozenset({UNRECORDED})
