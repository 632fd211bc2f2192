"""The enforcement policy's test harness: hand-built snapshots with time passed in, and
`TimeSlicedGpu`, a model of the fake backend's time-slicing: every throttled container runs from
the start of each duty-cycle period for `duty` of it; while running, processes get their demand,
scaled down in proportion when the running ones want more than 100."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deviceplugin.config import (
    ComputeAction,
    ComputeEnforcement,
    EnforcementConfig,
    MemoryAction,
    MemoryEnforcement,
)
from deviceplugin.enforcer.policy import (
    Decision,
    EnforcementPolicy,
    Kill,
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
