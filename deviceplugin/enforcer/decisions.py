"""Pure: the decisions the enforcement policy hands the enforcer, and the compute controller's
tuning."""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.config import EnforcementConfig

ContainerKey = tuple[str, str]  # (allocation ID, GPU UUID)

MEMORY = "memory"
COMPUTE = "compute"
KILL = "kill"
RECLAIM = "reclaim"
THROTTLE = "throttle"
MONITOR = "monitor"


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL `pid`, the container's largest process on the GPU (memory action `kill`); with
    `reclaim`, memory taken back under pressure from a container above its request
    (`limit_bytes` is then its request, enforcer.pressure)."""

    allocation_id: str
    gpu_uuid: str
    pid: int
    used_bytes: int
    limit_bytes: int
    process_used_bytes: int
    over_for_s: float
    reason: str
    reclaim: bool = False


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
