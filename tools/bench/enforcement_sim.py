"""The simulated-time half of the enforcement benchmark (`bench_enforcement.py`, whose
docstring says what each row measures): the memory policy with time passed in, and compute
shares against `Plant`, a model of the fake backend's time-slicing."""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deviceplugin.config import EnforcementConfig, MemoryEnforcement
from deviceplugin.enforcer import EnforcementPolicy, Kill, Release, SetDuty
from deviceplugin.model import (
    ContainerUsage,
    GpuInfo,
    GpuReading,
    GpuUsage,
    NodeSnapshot,
    ProcessSample,
)

GIB = 1024**3
GPU = "GPU-00000000-0000-4000-8000-0000000be4c0"
MIXES: dict[int, list[float]] = {
    2: [0.25, 0.75],
    4: [0.1, 0.2, 0.3, 0.4],
    8: [0.05, 0.05, 0.1, 0.1, 0.125, 0.125, 0.2, 0.25],
}


def gpu_usage() -> GpuUsage:
    info = GpuInfo(uuid=GPU, index=0, name="sim", memory_total_bytes=80 * GIB, minor=0)
    return GpuUsage(reading=GpuReading(info=info), sm_utilization_ratio=None)


def usage(
    name: str, processes: Sequence[ProcessSample], share: float, limit: int
) -> ContainerUsage:
    return ContainerUsage(
        allocation_id=name,
        gpu_uuid=GPU,
        gpu_index=0,
        slices=1,
        memory_used_bytes=sum(p.used_memory_bytes or 0 for p in processes),
        memory_limit_bytes=limit,
        sm_utilization_ratio=0.0,
        compute_share_ratio=share,
        processes=tuple(processes),
    )


def memory_policy(trials: int) -> dict[str, float]:
    poll_s, grace_s = 0.5, 2.0
    rng = random.Random(7)
    extra_polls: list[float] = []
    from_start_s: list[float] = []
    for _ in range(trials):
        policy = EnforcementPolicy(
            EnforcementConfig(
                poll_interval_s=poll_s, memory=MemoryEnforcement(grace_period_s=grace_s)
            )
        )
        violation_s = rng.uniform(0, poll_s)
        first_seen: float | None = None
        for tick in range(1, 40):
            now = tick * poll_s + rng.uniform(-0.01, 0.01)  # polls jitter a little
            over = now >= violation_s
            memory = 12 * GIB if over else 8 * GIB
            snap = NodeSnapshot(
                0.0,
                "sim",
                (gpu_usage(),),
                (usage("a", [ProcessSample(1, memory)], 0.25, 10 * GIB),),
            )
            if over and first_seen is None:
                first_seen = now
            if any(isinstance(d, Kill) for d in policy.decide(snap, now)):
                assert first_seen is not None
                extra_polls.append(round((now - first_seen - grace_s) / poll_s, 2))
                from_start_s.append(now - violation_s)
                break
    return {
        "polls_after_grace_max": max(extra_polls),
        "from_violation_s_median": statistics.median(from_start_s),
        "from_violation_s_max": max(from_start_s),
    }


@dataclass
class Plant:
    """The fake backend's time-slicing, one period at a time (see the module docstring)."""

    demands: dict[str, float]
    duties: dict[str, float] = field(default_factory=dict)

    def measure(self) -> dict[str, float]:
        duties = {n: min(max(self.duties.get(n, 1.0), 0.0), 1.0) for n in self.demands}
        cuts = sorted({0.0, 1.0, *duties.values()})
        util = dict.fromkeys(self.demands, 0.0)
        for start, end in itertools.pairwise(cuts):
            running = [n for n in self.demands if duties[n] > start]
            total = sum(self.demands[n] for n in running)
            scale = 1.0 if total <= 100 else 100 / total
            for n in running:
                util[n] += (end - start) * self.demands[n] * scale / 100
        return util


def share_sim(count: int, *, noisy: bool, ticks: int = 40) -> dict[str, Any]:
    quotas = {f"c{i}": q for i, q in enumerate(MIXES[count])}
    policy = EnforcementPolicy(EnforcementConfig())
    plant = Plant(dict.fromkeys(quotas, 100.0))
    rng = random.Random(count)
    history: list[dict[str, float]] = []
    late = plant.measure()
    for tick in range(ticks):
        now = plant.measure()
        history.append(now)
        seen = late if noisy else now
        late = now
        if noisy:
            seen = {n: min(max(u + rng.uniform(-0.02, 0.02), 0.0), 1.0) for n, u in seen.items()}
        snap = NodeSnapshot(
            0.0,
            "sim",
            (gpu_usage(),),
            tuple(
                usage(n, [ProcessSample(100 + i, GIB, seen[n] * 100)], quotas[n], 10 * GIB)
                for i, n in enumerate(quotas)
            ),
        )
        for d in policy.decide(snap, tick * 0.5):
            if isinstance(d, SetDuty):
                plant.duties[d.allocation_id] = d.duty
            elif isinstance(d, Release):
                plant.duties.pop(d.allocation_id, None)
    errors = [abs(h[n] - q) for h in history[-10:] for n, q in quotas.items()]
    converged = next(
        (
            t
            for t in range(ticks)
            if all(abs(h[n] - q) < 0.05 for h in history[t:] for n, q in quotas.items())
        ),
        None,
    )
    return {
        "mean_error_points": 100 * statistics.mean(errors),
        "max_error_points": 100 * max(errors),
        "converge_polls": converged,
    }
