"""Pure: what to do about each container's GPU memory and compute time, one snapshot at a time.

`EnforcementPolicy.decide(snapshot, now_s, now_wall_s)` returns decisions (kill, set a duty cycle,
release, record a violation) and keeps the state that needs memory between snapshots: since when a
container is over its memory limit, which kills are pending, each container's smoothed utilisation,
its demand when known, and its duty cycle. Time comes in as arguments, so the whole policy runs
in tests with hand-built snapshots in milliseconds.

Stale snapshots (the latest poll failed) never cause an action. Throttles are held while the figures
are younger than `stale_release_s` and released after: the figures' age is the wall-clock time
since the reading they hold was taken (`taken_at_s`, which a stale snapshot keeps), so polling that
stops is noticed from the last successful poll, not from the first failure reported (a hung poll is
reported only at its timeout).

Only processes listed in a container's usage are ever named in a decision; a PID that also
appears among a GPU's unattributed processes, or in two allocations, is left out, and so is every
process of a GPU reported unhealthy (its figures cannot be trusted).

Steady GPUs. The policy is a function of its state and its inputs. A GPU whose inputs (its
containers' usage, its unattributed processes, the PIDs left out) are those of a tick that
decided nothing, changed none of its state and read no clock (no container over its memory
limit, no kill pending) is not ticked again until they change: that tick would decide nothing
again. Smoothed figures snap onto a steady input once within a billionth of it, so that a steady
GPU gets there in tens of ticks.

The memory rule is `enforcer.memory`, the compute controller `enforcer.compute`, the decisions
and tuning `enforcer.decisions`; this module keeps their state between snapshots and runs them
per GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deviceplugin.config import EnforcementConfig
from deviceplugin.enforcer.compute import ComputeState, decide_compute, water_fill_level
from deviceplugin.enforcer.decisions import (
    COMPUTE,
    KILL,
    MEMORY,
    MONITOR,
    THROTTLE,
    ContainerKey,
    ControllerTuning,
    Decision,
    Kill,
    Record,
    Release,
    SetDuty,
    kill_timeout_for,
)
from deviceplugin.enforcer.memory import MemoryState, decide_memory
from deviceplugin.enforcer.pressure import PressureState, decide_pressure
from deviceplugin.model import ContainerUsage, NodeSnapshot, ProcessSample

__all__ = [
    "COMPUTE",
    "KILL",
    "MEMORY",
    "MONITOR",
    "THROTTLE",
    "ContainerKey",
    "ControllerTuning",
    "Decision",
    "EnforcementPolicy",
    "Kill",
    "Record",
    "Release",
    "SetDuty",
    "kill_timeout_for",
    "water_fill_level",
]


class EnforcementPolicy:
    """The memory and compute policy (docs/design.md §4): a pure state machine over snapshots."""

    def __init__(self, config: EnforcementConfig, tuning: ControllerTuning | None = None) -> None:
        self.config = config
        self.tuning = tuning or ControllerTuning()
        self.kill_timeout_s = kill_timeout_for(config)
        self._memory: dict[ContainerKey, MemoryState] = {}
        self._pressure: dict[str, PressureState] = {}
        self._compute: dict[ContainerKey, ComputeState] = {}
        self._unattributed_util: dict[str, float] = {}
        self._stale_since_s: float | None = None
        # Per GPU: the inputs of its last tick; and the GPUs whose last tick changed nothing and
        # depended on no clock (see `_fixed_point`): the same inputs again need no tick.
        self._last_inputs: dict[str, tuple[object, ...]] = {}
        self._settled: set[str] = set()
        # Moves whenever a container's duty or entitlement may have changed: while it stands
        # still, what the enforcer derived from them last time still holds.
        self.revision = 0
        # The last snapshot's inputs when every GPU with containers was settled after it: the
        # same inputs again decide nothing and change nothing, without a look at each GPU.
        self._all_settled: tuple[object, ...] | None = None

    # -- queries, for tests and the enforcer ------------------------------------------------

    def duty(self, key: ContainerKey) -> float | None:
        """The container's duty cycle, None when it is not throttled."""
        state = self._compute.get(key)
        return state.duty if state is not None and state.throttled else None

    def entitlement(self, key: ContainerKey) -> float | None:
        """The share of its GPU the container may use as of the last tick: its nominal share,
        raised under work-conserving sharing by time that others leave idle. None when not known
        (no tick yet, or no share)."""
        state = self._compute.get(key)
        return state.entitlement_ratio if state is not None else None

    def throttled(self) -> frozenset[ContainerKey]:
        return frozenset(k for k, s in self._compute.items() if s.throttled)

    def reset(self, key: ContainerKey) -> None:
        """Forget that `key` is throttled (the enforcer could not act on it)."""
        state = self._compute.get(key)
        if state is not None:
            state.duty = 1.0
            state.demand_ratio = None
        self._settled.discard(key[1])
        self._all_settled = None
        self.revision += 1

    # -- the policy ---------------------------------------------------------------------------

    def decide(
        self, snapshot: NodeSnapshot, now_s: float, now_wall_s: float | None = None
    ) -> list[Decision]:
        """The decisions for this snapshot, taken at monotonic time `now_s` and wall-clock time
        `now_wall_s` (used only for stale snapshots; without it their age is counted from the
        first stale snapshot)."""
        if snapshot.stale:
            self.revision += 1
            return self._stale(snapshot, now_s, now_wall_s)
        self._stale_since_s = None
        node_inputs = (
            snapshot.containers,
            tuple((g.info.uuid, g.reading.healthy, g.info.is_mig_device) for g in snapshot.gpus),
            tuple(g.unattributed for g in snapshot.gpus),
        )
        if node_inputs == self._all_settled:
            return []  # every GPU would be skipped, and nothing is gone
        self._all_settled = None
        decisions: list[Decision] = []

        excluded = self._excluded_pids(snapshot)
        excluded_inputs = frozenset(excluded)
        healthy_gpus = {g.info.uuid for g in snapshot.gpus if g.reading.healthy}
        mig_devices = {g.info.uuid for g in snapshot.gpus if g.info.is_mig_device}
        unattributed = {g.info.uuid: g.unattributed for g in snapshot.gpus}
        memory = {
            g.info.uuid: (g.info.memory_total_bytes, g.reading.memory_used_bytes)
            for g in snapshot.gpus
            if g.reading.memory_used_bytes is not None
        }
        by_gpu, seen = _by_gpu(snapshot.containers)
        for gpu_uuid, containers in by_gpu.items():
            if gpu_uuid not in healthy_gpus:
                self._settled.discard(gpu_uuid)
                self.revision += 1
                decisions.extend(self._release_gpu(containers, "GPU unhealthy or not reported"))
                continue
            gpu_memory = memory.get(gpu_uuid)
            inputs = (
                tuple(containers),
                unattributed.get(gpu_uuid, ()),
                excluded_inputs,
                gpu_memory,
            )
            repeated = self._last_inputs.get(gpu_uuid) == inputs
            if repeated and gpu_uuid in self._settled:
                continue  # a tick on these inputs changed nothing, and would change nothing now
            self.revision += 1
            before = self._fixed_point(gpu_uuid, containers) if repeated else None
            self._last_inputs[gpu_uuid] = inputs
            self._settled.discard(gpu_uuid)
            gpu_decisions = self._tick(
                gpu_uuid,
                containers,
                excluded,
                unattributed.get(gpu_uuid, ()),
                now_s,
                # (NVML measures no utilisation per MIG device: no compute share to enforce.)
                compute=gpu_uuid not in mig_devices,
                memory=gpu_memory,
            )
            decisions.extend(gpu_decisions)
            if (
                before is not None
                and not gpu_decisions
                and before == self._fixed_point(gpu_uuid, containers)
            ):
                self._settled.add(gpu_uuid)
        decisions.extend(self._forget_gone(snapshot, seen, by_gpu))
        if len(self._settled) == len(by_gpu):  # (each one skipped, or settled by this tick)
            self._all_settled = node_inputs
        return decisions

    def _tick(
        self,
        gpu_uuid: str,
        containers: list[ContainerUsage],
        excluded: set[int],
        unattributed: tuple[ProcessSample, ...],
        now_s: float,
        *,
        compute: bool,
        memory: tuple[int, int] | None = None,
    ) -> list[Decision]:
        """One GPU's tick: the memory rule per container, the pressure rule (`memory`: the GPU's
        memory total and used), then the compute controller, on each container's processes less
        the `excluded` PIDs."""
        decisions: list[Decision] = []
        own: dict[ContainerKey, tuple[ProcessSample, ...]] = {}
        for c in containers:
            processes = (
                tuple(p for p in c.processes if p.pid not in excluded) if excluded else c.processes
            )
            own[(c.allocation_id, c.gpu_uuid)] = processes
            decisions.extend(
                decide_memory(
                    c,
                    processes,
                    now_s,
                    states=self._memory,
                    config=self.config,
                    kill_timeout_s=self.kill_timeout_s,
                )
            )
        if memory is not None:
            decisions.extend(
                decide_pressure(
                    (gpu_uuid, *memory),
                    containers,
                    own,
                    now_s,
                    state=self._pressure.setdefault(gpu_uuid, PressureState()),
                    config=self.config,
                    kill_timeout_s=self.kill_timeout_s,
                )
            )
        if compute:
            decisions.extend(
                decide_compute(
                    unattributed,
                    gpu_uuid,
                    containers,
                    own,
                    kept=self._compute,
                    unattributed_util=self._unattributed_util,
                    config=self.config,
                    t=self.tuning,
                )
            )
        return decisions

    def _forget_gone(
        self,
        snapshot: NodeSnapshot,
        seen: set[ContainerKey],
        by_gpu: Mapping[str, list[ContainerUsage]],
    ) -> list[Decision]:
        """Forget the containers and GPUs this snapshot no longer has: a throttled container
        that is gone is released."""
        decisions: list[Decision] = []
        for key in [k for k in self._compute if k not in seen]:
            self.revision += 1
            if self._compute[key].throttled:
                decisions.append(Release(key[0], key[1], "container gone"))
            del self._compute[key]
        for key in [k for k in self._memory if k not in seen]:
            del self._memory[key]
        gpus = {g.info.uuid for g in snapshot.gpus}
        for uuid in [u for u in self._unattributed_util if u not in gpus]:
            del self._unattributed_util[uuid]
        for uuid in [u for u in self._last_inputs if u not in by_gpu]:
            del self._last_inputs[uuid]
        for uuid in [u for u in self._pressure if u not in by_gpu]:
            del self._pressure[uuid]
        self._settled.intersection_update(by_gpu)
        return decisions

    def _fixed_point(
        self, gpu_uuid: str, containers: Iterable[ContainerUsage]
    ) -> tuple[object, ...] | None:
        """All the policy keeps about a GPU, to tell whether a tick changed any of it; None while
        any of it depends on the clock (a container over its memory limit, a kill pending). A
        tick that decided nothing and changed nothing is a fixed point: the policy is a function
        of its state and inputs, so the same inputs again would decide nothing again."""
        pressure = self._pressure.get(gpu_uuid)
        if pressure is not None and pressure.killed:
            return None
        parts: list[object] = [
            self._unattributed_util.get(gpu_uuid),
            pressure.recorded if pressure is not None else None,
        ]
        for c in containers:
            key = (c.allocation_id, c.gpu_uuid)
            memory = self._memory.get(key)
            if memory is not None and (memory.killed or memory.over_since_s is not None):
                return None
            state = self._compute.get(key)
            parts.append(
                None
                if state is None
                else (
                    state.util_ratio,
                    state.gain_ratio,
                    state.last_ratio,
                    state.demand_ratio,
                    state.duty,
                    state.violating,
                    state.entitlement_ratio,
                )
            )
        return tuple(parts)

    @staticmethod
    def _excluded_pids(snapshot: NodeSnapshot) -> set[int]:
        """PIDs never named in a decision: unattributed ones, and any claimed by two allocations."""
        excluded = {p.pid for g in snapshot.gpus for p in g.unattributed}
        owner: dict[int, str] = {}
        for c in snapshot.containers:
            for p in c.processes:
                if owner.setdefault(p.pid, c.allocation_id) != c.allocation_id:
                    excluded.add(p.pid)
        return excluded

    def _stale(
        self, snapshot: NodeSnapshot, now_s: float, now_wall_s: float | None
    ) -> list[Decision]:
        """Stale figures: no new action; throttles are held while the figures are young, then
        released. Their age is the wall-clock time since they were taken; the monotonic time since
        the first stale snapshot is a lower bound of it that holds when the wall clock is set
        back (or unknown)."""
        if self._stale_since_s is None:
            self._stale_since_s = now_s
        age_s = now_s - self._stale_since_s
        if now_wall_s is not None and snapshot.taken_at_s > 0:
            age_s = max(age_s, now_wall_s - snapshot.taken_at_s)
        if age_s < self.tuning.stale_release_s:
            return []
        self._settled.clear()
        self._all_settled = None
        decisions: list[Decision] = []
        for key, state in self._compute.items():
            if state.throttled:
                decisions.append(Release(key[0], key[1], "measurements stale"))
                state.duty = 1.0
                state.demand_ratio = None
        return decisions

    def _release_gpu(self, containers: Iterable[ContainerUsage], reason: str) -> list[Decision]:
        decisions: list[Decision] = []
        for c in containers:
            key = (c.allocation_id, c.gpu_uuid)
            state = self._compute.get(key)
            if state is not None and state.throttled:
                decisions.append(Release(c.allocation_id, c.gpu_uuid, reason))
                state.duty = 1.0
                state.demand_ratio = None
        return decisions


def _by_gpu(
    containers: Iterable[ContainerUsage],
) -> tuple[dict[str, list[ContainerUsage]], set[ContainerKey]]:
    """The containers' usage per GPU, one per container and GPU (a duplicate is ignored), and
    the (allocation, GPU) keys seen."""
    by_gpu: dict[str, list[ContainerUsage]] = {}
    seen: set[ContainerKey] = set()
    for c in containers:
        key = (c.allocation_id, c.gpu_uuid)
        if key in seen:
            continue
        seen.add(key)
        by_gpu.setdefault(c.gpu_uuid, []).append(c)
    return by_gpu, seen
