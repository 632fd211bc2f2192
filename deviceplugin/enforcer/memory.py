"""Pure: the memory rule of the enforcement policy.

Memory (docs/design.md §4). A container's memory on a GPU above its limit for `grace_period_s` is a
violation. `kill`: the largest of its processes on that GPU is killed, then nothing more until that
process has left the GPU's process list (or `kill_timeout_s` passed, after which its memory counts
as freed), and the container is checked again. `monitor`: one record per violation.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from deviceplugin.config import EnforcementConfig, MemoryAction
from deviceplugin.enforcer.decisions import (
    MEMORY,
    MONITOR,
    ContainerKey,
    Decision,
    Kill,
    Record,
)
from deviceplugin.model import ContainerUsage, ProcessSample

_POLL_JITTER_RATIO = 0.1


@dataclass(slots=True)
class MemoryState:
    over_since_s: float | None = None
    recorded: bool = False
    # PIDs killed and the time of the kill, until they leave the GPU's process list.
    killed: dict[int, float] = field(default_factory=dict)


def decide_memory(
    c: ContainerUsage,
    processes: tuple[ProcessSample, ...],
    now_s: float,
    *,
    states: dict[ContainerKey, MemoryState],
    config: EnforcementConfig,
    kill_timeout_s: float,
) -> list[Decision]:
    """The memory rule for one container on one GPU (`processes`: its processes there, the
    excluded PIDs left out); `states` holds each container's state between snapshots."""
    key = (c.allocation_id, c.gpu_uuid)
    state = states.get(key)
    if state is None:
        state = states[key] = MemoryState()
    limit = c.memory_limit_bytes
    if not state.killed and (limit <= 0 or c.memory_used_bytes <= limit):
        # Within its limit with no kill pending (what nearly every container is, every
        # poll): the general case below, without building what it needs for kills.
        state.over_since_s = None
        state.recorded = False
        return []
    listed = {p.pid: p for p in processes}
    if kill_pending(state, listed, now_s, kill_timeout_s):
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
    if over_for_s + _POLL_JITTER_RATIO * config.poll_interval_s < (config.memory.grace_period_s):
        return []
    reason = f"over the memory limit for {over_for_s:.1f}s"
    return take_largest(
        state,
        processes,
        key,
        used=used,
        limit=limit,
        over_for_s=over_for_s,
        reason=reason,
        now_s=now_s,
        config=config,
    )


class TakenState(Protocol):
    """What a rule that kills a container's largest process keeps between snapshots."""

    killed: dict[int, float]
    recorded: bool


def kill_pending(
    state: TakenState, listed: Container[int], now_s: float, kill_timeout_s: float
) -> bool:
    """Forget the killed processes gone from the GPU (their memory is free); whether one is
    still there and within `kill_timeout_s` of its kill (nothing more is taken meanwhile)."""
    for pid in [pid for pid in state.killed if pid not in listed]:
        del state.killed[pid]
    return any(now_s - t < kill_timeout_s for t in state.killed.values())


def take_largest(
    state: TakenState,
    processes: Iterable[ProcessSample],
    key: ContainerKey,
    *,
    used: int,
    limit: int,
    over_for_s: float,
    reason: str,
    now_s: float,
    config: EnforcementConfig,
    reclaim: bool = False,
) -> list[Decision]:
    """Kill the container's largest process not already killed (`key`: the container on the
    GPU; `used`: its bytes there, `limit` what they are held to: its limit, or its request), or
    with `monitor` record the episode once."""
    candidates = [p for p in processes if p.pid not in state.killed]
    victim = max(candidates, key=lambda p: (p.used_memory_bytes or 0, p.pid), default=None)
    if config.memory.action is MemoryAction.MONITOR:
        if state.recorded:
            return []
        state.recorded = True
        pid = victim.pid if victim is not None else None
        return [Record(MEMORY, MONITOR, key[0], key[1], pid, float(used), float(limit), reason)]
    if victim is None:
        return []
    state.killed[victim.pid] = now_s
    process_used = victim.used_memory_bytes or 0
    return [
        Kill(key[0], key[1], victim.pid, used, limit, process_used, over_for_s, reason, reclaim)
    ]
