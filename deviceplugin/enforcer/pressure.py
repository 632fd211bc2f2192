"""Pure: memory reclaimed under pressure (docs/design.md §15, request and limit).

A container may be given a memory *request* below its *limit* (burst): its request is what it
is guaranteed, its limit what it may use while the GPU has memory to spare. A GPU is under
memory pressure when its free memory is below `pressure_free_below_bytes`, or below what its
containers under their request still need to reach it (the guarantee the GPU owes them). Then,
as the kubelet evicts a burstable pod, the container furthest above its request, among those
whose limit is above their request, loses its largest process on the GPU (`Kill` with
`reclaim`: the enforcer stops it through the same safe path as a memory kill, MPS-safe), and
nothing more is taken until that process has left the GPU (or `kill_timeout_s` passed): the GPU
is then looked at again. A container within its request, and one whose request is its limit,
is never reclaimed from. The same rule holds on a GPU whose driver enforces the limits and on
one that is polled. `monitor` records each pressure episode once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deviceplugin.config import EnforcementConfig
from deviceplugin.enforcer.decisions import ContainerKey, Decision
from deviceplugin.enforcer.memory import kill_pending, take_largest
from deviceplugin.model import ContainerUsage, ProcessSample


@dataclass(slots=True)
class PressureState:
    """One GPU's: the processes reclaimed and when, until they leave its process list; and
    whether the current episode was recorded (monitor)."""

    killed: dict[int, float] = field(default_factory=dict)
    recorded: bool = False


def request_of(c: ContainerUsage) -> int:
    return c.memory_limit_bytes if c.memory_request_bytes is None else c.memory_request_bytes


def owed_bytes(containers: list[ContainerUsage]) -> int:
    """What the GPU still owes its containers below their request for each to reach it."""
    return sum(max(0, request_of(c) - c.memory_used_bytes) for c in containers)


def _burst(c: ContainerUsage) -> int:
    """How far a burstable container is above its request (0 within it, or not burstable)."""
    request = request_of(c)
    if request >= c.memory_limit_bytes:
        return 0
    return max(0, c.memory_used_bytes - request)


def decide_pressure(
    gpu: tuple[str, int, int],
    containers: list[ContainerUsage],
    own: dict[ContainerKey, tuple[ProcessSample, ...]],
    now_s: float,
    *,
    state: PressureState,
    config: EnforcementConfig,
    kill_timeout_s: float,
) -> list[Decision]:
    """The pressure rule for one GPU: `gpu` is (UUID, memory total, memory used); `own` each
    container's processes there, the excluded PIDs left out."""
    uuid, total, used = gpu
    listed = {p.pid for processes in own.values() for p in processes}
    if kill_pending(state, listed, now_s, kill_timeout_s):
        return []  # wait for the reclaimed process to go before looking again
    free = max(0, total - used)
    owed = owed_bytes(containers)
    threshold = config.memory.pressure_free_below_bytes
    if free >= threshold and free >= owed:
        state.recorded = False
        return []
    over = [(c, _burst(c)) for c in containers if _burst(c) > 0]
    if not over:
        return []  # no one above its request: nothing is reclaimed from a guaranteed container
    victim_container, burst = max(over, key=lambda item: (item[1], item[0].allocation_id))
    key = (victim_container.allocation_id, victim_container.gpu_uuid)
    reason = (
        f"memory pressure: {free} bytes free on the GPU (reclaim below {threshold}; "
        f"{owed} owed to containers below their request), {burst} bytes above its request"
    )
    return take_largest(
        state,
        own.get(key, ()),
        (victim_container.allocation_id, uuid),
        used=victim_container.memory_used_bytes,
        limit=request_of(victim_container),
        over_for_s=0.0,
        reason=reason,
        now_s=now_s,
        config=config,
        reclaim=True,
    )
