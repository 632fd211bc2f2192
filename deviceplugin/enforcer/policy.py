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

Memory (docs/design.md §4). A container's memory on a GPU above its limit for `grace_period_s` is a
violation. `kill`: the largest of its processes on that GPU is killed, then nothing more until that
process has left the GPU's process list (or `kill_timeout_s` passed, after which its memory counts
as freed), and the container is checked again. `monitor`: one record per violation.

Compute (docs/design.md §4). Per GPU and tick:

1. Each container's utilisation `u` is the sum of its processes' SM utilisation this poll,
   smoothed into `m` by an EWMA (the controller works on these, not on the 5 s window, whose lag
   would make it oscillate). It also estimates its gain `c`, an EWMA of u / duty: the utilisation
   it gets per unit of running time.
2. Demand. The GPU is full when the processes on it (attributed or not) use `saturated_ratio` of
   it or more, this poll or smoothed. A container's demand is learnt when it runs unthrottled on a
   GPU with room (it got all it asked for), or is idle. It is unknown ("hungry": it may want more)
   while it is throttled and when it first appears on a full GPU. On a full GPU a known demand
   follows the container's use down, and is dropped when it uses clearly more, or when its
   busiest process runs near the level of the busiest unthrottled process: time-slicing then
   holds it back, and how much it wants cannot be seen. (A rule "hungry when using >= 90 % of its
   entitlement" fails here: two containers that both want the whole GPU each get half of it by
   time-slicing, and the one whose share is 3/4 would look satisfied at 1/2.)
3. Entitlements. Without work conservation e = share. With it, the GPU is water-filled: a
   container whose known demand fits under the fill level keeps what it uses, and the rest is split
   among the others in proportion to their shares. Every container's entitlement is level x share,
   at least its share.
4. Control. A container whose smoothed utilisation exceeds its entitlement by
   `start_tolerance_ratio`, plus the time that throttled neighbours are entitled to but not yet
   using (their duty is still rising), starts a throttle episode. Each tick then sets
   duty += gain x (e / c - duty), clamped to [duty_min, 1]: where utilisation is proportional to
   running time the error shrinks by (1 - gain) per tick without overshoot, and the only fixed
   point is u = e, whatever the plant's gain (queued GPU work that runs on after SIGSTOP lowers the
   gain, and the duty settles lower). When e / c reaches `1 - release_band_ratio` the episode ends
   and the processes run freely again.

A lone container is never throttled with work conservation (its level covers the whole GPU), and is
held to its share without it. Only processes listed in a container's usage are ever named in a
decision; a PID that also appears among a GPU's unattributed processes, or in two allocations, is
left out, and so is every process of a GPU reported unhealthy (its figures cannot be trusted).

Steady GPUs. The policy is a function of its state and its inputs. A GPU whose inputs (its
containers' usage, its unattributed processes, the PIDs left out) are those of a tick that
decided nothing, changed none of its state and read no clock (no container over its memory
limit, no kill pending) is not ticked again until they change: that tick would decide nothing
again. Smoothed figures snap onto a steady input once within a billionth of it, so that a steady
GPU gets there in tens of ticks.

Over 400 lines: the memory and compute rules above share the state `EnforcementPolicy` keeps
between snapshots; one class, read against the rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deviceplugin.config import ComputeAction, EnforcementConfig, MemoryAction
from deviceplugin.model import ContainerUsage, NodeSnapshot, ProcessSample

ContainerKey = tuple[str, str]  # (allocation ID, GPU UUID)

MEMORY = "memory"
COMPUTE = "compute"
KILL = "kill"
THROTTLE = "throttle"
MONITOR = "monitor"

_POLL_JITTER_RATIO = 0.1
# Smoothed ratios this close to their input count as equal to it (a billionth of a GPU).
_SETTLED_RATIO = 1e-9


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL `pid`, the container's largest process on the GPU (memory action `kill`)."""

    allocation_id: str
    gpu_uuid: str
    pid: int
    used_bytes: int
    limit_bytes: int
    process_used_bytes: int
    over_for_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class SetDuty:
    """Run the container's processes `pids` for `duty` of every duty-cycle period.

    `started` is true on the tick that begins a throttle episode (the one that is counted).
    `used_ratio` is the container's smoothed utilisation, `limit_ratio` its entitlement."""

    allocation_id: str
    gpu_uuid: str
    pids: frozenset[int]
    duty: float
    started: bool
    used_ratio: float
    limit_ratio: float
    share_ratio: float


@dataclass(frozen=True, slots=True)
class Release:
    """End the container's throttle episode: its processes run freely again."""

    allocation_id: str
    gpu_uuid: str
    reason: str


@dataclass(frozen=True, slots=True)
class Record:
    """A violation recorded without acting on it (action `monitor`).

    For memory, `used` and `limit` are bytes and `pid` the process a kill would take; for compute
    they are ratios of the GPU and `pid` is None."""

    kind: str
    action: str
    allocation_id: str
    gpu_uuid: str
    pid: int | None
    used: float
    limit: float
    reason: str


Decision = Kill | SetDuty | Release | Record


@dataclass(frozen=True, slots=True)
class ControllerTuning:
    """The compute controller's constants. The defaults suit polls of 0.2-1 s."""

    # EWMA weight of the newest per-poll utilisation (1 = no smoothing).
    utilisation_alpha: float = 0.5
    # EWMA weight of the newest gain sample u / duty.
    gain_alpha: float = 0.3
    # Fraction of the distance to the target duty covered per tick (1 = dead-beat).
    gain: float = 0.5
    duty_min: float = 0.05
    # How far above its entitlement a container must be for an episode to start.
    start_tolerance_ratio: float = 0.03
    # An episode ends when the duty the controller aims at is at least 1 - this.
    release_band_ratio: float = 0.02
    # A GPU whose processes' utilisation sums to this or more is full.
    saturated_ratio: float = 0.9
    # On a full GPU, a container whose busiest process runs at this fraction of the busiest
    # unthrottled process or more is held back by time-slicing: hungry.
    contention_ratio: float = 0.8
    # On a saturated GPU, a container using more than its known demand plus this is hungry again.
    demand_margin_ratio: float = 0.05
    # A container using less than this is idle: its demand is what it uses.
    idle_ratio: float = 0.01
    # How old stale figures may be (from the last successful poll) before every throttle is
    # released.
    stale_release_s: float = 5.0


def kill_timeout_for(config: EnforcementConfig) -> float:
    """How long to wait for a killed process to leave the GPU before checking again."""
    return max(5.0, 5 * config.poll_interval_s)


def water_fill_level(
    shares: Mapping[ContainerKey, float],
    demands: Mapping[ContainerKey, float | None],
    capacity: float = 1.0,
) -> float:
    """The level L of a weighted max-min fair split of `capacity`: a container whose known demand
    is at most L x share keeps its demand, the others get L x share each (None = unknown demand,
    i.e. wants more). Infinite when every container's demand fits."""
    active = {k: s for k, s in shares.items() if s > 0}
    remaining = capacity
    while True:
        total_share = sum(active.values())
        if total_share <= 0:
            return float("inf")
        level = max(remaining, 0.0) / total_share
        fitted = [
            k
            for k, s in active.items()
            if (demand := demands.get(k)) is not None and demand <= level * s
        ]
        if not fitted:
            return level
        for k in fitted:
            remaining -= demands[k] or 0.0
            del active[k]


@dataclass(slots=True)
class _MemoryState:
    over_since_s: float | None = None
    recorded: bool = False
    # PIDs killed and the time of the kill, until they leave the GPU's process list.
    killed: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class _ComputeState:
    util_ratio: float  # smoothed
    gain_ratio: float
    last_ratio: float = 0.0  # this poll's, unsmoothed
    demand_ratio: float | None = None
    duty: float = 1.0  # 1 = not throttled
    violating: bool = False  # monitor: inside a recorded violation
    entitlement_ratio: float | None = None  # this tick's; None for a container without a share

    @property
    def throttled(self) -> bool:
        return self.duty < 1.0


# Plain loops rather than max()/sum() over a generator: called for every container on every poll,
# mostly with one or two processes, where a generator's set-up costs more than the arithmetic.
def _peak_ratio(processes: Iterable[ProcessSample]) -> float:
    peak: float | None = None
    for p in processes:
        util = p.sm_util_percent or 0.0
        if peak is None or util > peak:
            peak = util
    return (peak if peak is not None else 0.0) / 100.0


def _settle(smoothed: float, target: float) -> float:
    """An EWMA step's result, `target` itself once within _SETTLED_RATIO of it: a steady input
    then leaves the state unchanged from one tick to the next (a fixed point) within tens of
    ticks, rather than creeping by ever smaller steps for minutes."""
    return target if abs(smoothed - target) < _SETTLED_RATIO else smoothed


def _util_ratio(processes: Iterable[ProcessSample]) -> float:
    total = 0.0
    for p in processes:
        total += p.sm_util_percent or 0.0
    return min(max(total / 100.0, 0.0), 1.0)


class EnforcementPolicy:
    """The memory and compute policy (docs/design.md §4): a pure state machine over snapshots."""

    def __init__(self, config: EnforcementConfig, tuning: ControllerTuning | None = None) -> None:
        self.config = config
        self.tuning = tuning or ControllerTuning()
        self.kill_timeout_s = kill_timeout_for(config)
        self._memory: dict[ContainerKey, _MemoryState] = {}
        self._compute: dict[ContainerKey, _ComputeState] = {}
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
        by_gpu: dict[str, list[ContainerUsage]] = {}
        seen: set[ContainerKey] = set()
        for c in snapshot.containers:
            key = (c.allocation_id, c.gpu_uuid)
            if key in seen:
                continue  # one usage per container and GPU; a duplicate is ignored
            seen.add(key)
            by_gpu.setdefault(c.gpu_uuid, []).append(c)

        for gpu_uuid, containers in by_gpu.items():
            if gpu_uuid not in healthy_gpus:
                self._settled.discard(gpu_uuid)
                self.revision += 1
                decisions.extend(self._release_gpu(containers, "GPU unhealthy or not reported"))
                continue
            inputs = (tuple(containers), unattributed.get(gpu_uuid, ()), excluded_inputs)
            repeated = self._last_inputs.get(gpu_uuid) == inputs
            if repeated and gpu_uuid in self._settled:
                continue  # a tick on these inputs changed nothing, and would change nothing now
            self.revision += 1
            before = self._fixed_point(gpu_uuid, containers) if repeated else None
            self._last_inputs[gpu_uuid] = inputs
            self._settled.discard(gpu_uuid)
            gpu_decisions: list[Decision] = []
            own: dict[ContainerKey, tuple[ProcessSample, ...]] = {}
            for c in containers:
                processes = (
                    tuple(p for p in c.processes if p.pid not in excluded)
                    if excluded
                    else c.processes
                )
                own[(c.allocation_id, c.gpu_uuid)] = processes
                gpu_decisions.extend(self._decide_memory(c, processes, now_s))
            if gpu_uuid not in mig_devices:
                # (NVML measures no utilisation per MIG device: no compute share to enforce.)
                gpu_decisions.extend(
                    self._decide_compute(unattributed.get(gpu_uuid, ()), gpu_uuid, containers, own)
                )
            decisions.extend(gpu_decisions)
            if (
                before is not None
                and not gpu_decisions
                and before == self._fixed_point(gpu_uuid, containers)
            ):
                self._settled.add(gpu_uuid)

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
        self._settled.intersection_update(by_gpu)
        if len(self._settled) == len(by_gpu):  # (each one skipped, or settled by this tick)
            self._all_settled = node_inputs
        return decisions

    def _fixed_point(
        self, gpu_uuid: str, containers: Iterable[ContainerUsage]
    ) -> tuple[object, ...] | None:
        """All the policy keeps about a GPU, to tell whether a tick changed any of it; None while
        any of it depends on the clock (a container over its memory limit, a kill pending). A
        tick that decided nothing and changed nothing is a fixed point: the policy is a function
        of its state and inputs, so the same inputs again would decide nothing again."""
        parts: list[object] = [self._unattributed_util.get(gpu_uuid)]
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

    # -- memory -----------------------------------------------------------------------------

    def _decide_memory(
        self, c: ContainerUsage, processes: tuple[ProcessSample, ...], now_s: float
    ) -> list[Decision]:
        key = (c.allocation_id, c.gpu_uuid)
        state = self._memory.get(key)
        if state is None:
            state = self._memory[key] = _MemoryState()
        limit = c.memory_limit_bytes
        if not state.killed and (limit <= 0 or c.memory_used_bytes <= limit):
            # Within its limit with no kill pending (what nearly every container is, every
            # poll): the general case below, without building what it needs for kills.
            state.over_since_s = None
            state.recorded = False
            return []
        listed = {p.pid: p for p in processes}
        for pid in [pid for pid in state.killed if pid not in listed]:
            del state.killed[pid]  # gone from the GPU: its memory is free
        if any(now_s - t < self.kill_timeout_s for t in state.killed.values()):
            return []  # wait for the killed process to go before looking again
        dying_bytes = sum(listed[pid].used_memory_bytes or 0 for pid in state.killed)
        used = c.memory_used_bytes - dying_bytes
        if limit <= 0 or used <= limit:
            state.over_since_s = None
            state.recorded = False
            return []
        if state.over_since_s is None:
            state.over_since_s = now_s
        over_for_s = now_s - state.over_since_s
        # Polls come a little early or late; one due at the end of the grace period counts.
        if over_for_s + _POLL_JITTER_RATIO * self.config.poll_interval_s < (
            self.config.memory.grace_period_s
        ):
            return []
        candidates = [p for p in processes if p.pid not in state.killed]
        victim = max(candidates, key=lambda p: (p.used_memory_bytes or 0, p.pid), default=None)
        reason = f"over the memory limit for {over_for_s:.1f}s"
        if self.config.memory.action is MemoryAction.MONITOR:
            if state.recorded:
                return []
            state.recorded = True
            return [
                Record(
                    MEMORY,
                    MONITOR,
                    c.allocation_id,
                    c.gpu_uuid,
                    victim.pid if victim is not None else None,
                    float(used),
                    float(limit),
                    reason,
                )
            ]
        if victim is None:
            return []
        state.killed[victim.pid] = now_s
        return [
            Kill(
                c.allocation_id,
                c.gpu_uuid,
                victim.pid,
                used,
                limit,
                victim.used_memory_bytes or 0,
                over_for_s,
                reason,
            )
        ]

    # -- compute ----------------------------------------------------------------------------

    def _decide_compute(
        self,
        unattributed: Sequence[ProcessSample],
        gpu_uuid: str,
        containers: list[ContainerUsage],
        processes: Mapping[ContainerKey, tuple[ProcessSample, ...]],
    ) -> list[Decision]:
        """`processes`: each container's processes on the GPU, the excluded PIDs left out."""
        t = self.tuning
        enforcing = self.config.compute.action is ComputeAction.THROTTLE

        # 1. Smoothed utilisation and gain.
        states: dict[ContainerKey, _ComputeState] = {}
        for c in containers:
            key = (c.allocation_id, c.gpu_uuid)
            u = _util_ratio(processes[key])
            state = self._compute.get(key)
            if state is None:
                state = self._compute[key] = _ComputeState(u, u)
            else:
                state.util_ratio = _settle(
                    state.util_ratio + t.utilisation_alpha * (u - state.util_ratio), u
                )
                sample = min(u / state.duty, 1.0)
                state.gain_ratio = _settle(
                    state.gain_ratio + t.gain_alpha * (sample - state.gain_ratio), sample
                )
            state.last_ratio = u
            states[key] = state

        u_other = _util_ratio(unattributed)
        previous = self._unattributed_util.get(gpu_uuid)
        other = u_other
        if previous is not None:
            other = _settle(previous + t.utilisation_alpha * (u_other - previous), u_other)
        self._unattributed_util[gpu_uuid] = other

        # 2. Demand. The GPU is full when this poll's or the smoothed load reaches
        # `saturated_ratio` (both must be under it to learn a demand, so that noise and smoothing
        # lag do not pass a full GPU off as one with room). On a full GPU a known demand is
        # dropped when the container uses clearly more than it, or when its busiest process runs
        # near the level of the busiest unthrottled process: time-slicing is then holding it
        # back, and how much it wants cannot be seen.
        load_now = u_other + sum(s.last_ratio for s in states.values())
        load_smoothed = other + sum(s.util_ratio for s in states.values())
        full = max(load_now, load_smoothed) >= t.saturated_ratio
        # The processes' peaks matter only on a full GPU (most polls, most GPUs are not).
        peaks: dict[ContainerKey, float] = {}
        level_now = 0.0
        if full:
            peaks = {key: _peak_ratio(processes[key]) for key in states}
            level_now = max(
                (peak for key, peak in peaks.items() if not states[key].throttled), default=0.0
            )
        for key, state in states.items():
            busy = max(state.last_ratio, state.util_ratio)
            if enforcing and state.throttled:
                state.demand_ratio = None
            elif busy < t.idle_ratio or not full:
                state.demand_ratio = busy
            elif state.demand_ratio is not None and (
                state.util_ratio > state.demand_ratio + t.demand_margin_ratio
                or peaks[key] >= t.contention_ratio * level_now
            ):
                state.demand_ratio = None
            elif state.demand_ratio is not None:
                # Using less than it did: it wants less (or is squeezed to this by time-slicing,
                # which is then all it can get while others run).
                state.demand_ratio = min(state.demand_ratio, busy)

        # 3. Entitlements.
        shares = {(c.allocation_id, c.gpu_uuid): c.compute_share_ratio for c in containers}
        if self.config.compute.work_conserving:
            level = water_fill_level(shares, {k: s.demand_ratio for k, s in states.items()})
        else:
            level = 1.0

        # 4. Control. Time that throttled containers are entitled to but do not use yet (their
        # duty is still rising) is no reason to throttle whoever uses it meanwhile.
        entitlements = {
            key: level * share if share > 0 else float("inf") for key, share in shares.items()
        }
        slack = sum(
            max(entitlements[key] - state.util_ratio, 0.0)
            for key, state in states.items()
            if state.throttled and entitlements[key] < float("inf")
        )
        decisions: list[Decision] = []
        for c in containers:
            key = (c.allocation_id, c.gpu_uuid)
            state = states[key]
            share = c.compute_share_ratio
            entitled = entitlements[key]
            state.entitlement_ratio = min(entitled, 1.0) if entitled < float("inf") else None
            own = processes[key]
            if not enforcing:
                decisions.extend(self._monitor(c, state, entitled, busy=bool(own)))
                continue
            if not state.throttled:
                if own and state.util_ratio > entitled + slack + t.start_tolerance_ratio:
                    # Unthrottled, this poll's utilisation is the gain itself: start from it.
                    state.gain_ratio = max(state.last_ratio, t.idle_ratio)
                    target = entitled / state.gain_ratio
                    state.duty = min(max(1.0 + t.gain * (target - 1.0), t.duty_min), 1.0)
                    if state.throttled:
                        state.demand_ratio = None
                        decisions.append(
                            SetDuty(
                                c.allocation_id,
                                c.gpu_uuid,
                                frozenset(p.pid for p in own),
                                state.duty,
                                True,
                                state.util_ratio,
                                entitled,
                                share,
                            )
                        )
                continue
            if not own:
                state.duty = 1.0
                decisions.append(Release(c.allocation_id, c.gpu_uuid, "no GPU processes left"))
                continue
            target = entitled / max(state.gain_ratio, 1e-6)
            if target >= 1.0 - t.release_band_ratio:
                state.duty = 1.0
                decisions.append(
                    Release(
                        c.allocation_id,
                        c.gpu_uuid,
                        f"within its entitlement (used={state.util_ratio:.3f} "
                        f"limit={min(entitled, 1.0):.3f})",
                    )
                )
                continue
            state.duty = min(max(state.duty + t.gain * (target - state.duty), t.duty_min), 1.0)
            decisions.append(
                SetDuty(
                    c.allocation_id,
                    c.gpu_uuid,
                    frozenset(p.pid for p in own),
                    state.duty,
                    False,
                    state.util_ratio,
                    entitled,
                    share,
                )
            )
        return decisions

    def _monitor(
        self, c: ContainerUsage, state: _ComputeState, entitled: float, *, busy: bool
    ) -> list[Decision]:
        """Compute action `monitor`: one record when a violation begins, none while it lasts."""
        if state.violating:
            if state.util_ratio <= entitled:
                state.violating = False
            return []
        if not busy or state.util_ratio <= entitled + self.tuning.start_tolerance_ratio:
            return []
        state.violating = True
        return [
            Record(
                COMPUTE,
                MONITOR,
                c.allocation_id,
                c.gpu_uuid,
                None,
                state.util_ratio,
                entitled,
                "over its compute entitlement while others want more",
            )
        ]
