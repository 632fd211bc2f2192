"""The record of every container cgroup the daemon gave a GPU memory limit (docs/design.md
§15): `<state dir>/memory-limits.json`, owner-only, replaced whole (a temporary file renamed over
it, never written through a symbolic link), so that a daemon killed outright finds, at its next
start, each limit it must keep, clear or repair.

    {"version": 1, "boot_id": "<the kernel's boot ID>",
     "leaves": [{"cgroup": "/kubepods.slice/.../cri-containerd-<id>.scope",
                 "pods_root": "/kubepods.slice", "pod_uid": "...", "container_id": "<id>",
                 "grants": [{"id": "<allocation or claim ID>",
                             "gpus": {"GPU-...": {"soft_bytes": 0, "hard_bytes": 8589934592}}}],
                 "applied": {"GPU-...": {"soft_bytes": 0, "hard_bytes": 8589934592,
                                         "mode": "driver-dmem",
                                         "set_at": "2026-12-04T22:23:01.123456Z",
                                         "set_at_s": 1796422981.123456}}}]}

A leaf's `grants` are what each hook asked for; `applied` what the driver was given per GPU (the
sum of the grants there). An applied limit is written *before* the driver is called, with
`set_at` null, and again with the time once the call returned: a limit the driver may hold is
never missing from the record. A record of another boot is void (the cgroups and the driver's
limits went with it). Read entry by entry: an entry that is not valid is skipped and logged; an
unreadable file is moved aside and the daemon starts with an empty record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deviceplugin import statefiles
from deviceplugin.partitions import GpuLimit, PartitionMode, rfc3339
from deviceplugin.statefiles import boot_id

log = logging.getLogger(__name__)

RECORD_NAME = "memory-limits.json"
# A record of this size holds thousands of containers; anything larger is not one of ours.
MAX_RECORD_BYTES = 8 << 20
VERSION = 1
_MAX_RECORD_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class GrantLimits:
    """What one grant (an allocation or claim ID, as its hook named it) holds per GPU."""

    grant_id: str
    gpus: tuple[tuple[str, GpuLimit], ...]


@dataclass(frozen=True, slots=True)
class AppliedLimit:
    """What the driver was given on one GPU for a leaf; `set_at_s` None while being set."""

    gpu_uuid: str
    limit: GpuLimit
    mode: PartitionMode
    set_at_s: float | None


@dataclass(frozen=True, slots=True)
class LeafRecord:
    """A container's own cgroup with the limits the daemon gave it."""

    cgroup: str
    pods_root: str
    pod_uid: str
    container_id: str
    grants: tuple[GrantLimits, ...] = ()
    applied: tuple[AppliedLimit, ...] = ()

    def totals(self) -> dict[str, GpuLimit]:
        """Per GPU, the sum of the grants' limits there."""
        found: dict[str, GpuLimit] = {}
        for grant in self.grants:
            for uuid, limit in grant.gpus:
                found[uuid] = found[uuid] + limit if uuid in found else limit
        return found

    def with_grant(self, grant: GrantLimits) -> LeafRecord:
        others = tuple(g for g in self.grants if g.grant_id != grant.grant_id)
        return replace(self, grants=(*others, grant))

    def with_applied(self, applied: AppliedLimit) -> LeafRecord:
        others = tuple(a for a in self.applied if a.gpu_uuid != applied.gpu_uuid)
        return replace(self, applied=tuple(sorted((*others, applied), key=lambda a: a.gpu_uuid)))

    def applied_on(self, gpu_uuid: str) -> AppliedLimit | None:
        return next((a for a in self.applied if a.gpu_uuid == gpu_uuid), None)


def _limit_json(limit: GpuLimit) -> dict[str, int]:
    return {"soft_bytes": limit.soft_bytes, "hard_bytes": limit.hard_bytes}


def leaf_to_json(leaf: LeafRecord) -> dict[str, Any]:
    return {
        "cgroup": leaf.cgroup,
        "pods_root": leaf.pods_root,
        "pod_uid": leaf.pod_uid,
        "container_id": leaf.container_id,
        "grants": [
            {"id": g.grant_id, "gpus": {uuid: _limit_json(limit) for uuid, limit in g.gpus}}
            for g in leaf.grants
        ],
        "applied": {
            a.gpu_uuid: {
                **_limit_json(a.limit),
                "mode": a.mode.value,
                "set_at": None if a.set_at_s is None else rfc3339(a.set_at_s),
                "set_at_s": a.set_at_s,
            }
            for a in leaf.applied
        },
    }


def _limit(data: Any) -> GpuLimit:
    soft, hard = data["soft_bytes"], data["hard_bytes"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (soft, hard)):
        raise ValueError("limits are not integers")
    return GpuLimit(soft, hard)


def _plain_under(cgroup: object, top: object) -> bool:
    if not isinstance(cgroup, str) or not isinstance(top, str) or not top.startswith("/"):
        return False
    parts = cgroup.split("/")
    plain = cgroup.startswith("/") and all(p not in ("", ".", "..") for p in parts[1:])
    return plain and cgroup.startswith(top + "/")


def leaf_from_json(data: Any) -> LeafRecord:
    """One leaf of the record; ValueError (or KeyError, TypeError) when it is not one."""
    cgroup, top = data["cgroup"], data["pods_root"]
    if not _plain_under(cgroup, top):
        raise ValueError(f"cgroup {cgroup!r} is not a plain path under {top!r}")
    grants = tuple(
        GrantLimits(str(g["id"]), tuple(sorted((str(u), _limit(v)) for u, v in g["gpus"].items())))
        for g in data["grants"]
    )
    applied: list[AppliedLimit] = []
    for uuid, a in data["applied"].items():
        set_at = a.get("set_at_s")
        if set_at is not None and not isinstance(set_at, int | float):
            raise ValueError("set_at_s is not a number")
        applied.append(AppliedLimit(str(uuid), _limit(a), PartitionMode(a["mode"]), set_at))
    return LeafRecord(
        cgroup, top, str(data["pod_uid"]), str(data["container_id"]), grants, tuple(applied)
    )


class LimitRecord:
    """The leaves by cgroup, mirrored to `<state_dir>/memory-limits.json` by `save`."""

    def __init__(
        self,
        state_dir: Path,
        *,
        boot: Callable[[], str] = boot_id,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = state_dir
        self._boot = boot
        self._wall_clock = wall_clock
        self._leaves: dict[str, LeafRecord] = {}

    @property
    def path(self) -> Path:
        return self.state_dir / RECORD_NAME

    def load(self) -> None:
        """Read the record left by an earlier daemon of this boot (see the module docstring)."""
        try:
            raw = statefiles.read_file(self.state_dir, RECORD_NAME, MAX_RECORD_BYTES)
        except OSError as e:
            log.error("memory-limit record unreadable path=%s error=%s", self.path, e)
            return
        if raw is None:
            return
        try:
            if len(raw) > _MAX_RECORD_BYTES:
                raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError(f"expected an object with version {VERSION}")
            entries = doc["leaves"]
            if not isinstance(entries, list):
                raise ValueError("leaves is not a list")
        except (ValueError, KeyError, RecursionError) as e:
            self._move_aside(str(e))
            return
        if doc.get("boot_id") != self._boot():
            log.info(
                "memory-limit record is of an earlier boot: its cgroups and limits are gone "
                "path=%s leaves=%d",
                self.path,
                len(entries),
            )
            self.save()
            return
        for entry in entries:
            try:
                leaf = leaf_from_json(entry)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                log.error("memory-limit record entry skipped error=%r entry=%.200r", e, entry)
                continue
            self._leaves[leaf.cgroup] = leaf
        log.info("memory-limit record read path=%s leaves=%d", self.path, len(self._leaves))

    def _move_aside(self, why: str) -> None:
        try:
            aside = statefiles.move_aside(
                self.state_dir, RECORD_NAME, f"unreadable-{int(self._wall_clock())}"
            )
        except OSError as e:
            log.error("memory-limit record unreadable path=%s error=%s; %s", self.path, why, e)
            return
        log.error(
            "memory-limit record unreadable, moved aside; starting with none path=%s error=%s "
            "moved_to=%s",
            self.path,
            why,
            aside,
        )

    def save(self) -> None:
        doc = {
            "version": VERSION,
            "boot_id": self._boot(),
            "leaves": [leaf_to_json(leaf) for _, leaf in sorted(self._leaves.items())],
        }
        # Atomic, not synced: the record is void after a reboot, and a daemon's death does not
        # take the page cache with it. Compact: it is rewritten at every container start.
        content = json.dumps(doc, separators=(",", ":")).encode()
        statefiles.write_file(self.state_dir, RECORD_NAME, content, sync=False)

    def get(self, cgroup: str) -> LeafRecord | None:
        return self._leaves.get(cgroup)

    def put(self, leaf: LeafRecord) -> None:
        self._leaves[leaf.cgroup] = leaf

    def remove(self, cgroup: str) -> None:
        self._leaves.pop(cgroup, None)

    def __iter__(self) -> Iterator[LeafRecord]:
        return iter(list(self._leaves.values()))

    def __len__(self) -> int:
        return len(self._leaves)

    def soft_below(self, cgroup: str, gpu_uuid: str) -> int:
        """The soft limits the record holds on `gpu_uuid` for leaves under `cgroup`."""
        total = 0
        for leaf in self._leaves.values():
            applied = leaf.applied_on(gpu_uuid)
            if applied is not None and leaf.cgroup.startswith(cgroup + "/"):
                total += applied.limit.soft_bytes
        return total

    def totals(self) -> Mapping[str, Mapping[str, GpuLimit]]:
        return {c: leaf.totals() for c, leaf in self._leaves.items()}
