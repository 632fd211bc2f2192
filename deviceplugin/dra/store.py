"""The prepared claims, checkpointed in the state directory (`dra-claims.json`).

Written before Prepare answers and after Unprepare has removed the CDI spec, so that a daemon
killed at any point finds, at its next start, every claim the kubelet believes prepared: Prepare
of a claim already here returns what it returned before, and Unprepare of one no longer here
succeeds (both are idempotent, as the kubelet retries either).

The file is read as the kubelet's checkpoint is (`safefs.read_bounded`): never through a
symbolic link, never blocking on a FIFO, a regular file of at most `MAX_CHECKPOINT_BYTES`. Its
content is checked value by value: names and UIDs as the driver checks a claim reference
(`refs`), every number a finite one within its range (memory within its device's, compute
within 100). A file that cannot be read or fails a check is moved aside as
`dra-claims.json.unreadable-<time>`, never overwritten, and logged (the file, why, where it
went); the daemon starts without those claims, and the driver's reconcile takes back, from
their CDI specs, those the API server still has (see `prepare`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from deviceplugin import statefiles
from deviceplugin.dra.claims import ClaimDevice, PreparedClaim
from deviceplugin.dra.refs import ref_problem, shown

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "dra-claims.json"
VERSION = 1
# A checkpoint larger than this is not read: a claim takes half a kilobyte (110 pods with a few
# claims each stay under 1 MiB).
MAX_CHECKPOINT_BYTES = 8 << 20
MAX_GPU_INDEX = 1 << 16
MAX_MINOR = 1 << 20
MAX_MEMORY_BYTES = 1 << 50
MAX_TEXT = 256


class ClaimStore:
    """The prepared claims by UID, mirrored to the checkpoint on every change."""

    def __init__(self, state_dir: Path, wall_clock: Callable[[], float] = time.time) -> None:
        self._dir = state_dir
        self._wall_clock = wall_clock
        self._claims: dict[str, PreparedClaim] = {}
        # Where `load` moved an unusable checkpoint, if it did.
        self.moved_aside: Path | None = None

    @property
    def path(self) -> Path:
        return self._dir / CHECKPOINT_FILE

    def load(self) -> None:
        """Read the checkpoint. One that cannot be read, or whose content fails a check, is
        moved aside and logged, and no claim is recovered; OSError only when it cannot even be
        moved aside (it would be replaced at the first change)."""
        try:
            raw = statefiles.read_file(self._dir, CHECKPOINT_FILE, MAX_CHECKPOINT_BYTES)
            if raw is None:
                return
            claims = parse_checkpoint(raw)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self._move_aside(why)
            return
        self._claims = {c.uid: c for c in claims}
        log.info("prepared claims recovered from the checkpoint claims=%d", len(self._claims))

    def _move_aside(self, why: str) -> None:
        try:
            aside = statefiles.move_aside(
                self._dir, CHECKPOINT_FILE, f"unreadable-{int(self._wall_clock())}"
            )
        except OSError as e:
            raise OSError(
                f"the DRA checkpoint {self.path} is unusable ({why}) and cannot be moved aside: "
                f"{e.strerror or e}; move it away to start with no prepared claim"
            ) from None
        self.moved_aside = self._dir / aside
        log.error(
            "the DRA checkpoint is unusable and was moved aside; starting with no prepared claim "
            "until the reconcile takes back, from their CDI specs, the claims the API server "
            "still has path=%s problem=%s moved_to=%s",
            self.path,
            why,
            self.moved_aside,
        )

    def _save(self) -> None:
        doc = {"version": VERSION, "claims": claims_to_json(list(self._claims.values()))}
        statefiles.write_file(self._dir, CHECKPOINT_FILE, json.dumps(doc, sort_keys=True).encode())

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def put(self, claim: PreparedClaim) -> None:
        self._claims[claim.uid] = claim
        self._save()

    def remove(self, uid: str) -> bool:
        if self._claims.pop(uid, None) is None:
            return False
        self._save()
        return True

    def __iter__(self) -> Iterator[PreparedClaim]:
        return iter(list(self._claims.values()))

    def __len__(self) -> int:
        return len(self._claims)


def parse_checkpoint(raw: bytes) -> list[PreparedClaim]:
    """The claims of a checkpoint file's content; ValueError naming the first problem."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"not JSON: {shown(str(e))}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"expected an object with version {VERSION}")
    return claims_from_json(doc.get("claims"))


def claims_to_json(claims: Sequence[PreparedClaim]) -> list[dict[str, Any]]:
    return [
        {
            "uid": c.uid,
            "namespace": c.namespace,
            "name": c.name,
            "pods": [list(p) for p in c.pods],
            "cdi_ids": list(c.cdi_ids),
            "prepared_at_s": c.prepared_at_s,
            "devices": [
                {
                    "request": d.request,
                    "device": d.device,
                    "gpu_uuid": d.gpu_uuid,
                    "gpu_index": d.gpu_index,
                    "minor": d.minor,
                    "memory_total_bytes": d.memory_total_bytes,
                    "memory_bytes": d.memory_bytes,
                    "memory_limit_bytes": d.memory_limit_bytes,
                    "compute_percent": d.compute_percent,
                    "share_id": d.share_id,
                }
                for d in c.devices
            ],
        }
        for c in claims
    ]


def claims_from_json(data: object) -> list[PreparedClaim]:
    """The checkpoint's claims, every value checked; ValueError naming the first bad one."""
    if not isinstance(data, list):
        raise ValueError("claims is not a list")
    return [_claim(item, f"claims[{i}]") for i, item in enumerate(data)]


def _claim(item: object, where: str) -> PreparedClaim:
    if not isinstance(item, dict):
        raise ValueError(f"{where} is not an object")
    uid, namespace, name = (_text(item, k, where) for k in ("uid", "namespace", "name"))
    problem = ref_problem(namespace, name, uid)
    if problem:
        raise ValueError(f"{where}: {problem}")
    pods = _list(item, "pods", where, required=False)
    for i, pod in enumerate(pods):
        if not (isinstance(pod, list) and len(pod) == 2 and all(_short(p) for p in pod)):
            raise ValueError(f"{where}.pods[{i}] is not a [name, uid] pair")
    cdi_ids = _list(item, "cdi_ids", where, required=False)
    if not all(_short(i) for i in cdi_ids):
        raise ValueError(f"{where}.cdi_ids holds something other than CDI device names")
    devices = _list(item, "devices", where)
    if not devices:
        raise ValueError(f"{where}.devices is empty")
    return PreparedClaim(
        uid=uid,
        namespace=namespace,
        name=name,
        pods=tuple((p[0], p[1]) for p in pods),
        cdi_ids=tuple(cdi_ids),
        prepared_at_s=_number(item, "prepared_at_s", where, low=0.0, high=math.inf, default=0.0),
        devices=tuple(_device(d, f"{where}.devices[{i}]") for i, d in enumerate(devices)),
    )


def _device(d: object, where: str) -> ClaimDevice:
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not an object")
    total = _integer(d, "memory_total_bytes", where, 1, MAX_MEMORY_BYTES)
    memory = _integer(d, "memory_bytes", where, 0, total)
    # None (and in a checkpoint of a daemon before memory limits): the memory consumed.
    limit = None
    if d.get("memory_limit_bytes") is not None:
        limit = _integer(d, "memory_limit_bytes", where, memory, total)
    return ClaimDevice(
        request=_text(d, "request", where),
        device=_text(d, "device", where),
        gpu_uuid=_text(d, "gpu_uuid", where),
        gpu_index=_integer(d, "gpu_index", where, 0, MAX_GPU_INDEX),
        minor=_integer(d, "minor", where, 0, MAX_MINOR),
        memory_total_bytes=total,
        memory_bytes=memory,
        compute_percent=_number(d, "compute_percent", where, low=0.0, high=100.0),
        share_id=_text(d, "share_id", where, default=""),
        memory_limit_bytes=limit,
    )


def _short(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT


def _text(obj: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not _short(value):
        raise ValueError(f"{where}.{key} is {shown(value)}, not a string of at most {MAX_TEXT}")
    return str(value)


def _list(obj: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> list[Any]:
    value = obj.get(key) if required else obj.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{where}.{key} is {shown(value)}, not a list")
    return value


def _integer(obj: Mapping[str, Any], key: str, where: str, low: int, high: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{where}.{key} is {shown(value)}, not an integer from {low} to {high}")
    return value


def _number(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    *,
    low: float,
    high: float,
    default: float | None = None,
) -> float:
    value = obj.get(key, default)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ValueError(f"{where}.{key} is {shown(value)}, not a number from {low:g} to {high:g}")
    return float(value)
