"""The fake GPUs' memory partitions: the limits their driver holds, kept where tests and the
demo can read them (docs/design.md §8, §15).

Per GPU with a store (`memory_partitions` in the state file) one `PartitionRules` applies the
driver's rules; what it holds is written, after every change, to a JSON file beside the state
file (`<state file>.memory-limits.json` by default), atomically:

    {"version": 1,
     "gpus": {"GPU-...": {"store": "dmem",
                          "limits": {"/kubepods/pod.../<id>": {"soft_bytes": 0,
                                     "hard_bytes": 8589934592,
                                     "set_at": "2026-12-04T22:23:01.123456Z",
                                     "set_at_s": 1796422981.123456}}}},
     "events": [{"at": "...Z", "at_s": ..., "gpu": "GPU-...", "cgroup": "...",
                 "action": "set|clear|removed", "soft_bytes": ..., "hard_bytes": ...},
                {"at": ..., "gpu": ..., "cgroup": ..., "action": "refused", "pid": ...,
                 "asked_bytes": ..., "granted_bytes": ...}]}

`limits` lists every cgroup with anything set (on dmem, the ancestors carrying leaves' soft
shares too); `events` the last 1000 changes, oldest first, and each allocation the driver cut
short at a hard limit (`refused`: a process asked for more than its cgroup may have,
`charging`). The file is read back when the backend starts, as the driver would still hold the
limits when the daemon restarts, so that a restarted
daemon finds what one killed outright left behind. A cgroup that is gone is dropped (on dmem its
ancestors keep their share: the leak) when the next call, or `forget_removed`, notices.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from deviceplugin.gpu.fake.partitionrules import (
    STORES,
    CgroupTree,
    Limit,
    PartitionRules,
    Store,
)
from deviceplugin.partitions import LIMIT_MAX, rfc3339
from deviceplugin.statefiles import write_file

logger = logging.getLogger(__name__)

VERSION = 1
MAX_EVENTS = 1000
_MAX_FILE_BYTES = 16 << 20


def default_path(state_file: Path) -> Path:
    return state_file.with_name(state_file.name + ".memory-limits.json")


class FakePartitions:
    """The partitions of the fake GPUs, by UUID; thread-safe."""

    def __init__(self, path: Path, tree: CgroupTree, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self.tree = tree
        self.clock = clock
        self._lock = threading.Lock()
        self._rules: dict[str, PartitionRules] = {}
        self._saved_limits, self._events = self._load()
        # Moves with every change of the limits (and of a refusal): what was charged before
        # still holds while it stands still.
        self.generation = 0
        # Per (GPU, PID) the memory it asked for that the driver refused last (logged once).
        self._refused: dict[tuple[str, int], int] = {}

    def _load(self) -> tuple[dict[str, tuple[Store, dict[str, Limit]]], list[dict[str, Any]]]:
        try:
            with self.path.open("rb") as f:
                raw = f.read(_MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}, []
        except OSError as e:
            logger.error("fake memory limits unreadable path=%s error=%s", self.path, e)
            return {}, []
        try:
            doc = json.loads(raw)
            gpus = doc["gpus"]
            saved: dict[str, tuple[Store, dict[str, Limit]]] = {}
            for uuid, entry in gpus.items():
                store = entry["store"]
                if store not in STORES:
                    raise ValueError(f"store {store!r}")
                limits = {
                    str(cgroup): Limit(
                        int(v["soft_bytes"]), int(v["hard_bytes"]), float(v["set_at_s"])
                    )
                    for cgroup, v in entry["limits"].items()
                }
                saved[str(uuid)] = (store, limits)
            events = [e for e in doc.get("events", []) if isinstance(e, dict)]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            logger.error(
                "fake memory limits unreadable, starting with none path=%s error=%r", self.path, e
            )
            return {}, []
        return saved, events[-MAX_EVENTS:]

    def sync(self, gpus: Iterable[tuple[str, Store | None, int]]) -> None:
        """Follow the state file: (UUID, store or None, memory) per GPU. A GPU keeps its limits
        while its store stays; one that changes store starts with none."""
        with self._lock:
            wanted = {uuid: (store, capacity) for uuid, store, capacity in gpus if store}
            for uuid in [u for u, r in self._rules.items() if wanted.get(u, ("",))[0] != r.store]:
                del self._rules[uuid]
            for uuid, (store, capacity) in wanted.items():
                assert store is not None
                if uuid in self._rules:
                    self._rules[uuid].capacity_bytes = capacity
                    continue
                saved_store, limits = self._saved_limits.pop(uuid, (store, {}))
                if saved_store != store:
                    limits = {}
                self._rules[uuid] = PartitionRules(
                    store, self.tree, capacity, self.clock, limits=limits
                )
            self._forget_removed_locked()

    def rules(self, uuid: str) -> PartitionRules | None:
        return self._rules.get(uuid)

    def set(self, uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int) -> None:
        """Set (or, with 0 and MAX, clear) a cgroup's limits; PartitionCodeError as the driver
        refuses. KeyError for a GPU with no store."""
        with self._lock:
            self._forget_removed_locked()
            rules = self._rules[uuid]
            rules.set(cgroup, soft_bytes, hard_bytes)
            cleared = soft_bytes == 0 and hard_bytes == LIMIT_MAX
            action = "clear" if cleared else "set"
            self._event(uuid, cgroup, action, soft_bytes=soft_bytes, hard_bytes=hard_bytes)
            self.generation += 1
            self._save()

    def allocate(self, uuid: str, asked: list[tuple[int, str, int]]) -> dict[int, int] | None:
        """The processes of a GPU with a store, each (PID, cgroup, memory it asks for), charged
        in that order as the driver charges allocations: per PID what it got, the hard limits
        (and the GPU's memory) bounding it; an ask cut short is the driver's out-of-memory,
        recorded once as a `refused` event. None for a GPU with no store (nothing bounds it)."""
        with self._lock:
            rules = self._rules.get(uuid)
            if rules is None:
                return None
            self._forget_removed_locked()
            rules.usage.clear()
            granted: dict[int, int] = {}
            for pid, cgroup, nbytes in asked:
                got = min(nbytes, rules.headroom(cgroup))
                rules.charge(cgroup, got)
                granted[pid] = got
                if got < nbytes and self._refused.get((uuid, pid)) != nbytes:
                    self._refused[(uuid, pid)] = nbytes
                    self._refusal(uuid, cgroup, pid, nbytes, got)
                elif got == nbytes:
                    self._refused.pop((uuid, pid), None)
            return granted

    def _refusal(self, uuid: str, cgroup: str, pid: int, asked: int, got: int) -> None:
        self._event(uuid, cgroup, "refused", pid=pid, asked_bytes=asked, granted_bytes=got)
        self.generation += 1
        self._save()

    def get(self, uuid: str, cgroup: str) -> tuple[int, int, int]:
        with self._lock:
            self._forget_removed_locked()
            return self._rules[uuid].get(cgroup)

    def forget_removed(self) -> None:
        with self._lock:
            self._forget_removed_locked()

    def _forget_removed_locked(self) -> None:
        changed = False
        for uuid, rules in self._rules.items():
            for cgroup, limit in rules.forget_removed():
                soft, hard = limit.soft_bytes, limit.hard_bytes
                self._event(uuid, cgroup, "removed", soft_bytes=soft, hard_bytes=hard)
                changed = True
        if changed:
            self.generation += 1
            self._save()

    def _event(self, uuid: str, cgroup: str, action: str, **figures: int) -> None:
        """One event of the fake driver's file (`figures`: the limits set, or what a refused
        allocation asked and got), the newest MAX_EVENTS kept."""
        now = self.clock()
        self._events.append(
            {"at": rfc3339(now), "at_s": now, "gpu": uuid, "cgroup": cgroup, "action": action}
            | figures
        )
        del self._events[:-MAX_EVENTS]

    def to_json(self) -> dict[str, Any]:
        gpus = {
            uuid: {"store": rules.store, "limits": _limits_json(rules.limits)}
            for uuid, rules in sorted(self._rules.items())
        }
        # GPUs that left the state file keep their limits in the file until they come back.
        for uuid, (store, limits) in self._saved_limits.items():
            gpus.setdefault(uuid, {"store": store, "limits": _limits_json(limits)})
        return {"version": VERSION, "gpus": gpus, "events": list(self._events)}

    def _save(self) -> None:
        content = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")) + "\n"
        # Atomic, not durable: the limits a driver holds do not outlive the machine either.
        write_file(self.path.parent, self.path.name, content.encode(), sync=False, create=False)


def _limits_json(limits: dict[str, Limit]) -> dict[str, Any]:
    return {
        cgroup: {
            "soft_bytes": limit.soft_bytes,
            "hard_bytes": limit.hard_bytes,
            "set_at": rfc3339(limit.set_at_s),
            "set_at_s": limit.set_at_s,
        }
        for cgroup, limit in sorted(limits.items())
    }


def read_partitions(path: Path) -> dict[str, Any]:
    """The fake's memory-limit file as JSON data (for tests and the demo); {} when absent."""
    try:
        data: dict[str, Any] = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    return data
