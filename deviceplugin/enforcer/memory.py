"""Pure: the memory rule of the enforcement policy.

Memory (docs/design.md §4). A container's memory on a GPU above its limit for `grace_period_s` is a
violation. `kill`: the largest of its processes on that GPU is killed, then nothing more until that
process has left the GPU's process list (or `kill_timeout_s` passed, after which its memory counts
as freed), and the container is checked again. `monitor`: one record per violation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    for pid in [pid for pid in state.killed if pid not in listed]:
        del state.killed[pid]  # gone from the GPU: its memory is free
    if any(now_s - t < kill_timeout_s for t in state.killed.values()):
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
    candidates = [p for p in processes if p.pid not in state.killed]
    victim = max(candidates, key=lambda p: (p.used_memory_bytes or 0, p.pid), default=None)
    reason = f"over the memory limit for {over_for_s:.1f}s"
    if config.memory.action is MemoryAction.MONITOR:
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
