"""The enforcement policy on hand-built snapshots, with time passed in.

Compute control runs against `TimeSlicedGpu`, a model of the fake backend's time-slicing: every
throttled container runs from the start of each duty-cycle period for `duty` of it; while running,
processes get their demand, scaled down in proportion when the running ones want more than 100.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.config import (
    ComputeAction,
    ComputeEnforcement,
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
    water_fill_level,
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

GIB = 1024**3
GPU = "GPU-00000000-0000-4000-8000-000000000000"
POLL_S = 0.5


def proc(pid: int, memory_gib: float = 1, util: float | None = 0.0) -> ProcessSample:
    return ProcessSample(pid=pid, used_memory_bytes=int(memory_gib * GIB), sm_util_percent=util)


def container(
    allocation: str,
    processes: Sequence[ProcessSample] = (),
    *,
    limit_gib: float = 10,
    share: float = 0.25,
    gpu: str = GPU,
) -> ContainerUsage:
    return ContainerUsage(
        allocation_id=allocation,
        gpu_uuid=gpu,
        gpu_index=0,
        slices=1,
        memory_used_bytes=sum(p.used_memory_bytes or 0 for p in processes),
        memory_limit_bytes=int(limit_gib * GIB),
        sm_utilization_ratio=0.0,
        compute_share_ratio=share,
        processes=tuple(processes),
        namespace="ns",
        pod=f"pod-{allocation}",
        container="main",
    )


def snapshot(
    *containers: ContainerUsage,
    unattributed: Sequence[ProcessSample] = (),
    healthy: bool = True,
    stale: bool = False,
) -> NodeSnapshot:
    info = GpuInfo(uuid=GPU, index=0, name="NVIDIA A100", memory_total_bytes=80 * GIB, minor=0)
    gpu = GpuUsage(
        reading=GpuReading(info=info, healthy=healthy),
        sm_utilization_ratio=None,
        unattributed=tuple(unattributed),
    )
    allocations = tuple(AllocationRecord(c.allocation_id, (f"{GPU}::0",), 0.0) for c in containers)
    return NodeSnapshot(
        taken_at_s=0.0,
        node_name="node",
        gpus=(gpu,),
        containers=containers,
        allocations=allocations,
        stale=stale,
    )


def config(
    *,
    memory: MemoryAction = MemoryAction.KILL,
    grace_s: float = 2.0,
    compute: ComputeAction = ComputeAction.THROTTLE,
    work_conserving: bool = True,
) -> EnforcementConfig:
    return EnforcementConfig(
        poll_interval_s=POLL_S,
        memory=MemoryEnforcement(action=memory, grace_period_s=grace_s),
        compute=ComputeEnforcement(action=compute, work_conserving=work_conserving),
    )


def kills(decisions: Iterable[Decision]) -> list[Kill]:
    return [d for d in decisions if isinstance(d, Kill)]


def signalled_pids(decisions: Iterable[Decision]) -> set[int]:
    pids: set[int] = set()
    for d in decisions:
        if isinstance(d, Kill):
            pids.add(d.pid)
        elif isinstance(d, SetDuty):
            pids |= d.pids
    return pids


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


# -- compute: a model of the fake backend's time-slicing ------------------------------------------


@dataclass
class TimeSlicedGpu:
    """Containers with one or more processes, each with a demand in percent; duties per
    container. `measure` gives each process's utilisation averaged over one duty-cycle period
    (a poll covers whole periods, so that is also the poll's average)."""

    demands: dict[str, list[float]]
    shares: dict[str, float]
    duties: dict[str, float] = field(default_factory=dict)

    def pids(self, name: str) -> list[int]:
        index = sorted(self.demands).index(name)
        return [1000 + 10 * index + i for i in range(len(self.demands[name]))]

    def measure(self) -> dict[str, list[float]]:
        duties = {n: min(max(self.duties.get(n, 1.0), 0.0), 1.0) for n in self.demands}
        cuts = sorted({0.0, 1.0, *duties.values()})
        util = {n: [0.0] * len(d) for n, d in self.demands.items()}
        for start, end in itertools.pairwise(cuts):
            running = [n for n in self.demands if duties[n] > start]
            total = sum(sum(self.demands[n]) for n in running)
            scale = 1.0 if total <= 100 else 100 / total
            for n in running:
                for i, demand in enumerate(self.demands[n]):
                    util[n][i] += (end - start) * demand * scale
        return util

    def snapshot(self, unattributed: Sequence[ProcessSample] = ()) -> NodeSnapshot:
        util = self.measure()
        return snapshot(
            *(
                container(
                    name,
                    [proc(pid, 1, u) for pid, u in zip(self.pids(name), util[name], strict=True)],
                    share=self.shares[name],
                )
                for name in sorted(self.demands)
            ),
            unattributed=unattributed,
        )

    def share_of(self, name: str) -> float:
        return sum(self.measure()[name]) / 100

    def apply(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            if isinstance(d, SetDuty):
                assert set(d.pids) <= set(self.pids(d.allocation_id))
                self.duties[d.allocation_id] = d.duty
            elif isinstance(d, Release):
                self.duties.pop(d.allocation_id, None)


@dataclass
class Run:
    """The history of a policy driven against a plant."""

    shares: list[dict[str, float]] = field(default_factory=list)  # measured, per tick
    duties: list[dict[str, float]] = field(default_factory=list)  # after each tick
    decisions: list[list[Decision]] = field(default_factory=list)


def drive(
    policy: EnforcementPolicy,
    plant: TimeSlicedGpu,
    ticks: int,
    run: Run | None = None,
    *,
    unattributed: Sequence[ProcessSample] = (),
) -> Run:
    run = run or Run()
    for _ in range(ticks):
        snap = plant.snapshot(unattributed)
        run.shares.append(
            {
                c.allocation_id: sum(p.sm_util_percent or 0 for p in c.processes) / 100
                for c in snap.containers
            }
        )
        decisions = policy.decide(snap, len(run.decisions) * POLL_S)
        plant.apply(decisions)
        run.decisions.append(decisions)
        run.duties.append({n: plant.duties.get(n, 1.0) for n in plant.demands})
    return run


def first_tick(run: Run, since: int, test: type[Decision], name: str) -> int | None:
    for tick in range(since, len(run.decisions)):
        if any(isinstance(d, test) and d.allocation_id == name for d in run.decisions[tick]):
            return tick - since
    return None


def test_a_container_above_its_share_with_a_hungry_neighbour_is_throttled() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    (decision,) = policy.decide(plant.snapshot(), 0.0)
    assert isinstance(decision, SetDuty)
    assert decision.allocation_id == "a"
    assert decision.started
    assert decision.pids == frozenset(plant.pids("a"))
    assert 0.05 <= decision.duty < 1
    assert decision.used_ratio == pytest.approx(0.5)
    assert decision.limit_ratio == pytest.approx(0.25)
    assert policy.duty(("a", GPU)) == decision.duty
    assert policy.duty(("b", GPU)) is None


@pytest.mark.parametrize("work_conserving", [True, False])
@pytest.mark.parametrize(
    "shares",
    [
        pytest.param({"a": 0.25, "b": 0.75}, id="25/75"),
        pytest.param({"a": 0.3, "b": 0.7}, id="30/70"),
        pytest.param({"a": 0.1, "b": 0.9}, id="10/90"),
        pytest.param({"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}, id="4 mixed"),
        pytest.param(
            dict(zip("abcdefgh", [0.05, 0.05, 0.1, 0.1, 0.125, 0.125, 0.2, 0.25], strict=True)),
            id="8 mixed",
        ),
    ],
)
def test_shares_converge_within_5_points_without_oscillating(
    shares: dict[str, float], work_conserving: bool
) -> None:
    policy = EnforcementPolicy(config(work_conserving=work_conserving))
    plant = TimeSlicedGpu({n: [100] for n in shares}, shares)
    run = drive(policy, plant, 30)
    for tick in range(20, 30):  # 10 s at a poll of 0.5 s
        for name, share in shares.items():
            assert run.shares[tick][name] == pytest.approx(share, abs=0.05), (tick, name)
    for name in shares:
        assert statistics.pstdev(d[name] for d in run.duties[-10:]) < 0.02
    # Converged in time: within 10 s (G2).
    for name, share in shares.items():
        assert abs(run.shares[19][name] - share) < 0.05


def test_convergence_survives_noisy_and_late_measurements() -> None:
    """Each reading is off by up to 2 points and shows the plant one tick late, as NVML samples
    may; the controller still settles within 5 points and stays there."""
    shares = {"a": 0.25, "b": 0.75}
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, shares)
    noise = [0.02, -0.015, 0.01, -0.02, 0.005, 0.015, -0.01, -0.005]
    offsets = [(n, -n) for n in noise]
    previous = plant.snapshot()
    measured: list[float] = []
    for tick in range(40):
        current = plant.snapshot()
        late = replace(
            previous,
            containers=tuple(
                replace(
                    c,
                    processes=tuple(
                        replace(p, sm_util_percent=max((p.sm_util_percent or 0) + 100 * n, 0))
                        for p in c.processes
                    ),
                )
                for c, n in zip(previous.containers, offsets[tick % 8], strict=True)
            ),
        )
        plant.apply(policy.decide(late, tick * POLL_S))
        previous = current
        measured.append(plant.share_of("a"))
    assert max(abs(m - 0.25) for m in measured[20:]) < 0.05


def test_a_lone_container_is_never_throttled_when_work_conserving() -> None:
    policy = EnforcementPolicy(config(work_conserving=True))
    plant = TimeSlicedGpu({"a": [100]}, {"a": 0.25})
    run = drive(policy, plant, 20)
    assert all(d == [] for d in run.decisions)
    assert run.shares[-1]["a"] == pytest.approx(1.0)


def test_a_lone_container_is_held_to_its_share_without_work_conservation() -> None:
    policy = EnforcementPolicy(config(work_conserving=False))
    plant = TimeSlicedGpu({"a": [100]}, {"a": 0.25})
    run = drive(policy, plant, 20)
    assert run.shares[-1]["a"] == pytest.approx(0.25, abs=0.02)
    assert sum(1 for d in run.decisions for x in d if isinstance(x, SetDuty) and x.started) == 1


def test_a_container_with_more_processes_is_throttled_as_a_whole() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100, 100, 100], "b": [100]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 30)
    assert run.shares[-1]["a"] == pytest.approx(0.25, abs=0.03)
    assert plant.duties["a"] < 1


def test_a_neighbour_arriving_throttles_within_a_few_ticks_and_leaving_releases() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 6)
    assert all(d == [] for d in run.decisions)

    plant.demands["b"] = [100]
    arrived = len(run.decisions)
    drive(policy, plant, 20, run)
    throttled_after = first_tick(run, arrived, SetDuty, "a")
    assert throttled_after is not None
    assert throttled_after <= 2  # G2: within 2 poll intervals
    assert run.shares[-1]["a"] == pytest.approx(0.25, abs=0.03)

    del plant.demands["b"]
    left = len(run.decisions)
    drive(policy, plant, 6, run)
    released_after = first_tick(run, left, Release, "a")
    assert released_after is not None
    assert released_after <= 2
    assert run.shares[-1]["a"] == pytest.approx(1.0)


def test_a_neighbour_going_idle_gives_the_time_back() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 20)
    assert plant.duties["a"] < 1
    plant.demands["b"] = [0]
    idle = len(run.decisions)
    drive(policy, plant, 6, run)
    released_after = first_tick(run, idle, Release, "a")
    assert released_after is not None
    assert released_after <= 3
    assert run.shares[-1]["a"] == pytest.approx(1.0)


def test_time_a_neighbour_does_not_want_goes_to_whoever_wants_it() -> None:
    """b wants 5 % of its 75 %: a may use the rest. A first throttle may happen while b's demand
    is learnt; after that a runs freely."""
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [5]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 20)
    episodes = sum(1 for d in run.decisions for x in d if isinstance(x, SetDuty) and x.started)
    assert episodes <= 1
    assert all(d == [] for d in run.decisions[5:])
    assert run.shares[-1]["a"] > 0.9


def test_a_neighbour_below_its_share_is_given_room_when_it_wants_more() -> None:
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100], "b": [5]}, {"a": 0.25, "b": 0.75})
    drive(policy, plant, 10)
    plant.demands["b"] = [100]
    run = drive(policy, plant, 20)
    assert run.shares[-1]["a"] == pytest.approx(0.25, abs=0.03)
    assert run.shares[-1]["b"] == pytest.approx(0.75, abs=0.03)


def test_growing_demands_that_fill_the_gpu_are_noticed() -> None:
    """Both containers grow past the point where the GPU is full; their demands were last seen
    below it, and must not be taken for what they want now."""
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [10], "b": [10]}, {"a": 0.25, "b": 0.75})
    for demand in (20, 30, 40, 44, 48, 60, 80, 100):
        plant.demands = {"a": [demand], "b": [demand]}
        drive(policy, plant, 2)
    run = drive(policy, plant, 20)
    assert run.shares[-1]["a"] == pytest.approx(0.25, abs=0.03)


def test_compute_monitor_records_once_per_violation_and_never_signals() -> None:
    policy = EnforcementPolicy(config(compute=ComputeAction.MONITOR))
    plant = TimeSlicedGpu({"a": [100], "b": [100]}, {"a": 0.25, "b": 0.75})
    run = drive(policy, plant, 10)
    flat = [d for ds in run.decisions for d in ds]
    assert signalled_pids(flat) == set()
    assert [(d.kind, d.action, d.allocation_id) for d in flat if isinstance(d, Record)] == [
        ("compute", "monitor", "a")
    ]
    assert policy.duty(("a", GPU)) is None


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


@pytest.mark.parametrize(
    ("shares", "demands", "level"),
    [
        pytest.param({"a": 0.25, "b": 0.75}, {"a": None, "b": None}, 1.0, id="both hungry"),
        pytest.param({"a": 0.25, "b": 0.75}, {"a": None, "b": 0.3}, 2.8, id="b wants 0.3"),
        pytest.param({"a": 0.25, "b": 0.75}, {"a": 0.1, "b": 0.3}, float("inf"), id="all fit"),
        pytest.param({"a": 0.25, "b": 0.25}, {"a": None, "b": None}, 2.0, id="free slices"),
        pytest.param({"a": 0.5, "b": 0.5}, {"a": None, "b": 0.9}, 1.0, id="b over its level"),
        pytest.param(
            {"a": 0.1, "b": 0.2, "c": 0.7}, {"a": None, "b": 0.05, "c": 0.25}, 7.0, id="cascade"
        ),
    ],
)
def test_water_fill_level(
    shares: Mapping[str, float], demands: Mapping[str, float | None], level: float
) -> None:
    keyed_shares = {(k, GPU): v for k, v in shares.items()}
    keyed_demands = {(k, GPU): v for k, v in demands.items()}
    assert water_fill_level(keyed_shares, keyed_demands) == pytest.approx(level)


def test_the_entitlement_is_what_a_container_may_use_now() -> None:
    """What the status view shows next to the nominal share: alone, a work-conserving container
    may use the whole GPU; with a hungry neighbour, its share; held to its share otherwise."""
    policy = EnforcementPolicy(config())
    plant = TimeSlicedGpu({"a": [100]}, {"a": 0.25, "b": 0.75})
    assert policy.entitlement(("a", GPU)) is None  # nothing decided yet
    drive(policy, plant, 6)
    assert policy.entitlement(("a", GPU)) == pytest.approx(1.0)
    plant.demands["b"] = [100]
    drive(policy, plant, 20)
    assert policy.entitlement(("a", GPU)) == pytest.approx(0.25)
    assert policy.entitlement(("b", GPU)) == pytest.approx(0.75)

    held = EnforcementPolicy(config(work_conserving=False))
    drive(held, TimeSlicedGpu({"a": [100]}, {"a": 0.25}), 6)
    assert held.entitlement(("a", GPU)) == pytest.approx(0.25)


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
    from deviceplugin.model import SOURCE_DRA, AllocationRecord, DaemonHealth, DeviceGrant
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
