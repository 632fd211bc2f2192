"""What the enforcer did, per container: every action logged (at WARNING, with the container's
names, the figures and the outcome) and counted for `vgpu_enforcement_actions_total`."""

from __future__ import annotations

import logging

from deviceplugin.enforcer.control import SignalResult
from deviceplugin.enforcer.decisions import (
    COMPUTE,
    KILL,
    MEMORY,
    RECLAIM,
    THROTTLE,
    ContainerKey,
    Kill,
    Record,
    Release,
    SetDuty,
)
from deviceplugin.model import EnforcementCount, NodeSnapshot

# The enforcer's logger: its lines keep the name operators filter on.
log = logging.getLogger("deviceplugin.enforcer.enforcer")

_KILL_OUTCOME = {
    SignalResult.SENT: "true",
    SignalResult.GONE: "false (process gone)",
    SignalResult.DENIED: "false (permission denied)",
    SignalResult.MOVED: "false (moved to another cgroup since it was attributed)",
}

_Names = tuple[str, str, str, int]  # namespace, pod, container, GPU index
# A dry run's kill: decided and counted, never sent.
_DRY_OUTCOME = "false (dry run: would kill)"


def would(action: str) -> str:
    """What a dry run (monitor mode) counts and logs for `action`: would_kill, would_throttle."""
    return f"would_{action}"


class ActionLog:
    """The counts and log lines of the enforcer's actions, and the names of the containers they
    concern (remembered from snapshots, so that a line about a container gone from the latest
    one still names it). Not locked: the enforcer holds its lock around every call."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str, str], int] = {}
        self._names: dict[ContainerKey, _Names] = {}
        self._names_from: tuple[object, ...] = ()

    def killed(self, d: Kill, result: SignalResult, dry: bool) -> None:
        """A SIGKILL for a memory violation, and what became of it; in a dry run (monitor mode
        too) the kill it would have sent, counted as would_kill."""
        key = (d.allocation_id, d.gpu_uuid)
        kind = RECLAIM if d.reclaim else KILL
        action = would(kind) if dry else kind
        self.count(key, MEMORY, action)
        ns, pod, container, index = self.names_of(key)
        log.warning(
            "%s action=%s namespace=%s pod=%s container=%s "
            "allocation=%s gpu=%s gpu_index=%d pid=%d used_bytes=%d %s=%d "
            "process_used_bytes=%d over_for_s=%.2f sent=%s dry_run=%s reason=%r",
            "memory reclaimed under pressure" if d.reclaim else "memory limit exceeded",
            action,
            ns,
            pod,
            container,
            d.allocation_id,
            d.gpu_uuid,
            index,
            d.pid,
            d.used_bytes,
            "request_bytes" if d.reclaim else "limit_bytes",
            d.limit_bytes,
            d.process_used_bytes,
            d.over_for_s,
            _DRY_OUTCOME if dry else _KILL_OUTCOME[result],
            dry,
            d.reason,
        )

    def throttled(self, d: SetDuty, dry: bool) -> None:
        """A duty cycle set (counted when it starts an episode); in a dry run the one it would
        have set, counted as would_throttle."""
        key = (d.allocation_id, d.gpu_uuid)
        action = would(THROTTLE) if dry else THROTTLE
        if d.started:
            self.count(key, COMPUTE, action)
        ns, pod, container, index = self.names_of(key)
        log.log(
            logging.WARNING if d.started else logging.DEBUG,
            "compute share %s action=%s namespace=%s pod=%s container=%s "
            "allocation=%s gpu=%s gpu_index=%d pid=%s used_ratio=%.3f limit_ratio=%.3f "
            "share_ratio=%.3f duty=%.3f dry_run=%s",
            "exceeded" if d.started else "throttled",
            action,
            ns,
            pod,
            container,
            d.allocation_id,
            d.gpu_uuid,
            index,
            ",".join(str(p) for p in sorted(d.pids)),
            d.used_ratio,
            d.limit_ratio,
            d.share_ratio,
            d.duty,
            dry,
        )

    def released(self, d: Release, stopped_s: float, dry: bool) -> None:
        """A throttle episode ended; `stopped_s`: the container's time stopped in all."""
        key = (d.allocation_id, d.gpu_uuid)
        ns, pod, container, index = self.names_of(key)
        log.warning(
            "compute throttle released action=%s namespace=%s pod=%s container=%s "
            "allocation=%s gpu=%s gpu_index=%d throttled_s=%.2f reason=%r dry_run=%s",
            would("resume") if dry else "resume",
            ns,
            pod,
            container,
            d.allocation_id,
            d.gpu_uuid,
            index,
            stopped_s,
            d.reason,
            dry,
        )

    def recorded(self, d: Record) -> None:
        """A violation recorded without acting on it (action `monitor`)."""
        key = (d.allocation_id, d.gpu_uuid)
        self.count(key, d.kind, d.action)
        ns, pod, container, index = self.names_of(key)
        if d.kind == MEMORY:
            log.warning(
                "memory limit exceeded action=monitor namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=%s used_bytes=%d limit_bytes=%d reason=%r",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                d.pid if d.pid is not None else "-",
                int(d.used),
                int(d.limit),
                d.reason,
            )
        else:
            log.warning(
                "compute share exceeded action=monitor namespace=%s pod=%s container=%s "
                "allocation=%s gpu=%s gpu_index=%d pid=- used_ratio=%.3f limit_ratio=%.3f "
                "reason=%r",
                ns,
                pod,
                container,
                d.allocation_id,
                d.gpu_uuid,
                index,
                d.used,
                min(d.limit, 1.0),
                d.reason,
            )

    def count(self, key: ContainerKey, kind: str, action: str) -> None:
        index = (key[0], key[1], kind, action)
        self._counts[index] = self._counts.get(index, 0) + 1

    def remember(self, snapshot: NodeSnapshot) -> None:
        if snapshot.containers == self._names_from:
            return  # the same containers as last time: nothing new to remember
        self._names_from = snapshot.containers
        for c in snapshot.containers:
            self._names[(c.allocation_id, c.gpu_uuid)] = (
                c.namespace,
                c.pod,
                c.container,
                c.gpu_index,
            )

    def names_of(self, key: ContainerKey) -> _Names:
        return self._names.get(key, ("", "", "", -1))

    def forget(self, live: set[str]) -> list[ContainerKey]:
        """Drop the counts and names of containers whose allocation is not in `live`; the
        containers whose names were dropped."""
        for index in [i for i in self._counts if i[0] not in live]:
            del self._counts[index]
        gone = [k for k in self._names if k[0] not in live]
        for key in gone:
            del self._names[key]
        return gone

    def counts(self) -> tuple[EnforcementCount, ...]:
        """Every enforcement count so far, for containers whose allocation still exists."""
        items = sorted(self._counts.items())
        result: list[EnforcementCount] = []
        for (allocation, gpu, kind, action), count in items:
            ns, pod, container, _ = self.names_of((allocation, gpu))
            result.append(
                EnforcementCount(allocation, gpu, kind, action, count, ns, pod, container)
            )
        return tuple(result)
