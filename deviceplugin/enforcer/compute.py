"""Pure: the compute controller of the enforcement policy.

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
held to its share without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.config import ComputeAction, EnforcementConfig
from deviceplugin.enforcer.decisions import (
    COMPUTE,
    MONITOR,
    ContainerKey,
    ControllerTuning,
    Decision,
    Record,
    Release,
    SetDuty,
)
from deviceplugin.model import ContainerUsage, ProcessSample

# Smoothed ratios this close to their input count as equal to it (a billionth of a GPU).
_SETTLED_RATIO = 1e-9


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
class ComputeState:
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


def decide_compute(
    unattributed: Sequence[ProcessSample],
    gpu_uuid: str,
    containers: list[ContainerUsage],
    processes: Mapping[ContainerKey, tuple[ProcessSample, ...]],
    *,
    kept: dict[ContainerKey, ComputeState],
    unattributed_util: dict[str, float],
    config: EnforcementConfig,
    t: ControllerTuning,
) -> list[Decision]:
    """The compute controller for one GPU and tick (this module's docstring). `processes`: each
    container's processes on the GPU, the excluded PIDs left out; `kept` and `unattributed_util`
    hold each container's and GPU's state between snapshots."""
    enforcing = config.compute.action is ComputeAction.THROTTLE
    # 1. Smoothed utilisation and gain.
    states = _smoothed(containers, processes, kept, t)
    u_other = _util_ratio(unattributed)
    previous = unattributed_util.get(gpu_uuid)
    other = u_other
    if previous is not None:
        other = _settle(previous + t.utilisation_alpha * (u_other - previous), u_other)
    unattributed_util[gpu_uuid] = other
    # 2. Demand.
    load_now = u_other + sum(s.last_ratio for s in states.values())
    load_smoothed = other + sum(s.util_ratio for s in states.values())
    full = max(load_now, load_smoothed) >= t.saturated_ratio
    _learn_demands(states, processes, full=full, enforcing=enforcing, t=t)
    # 3. Entitlements.
    entitlements = _entitlements(containers, states, work_conserving=config.compute.work_conserving)
    # 4. Control. Time that throttled containers are entitled to but do not use yet (their
    # duty is still rising) is no reason to throttle whoever uses it meanwhile.
    slack = sum(
        max(entitlements[key] - state.util_ratio, 0.0)
        for key, state in states.items()
        if state.throttled and entitlements[key] < float("inf")
    )
    decisions: list[Decision] = []
    for c in containers:
        key = (c.allocation_id, c.gpu_uuid)
        state = states[key]
        entitled = entitlements[key]
        state.entitlement_ratio = min(entitled, 1.0) if entitled < float("inf") else None
        own = processes[key]
        if not enforcing:
            decisions.extend(_monitor(t, c, state, entitled, busy=bool(own)))
        elif not state.throttled:
            decisions.extend(_start(t, c, state, entitled, own, slack=slack))
        else:
            decisions.append(_steer(t, c, state, entitled, own))
    return decisions


def _smoothed(
    containers: Iterable[ContainerUsage],
    processes: Mapping[ContainerKey, tuple[ProcessSample, ...]],
    kept: dict[ContainerKey, ComputeState],
    t: ControllerTuning,
) -> dict[ContainerKey, ComputeState]:
    """Step 1: each container's state, its utilisation this poll and its smoothed utilisation
    and gain updated (a container seen for the first time starts from this poll's)."""
    states: dict[ContainerKey, ComputeState] = {}
    for c in containers:
        key = (c.allocation_id, c.gpu_uuid)
        u = _util_ratio(processes[key])
        state = kept.get(key)
        if state is None:
            state = kept[key] = ComputeState(u, u)
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
    return states


def _learn_demands(
    states: Mapping[ContainerKey, ComputeState],
    processes: Mapping[ContainerKey, tuple[ProcessSample, ...]],
    *,
    full: bool,
    enforcing: bool,
    t: ControllerTuning,
) -> None:
    """Step 2: each container's demand. `full`: this poll's or the smoothed load reaches
    `saturated_ratio` (both must be under it to learn a demand, so that noise and smoothing
    lag do not pass a full GPU off as one with room). On a full GPU a known demand is
    dropped when the container uses clearly more than it, or when its busiest process runs
    near the level of the busiest unthrottled process: time-slicing is then holding it
    back, and how much it wants cannot be seen."""
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


def _entitlements(
    containers: Iterable[ContainerUsage],
    states: Mapping[ContainerKey, ComputeState],
    *,
    work_conserving: bool,
) -> dict[ContainerKey, float]:
    """Step 3: each container's entitlement, level x share (infinite without a share)."""
    shares = {(c.allocation_id, c.gpu_uuid): c.compute_share_ratio for c in containers}
    if work_conserving:
        level = water_fill_level(shares, {k: s.demand_ratio for k, s in states.items()})
    else:
        level = 1.0
    return {key: level * share if share > 0 else float("inf") for key, share in shares.items()}


def _start(
    t: ControllerTuning,
    c: ContainerUsage,
    state: ComputeState,
    entitled: float,
    own: tuple[ProcessSample, ...],
    *,
    slack: float,
) -> list[Decision]:
    """Step 4 for a container running freely: a throttle episode starts when its smoothed
    utilisation exceeds its entitlement, plus the slack, by the start tolerance."""
    if not own or state.util_ratio <= entitled + slack + t.start_tolerance_ratio:
        return []
    # Unthrottled, this poll's utilisation is the gain itself: start from it.
    state.gain_ratio = max(state.last_ratio, t.idle_ratio)
    target = entitled / state.gain_ratio
    state.duty = min(max(1.0 + t.gain * (target - 1.0), t.duty_min), 1.0)
    if not state.throttled:
        return []
    state.demand_ratio = None
    return [_set_duty(c, state, entitled, own, started=True)]


def _steer(
    t: ControllerTuning,
    c: ContainerUsage,
    state: ComputeState,
    entitled: float,
    own: tuple[ProcessSample, ...],
) -> Decision:
    """Step 4 for a throttled container: its duty moved toward entitlement / gain, or the
    episode ended (no process left, or the target within the release band)."""
    if not own:
        state.duty = 1.0
        return Release(c.allocation_id, c.gpu_uuid, "no GPU processes left")
    target = entitled / max(state.gain_ratio, 1e-6)
    if target >= 1.0 - t.release_band_ratio:
        state.duty = 1.0
        return Release(
            c.allocation_id,
            c.gpu_uuid,
            f"within its entitlement (used={state.util_ratio:.3f} limit={min(entitled, 1.0):.3f})",
        )
    state.duty = min(max(state.duty + t.gain * (target - state.duty), t.duty_min), 1.0)
    return _set_duty(c, state, entitled, own, started=False)


def _set_duty(
    c: ContainerUsage,
    state: ComputeState,
    entitled: float,
    own: tuple[ProcessSample, ...],
    *,
    started: bool,
) -> SetDuty:
    return SetDuty(
        c.allocation_id,
        c.gpu_uuid,
        frozenset(p.pid for p in own),
        state.duty,
        started,
        state.util_ratio,
        entitled,
        c.compute_share_ratio,
    )


def _monitor(
    tuning: ControllerTuning, c: ContainerUsage, state: ComputeState, entitled: float, *, busy: bool
) -> list[Decision]:
    """Compute action `monitor`: one record when a violation begins, none while it lasts."""
    if state.violating:
        if state.util_ratio <= entitled:
            state.violating = False
        return []
    if not busy or state.util_ratio <= entitled + tuning.start_tolerance_ratio:
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
