"""The enforcement policy (deviceplugin.enforcer.policy) on hand-built snapshots, with time passed
in: the memory rule, what is never acted on (unattributed, shared or stale figures, unhealthy
GPUs, MIG compute), and that a GPU whose inputs repeat is not ticked again. The compute
controller's own tests are in tests/unit/test_compute.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.config import (
    ComputeAction,
    EnforcementConfig,
    MemoryAction,
    MemoryEnforcement,
)
from deviceplugin.enforcer.policy import (
    ControllerTuning,
    Decision,
    EnforcementPolicy,
    Kill,
    Record,
    Release,
    SetDuty,
)
from deviceplugin.model import (
    AllocationRecord,
    ContainerUsage,
    GpuInfo,
    GpuReading,
    GpuUsage,
    NodeSnapshot,
    ProcessSample,
)
from tests.support.policy_model import (
    GIB,
    GPU,
    POLL_S,
    TimeSlicedGpu,
    config,
    container,
    drive,
    kills,
    proc,
    signalled_pids,
    snapshot,
)

# -- memory --------------------------------------------------------------------------------------


def test_memory_over_the_limit_is_killed_after_the_grace_period_and_not_before() -> None:
    policy = EnforcementPolicy(config(grace_s=2.0))
    over = snapshot(container("a", [proc(10, 6), proc(11, 5)], limit_gib=10))
    for tick in range(4):  # 0 .. 1.5 s over the limit
        assert policy.decide(over, tick * POLL_S) == []
    (kill,) = kills(policy.decide(over, 2.0))
    assert kill == Kill(
        allocation_id="a",
        gpu_uuid=GPU,
        pid=10,
        used_bytes=11 * GIB,
        limit_bytes=10 * GIB,
        process_used_bytes=6 * GIB,
        over_for_s=2.0,
        reason=kill.reason,
    )


def test_a_spike_inside_the_grace_period_is_not_killed_and_restarts_the_wait() -> None:
    policy = EnforcementPolicy(config(grace_s=2.0))
    over = snapshot(container("a", [proc(10, 12)]))
    under = snapshot(container("a", [proc(10, 8)]))
    timeline = [over, over, over, under, over, over, over, over]  # 0 .. 3.5 s
    for tick, snap in enumerate(timeline):
        assert policy.decide(snap, tick * POLL_S) == []
    assert kills(policy.decide(over, 4.0)) != []  # 2 s after the second rise


def test_no_grace_period_kills_at_first_sight() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    assert kills(policy.decide(snapshot(container("a", [proc(10, 11)])), 0.0))


@pytest.mark.parametrize(
    ("processes", "victim"),
    [
        pytest.param([proc(10, 2), proc(11, 7), proc(12, 3)], 11, id="largest"),
        pytest.param([proc(10, 6), proc(11, 6)], 11, id="tie: highest pid"),
        pytest.param([ProcessSample(10, None), proc(11, 12)], 11, id="unknown memory counts 0"),
    ],
)
def test_the_largest_process_on_the_gpu_is_the_one_killed(
    processes: list[ProcessSample], victim: int
) -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    (kill,) = kills(policy.decide(snapshot(container("a", processes)), 0.0))
    assert kill.pid == victim


def test_after_a_kill_nothing_more_until_the_process_is_gone_then_a_recheck() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    big, middle, small = proc(10, 8), proc(11, 4), proc(12, 2)
    assert [k.pid for k in kills(policy.decide(snapshot(container("a", [big, middle, small])), 0))]
    # Still listed (the driver has not freed it yet): no second kill, though still over.
    for tick in range(1, 6):
        assert policy.decide(snapshot(container("a", [big, middle, small])), tick * POLL_S) == []
    # Gone, and the rest is still over the limit: the next largest goes at once.
    still_over = snapshot(container("a", [proc(11, 8), small], limit_gib=9))
    assert [k.pid for k in kills(policy.decide(still_over, 3.0))] == [11]


def test_after_a_kill_frees_enough_nothing_more_is_killed() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    assert kills(policy.decide(snapshot(container("a", [proc(10, 8), proc(11, 4)])), 0))
    for tick in range(1, 20):
        assert policy.decide(snapshot(container("a", [proc(11, 4)])), tick * POLL_S) == []


def test_a_killed_process_still_listed_after_the_timeout_counts_as_freed() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    timeout = policy.kill_timeout_s
    stuck = [proc(10, 8), proc(11, 4)]
    assert [k.pid for k in kills(policy.decide(snapshot(container("a", stuck)), 0))] == [10]
    # Past the timeout, pid 10 is still listed; 4 GiB of the rest is under the limit.
    assert policy.decide(snapshot(container("a", stuck)), timeout + 0.1) == []
    # The rest grows over the limit by itself: the next process goes, never pid 10 again.
    grown = [proc(10, 8), proc(11, 11)]
    assert [k.pid for k in kills(policy.decide(snapshot(container("a", grown)), timeout + 1))] == [
        11
    ]


def test_memory_monitor_records_once_per_violation_and_never_kills() -> None:
    policy = EnforcementPolicy(config(memory=MemoryAction.MONITOR, grace_s=1.0))
    over = snapshot(container("a", [proc(10, 12)]))
    under = snapshot(container("a", [proc(10, 2)]))
    decisions: list[Decision] = []
    for tick, snap in enumerate([over] * 6 + [under] + [over] * 4):
        decisions += policy.decide(snap, tick * POLL_S)
    assert kills(decisions) == []
    records = [d for d in decisions if isinstance(d, Record)]
    assert records == decisions
    assert [(r.kind, r.action, r.allocation_id, r.pid, r.used, r.limit) for r in records] == [
        ("memory", "monitor", "a", 10, 12.0 * GIB, 10.0 * GIB)
    ] * 2


def test_memory_is_per_container_and_gpu() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    snap = snapshot(
        container("a", [proc(10, 6)], limit_gib=10),
        container("a", [proc(10, 6)], limit_gib=5, gpu="GPU-other"),
        container("b", [proc(20, 9)], limit_gib=10),
    )
    other = GpuInfo(uuid="GPU-other", index=1, name="x", memory_total_bytes=GIB, minor=1)
    snap = replace(snap, gpus=(*snap.gpus, GpuUsage(GpuReading(other), None)))
    assert [(k.gpu_uuid, k.pid) for k in kills(policy.decide(snap, 0))] == [("GPU-other", 10)]


def test_unattributed_processes_are_never_in_any_decision() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    host = [proc(1, 70, 100.0), proc(2, 70, 100.0)]
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 10, unattributed=host)
    assert run.decisions[0]
    # A PID the attribution put both in a container and among the unattributed: left alone.
    shared = snapshot(
        container("c", [proc(1, 20, 100.0), proc(30, 1, 0.0)], limit_gib=10),
        container("d", [proc(40, 1, 10.0)], share=0.75),
        unattributed=host,
    )
    decisions = policy.decide(shared, 100.0)
    everything = [d for ds in run.decisions for d in ds] + decisions
    assert signalled_pids(everything).isdisjoint({1, 2})
    assert [k.pid for k in kills(decisions)] == [30]


def test_a_pid_claimed_by_two_allocations_is_left_alone() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    snap = snapshot(
        container("a", [proc(7, 20, 100.0)]),
        container("b", [proc(7, 20, 100.0), proc(8, 20, 0.0)], share=0.75, limit_gib=30),
    )
    decisions = policy.decide(snap, 0.0)
    assert 7 not in signalled_pids(decisions)
    assert [k.pid for k in kills(decisions)] == [8]


def test_a_gone_container_is_released() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 3)
    assert policy.duty(("a", GPU)) is not None
    decisions = policy.decide(snapshot(container("b", [proc(5, 1, 100.0)], share=0.75)), 10.0)
    assert decisions == [Release("a", GPU, "container gone")]
    assert policy.throttled() == frozenset()


def test_a_throttled_container_whose_processes_left_the_gpu_is_released() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 3)
    snap = snapshot(container("a", []), container("b", [proc(5, 1, 100.0)], share=0.75))
    assert policy.decide(snap, 10.0) == [Release("a", GPU, "no GPU processes left")]


def test_stale_snapshots_without_a_wall_clock_release_after_the_first_stale_one() -> None:
    tuning = ControllerTuning(stale_release_s=2.0)
    policy = EnforcementPolicy(config(grace_s=0), tuning)
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 3)
    stale = replace(
        snapshot(container("a", [proc(1000, 50, 100.0)]), container("b", share=0.75)),
        stale=True,
    )
    for tick in range(4):
        assert policy.decide(stale, 10.0 + tick * POLL_S) == []
    assert policy.decide(stale, 12.0) == [Release("a", GPU, "measurements stale")]
    assert policy.decide(stale, 12.5) == []


def throttled_policy() -> tuple[EnforcementPolicy, NodeSnapshot]:
    """A policy with container a throttled, and the last good figures marked stale: taken at
    wall-clock time 1000 s."""
    policy = EnforcementPolicy(config(grace_s=0))
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 3)
    assert policy.duty(("a", GPU)) is not None
    return policy, replace(plant.snapshot(), taken_at_s=1000.0, stale=True)


@pytest.mark.parametrize(
    ("first_stale_after_s", "released_after_s"),
    [
        pytest.param(POLL_S, 5.0, id="polls fail at once"),
        pytest.param(4.0, 5.0, id="a poll hangs for 4 s"),
        pytest.param(6.0, 6.0, id="a poll hangs for 6 s"),
    ],
)
def test_stale_throttles_are_released_5_s_after_the_last_successful_poll(
    first_stale_after_s: float, released_after_s: float
) -> None:
    """Counted from when the figures were taken, not from the first stale snapshot, which a
    hung poll reports only at its timeout (README: "When polling fails for 5 s, throttles are
    released")."""
    policy, stale = throttled_policy()
    mono0 = 100.0  # monotonic and wall clocks run together here, 900 s apart
    at = first_stale_after_s
    while at < released_after_s - 1e-9:
        assert policy.decide(stale, mono0 + at, 1000.0 + at) == [], at
        at += POLL_S
    released = policy.decide(stale, mono0 + released_after_s, 1000.0 + released_after_s)
    assert released == [Release("a", GPU, "measurements stale")]
    assert policy.decide(stale, mono0 + released_after_s + POLL_S, 1000.0 + 99) == []


def test_stale_throttles_are_released_even_when_the_wall_clock_is_set_back() -> None:
    policy, stale = throttled_policy()
    for tick in range(10):  # the wall clock reads 10 minutes before the figures
        assert policy.decide(stale, 100.0 + tick * POLL_S, 400.0) == []
    assert policy.decide(stale, 105.0, 400.0) == [Release("a", GPU, "measurements stale")]


def test_a_fresh_snapshot_between_stale_ones_restarts_nothing_early() -> None:
    """Figures from a later successful poll are young again: no release until they too are
    5 s old."""
    policy, stale = throttled_policy()
    assert policy.decide(stale, 104.0, 1004.0) == []
    fresh = replace(stale, stale=False, taken_at_s=1004.5)
    policy.decide(fresh, 104.5, 1004.5)
    assert policy.duty(("a", GPU)) is not None
    stale_again = replace(fresh, stale=True)
    assert policy.decide(stale_again, 105.0, 1005.0) == []
    assert policy.decide(stale_again, 109.0, 1009.0) == []
    assert policy.decide(stale_again, 109.5, 1009.5) == [Release("a", GPU, "measurements stale")]


def test_an_unhealthy_gpu_gets_no_kills_and_its_throttles_are_released() -> None:
    policy = EnforcementPolicy(config(grace_s=0))
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 3)
    sick = snapshot(
        container("a", [proc(1000, 50, 100.0)]), container("b", share=0.75), healthy=False
    )
    assert policy.decide(sick, 10.0) == [Release("a", GPU, "GPU unhealthy or not reported")]
    assert policy.decide(sick, 11.0) == []


def mig_snapshot(*containers: ContainerUsage) -> NodeSnapshot:
    base = snapshot(*containers)
    info = replace(
        base.gpus[0].info,
        parent_uuid="GPU-parent",
        mig_profile="3g.40gb",
        gpu_instance_id=1,
        compute_instance_id=0,
    )
    return replace(base, gpus=(replace(base.gpus[0], reading=GpuReading(info=info)),))


def test_containers_on_a_mig_device_are_never_throttled_but_their_memory_is_enforced() -> None:
    policy = EnforcementPolicy(config(grace_s=0.0))
    # Whatever utilisation a process might claim, a MIG device has no compute share to enforce.
    greedy = container("a", [proc(1, memory_gib=1, util=100.0)], share=0.25)
    hog = container("b", [proc(2, memory_gib=12, util=100.0)], share=0.25)
    decisions: list[Decision] = []
    for tick in range(20):
        decisions += policy.decide(mig_snapshot(greedy, hog), now_s=tick * POLL_S)

    assert not [d for d in decisions if isinstance(d, SetDuty)]
    assert [k.pid for k in kills(decisions)] == [2]


# A GPU whose inputs repeat those of a tick that changed nothing is not ticked again: that must
# never change a decision, whatever came before. The reference policy forgets every such tick.
_LOADS = (0.0, 0.3, 1.0, 60.0, 100.0)  # a process's SM utilisation, percent
_MEMORY_GIB = (1, 1, 12)  # the last is over a 10 GiB limit


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 3),  # which of the four processes changes (3: none)
            st.integers(0, len(_LOADS) - 1),
            st.integers(0, len(_MEMORY_GIB) - 1),
            st.integers(1, 6),  # how many ticks these inputs are seen in a row
            st.booleans(),  # stale
        ),
        min_size=1,
        max_size=12,
    ),
    memory=st.sampled_from([MemoryAction.KILL, MemoryAction.MONITOR]),
    compute=st.sampled_from([ComputeAction.THROTTLE, ComputeAction.MONITOR]),
)
def test_repeated_inputs_decide_as_a_policy_that_ticks_every_time(
    steps: list[tuple[int, int, int, int, bool]],
    memory: MemoryAction,
    compute: ComputeAction,
) -> None:
    cfg = config(memory=memory, compute=compute, grace_s=1.0)
    skipping, reference = EnforcementPolicy(cfg), EnforcementPolicy(cfg)
    figures = [(2, 0), (2, 0), (0, 0), (0, 0)]  # per process: load, memory
    tick = 0
    for which, load, mem, repeats, stale in steps:
        if which < len(figures):
            figures[which] = (load, mem)
        processes = [
            proc(100 + n, memory_gib=_MEMORY_GIB[m], util=_LOADS[u])
            for n, (u, m) in enumerate(figures)
        ]
        # a: two processes, share 3/4; b and c one each, 1/8 each.
        snap = snapshot(
            container("a", processes[:2], share=0.75),
            container("b", processes[2:3], share=0.125),
            container("c", processes[3:], share=0.125),
            stale=stale,
        )
        for _ in range(repeats):
            now_s = tick * POLL_S
            # (Private details: the reference never skips a GPU, nor the whole node.)
            reference._settled.clear()
            reference._all_settled = None
            assert skipping.decide(snap, now_s) == reference.decide(snap, now_s)
            for key in (("a", GPU), ("b", GPU), ("c", GPU)):
                assert skipping.duty(key) == reference.duty(key)
                assert skipping.entitlement(key) == reference.entitlement(key)
            tick += 1


def test_an_allocation_stating_its_shares_is_enforced_like_a_slice_allocation() -> None:
    """The enforcer does not know where an allocation came from: one that states its memory
    limit per device (a DRA claim) is held to it like a device-plugin allocation of slices."""
    from deviceplugin.model import SOURCE_DRA, DaemonHealth, DeviceGrant
    from deviceplugin.usage.attribution import SnapshotBuilder
    from tests.unit.test_attribution import INVENTORY, UUID0, reading

    gib = 1 << 30
    claim = AllocationRecord(
        "00000000000000c1",
        (),
        0.0,
        "ml",
        "trainer",
        "main",
        grants=(DeviceGrant(UUID0, 12 * gib, 0.3),),
        source=SOURCE_DRA,
        claim="ml/trainer-gpu",
    )
    snapshot, unknown = SnapshotBuilder("n", 5.0).build(
        reading(gpu0=[ProcessSample(4242, 13 * gib, 10.0)]),
        INVENTORY,
        [claim],
        {4242: claim.allocation_id},
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=DaemonHealth(),
        previous_reading_s=9.0,
    )
    (usage,) = snapshot.containers
    assert (usage.memory_limit_bytes, usage.compute_share_ratio) == (12 * gib, 0.3)
    assert unknown == frozenset()
    assert snapshot.gpus[0].slices_allocated == 0  # no slice of the inventory is held
    policy = EnforcementPolicy(EnforcementConfig(memory=MemoryEnforcement(grace_period_s=0.0)))
    decided = policy.decide(snapshot, 0.0) + policy.decide(snapshot, 1.0)
    assert [d.pid for d in decided if isinstance(d, Kill)] == [4242]
