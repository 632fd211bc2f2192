"""What each device-plugin allocation was granted, kept in the state directory for its life.

An allocation's grants (`model.DeviceGrant`, one per GPU) are fixed when it is made: Allocate's
figures, the ones its environment states (`VGPU_MEMORY_LIMIT_MIB_<i>`,
`VGPU_COMPUTE_SHARE_PERCENT_<i>`). A reload that slices its GPU differently changes what new
allocations get, never what a running one was given. A restarted daemon learns of its
allocations from the kubelet (pod-resources, its checkpoint), which knows their slices but not
what they were given, so the grants are kept in `<state-dir>/allocation-grants.json`, written
before Allocate answers and read back at the next start: bounded, never through a symbolic link.
The file is replaced on a thread of its own (`_Writer`), never on the event loop, and Allocate
awaits that; the writer then syncs it to disk, as the kubelet keeps Allocate's answer across a
reboot of the node and starts the containers again with it.

An allocation the kubelet names with no grant kept here (made by a daemon that kept none, a lost
or unreadable file) gets what the current plan gives its slices, with a log line saying so, and
that grant is kept from then on. A kept grant is used only for the very slices it was made for,
on the GPUs those slices are of; an entry that is not one is skipped with a log line. Grants go
when the allocation book drops their allocation (its pod is gone), and, once the kubelet lists
its pods, those of allocations that went while the daemon was away.

A DRA claim keeps what it consumed in its own checkpoint (`dra.store`): its grants come with
it, and nothing of it is kept here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import queue
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deviceplugin import statefiles
from deviceplugin.allocation import slice_grants
from deviceplugin.config import Config
from deviceplugin.model import (
    SOURCE_DEVICE_PLUGIN,
    AllocationRecord,
    DeviceGrant,
    GpuInfo,
    GpuPlan,
    Inventory,
    SliceId,
)
from deviceplugin.safefs import read_bounded
from deviceplugin.slicing import format_bytes, plan_gpus
from deviceplugin.state import AllocationBook, Published

log = logging.getLogger(__name__)

GRANTS_FILE = "allocation-grants.json"
VERSION = 1
# A few hundred bytes per allocation: 16 MiB is tens of thousands.
MAX_GRANTS_BYTES = 16 << 20


def describe_grants(grants: Iterable[DeviceGrant]) -> str:
    """`GPU-a: memory=20Gi compute=0.50 slices=2, ...` for a log line."""
    return (
        ", ".join(
            f"{g.gpu_uuid}: memory={format_bytes(g.memory_limit_bytes)} "
            f"compute={g.compute_share_ratio:.2f} slices={g.slices}"
            for g in grants
        )
        or "none"
    )


def _gpus_of(slice_ids: Iterable[str]) -> set[str]:
    gpus: set[str] = set()
    for slice_id in slice_ids:
        try:
            gpus.add(SliceId.parse(slice_id).gpu_uuid)
        except ValueError:
            continue  # not one of this daemon's slice IDs: nothing is granted for it
    return gpus


def _grant_to_json(g: DeviceGrant) -> dict[str, Any]:
    return {
        "gpu_uuid": g.gpu_uuid,
        "memory_limit_bytes": g.memory_limit_bytes,
        "memory_request_bytes": g.memory_request_bytes,
        "compute_share_ratio": g.compute_share_ratio,
        "slices": g.slices,
    }


def _count(value: object, what: str, *, at_least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < at_least:
        raise ValueError(f"{what} is not a whole number of at least {at_least}: {value!r}")
    return value


def _grant_from_json(data: object) -> DeviceGrant:
    if not isinstance(data, Mapping):
        raise ValueError(f"a grant is not an object: {data!r:.80}")
    uuid = data.get("gpu_uuid")
    if not isinstance(uuid, str) or not uuid:
        raise ValueError("a grant names no gpu_uuid")
    limit = _count(data.get("memory_limit_bytes"), "memory_limit_bytes")
    request = data.get("memory_request_bytes")
    if request is not None:
        request = _count(request, "memory_request_bytes")
        if request > limit:
            raise ValueError(f"memory_request_bytes {request} is above the limit {limit}")
    share = data.get("compute_share_ratio")
    if not isinstance(share, int | float) or isinstance(share, bool) or not 0 <= share <= 1:
        raise ValueError(f"compute_share_ratio is not a ratio 0..1: {share!r}")
    slices = _count(data.get("slices"), "slices", at_least=1)
    return DeviceGrant(uuid, limit, float(share), slices, request)


_Entry = tuple[tuple[str, ...], tuple[DeviceGrant, ...]]


def _entry_from_json(data: object) -> _Entry:
    """(slice IDs, grants) of one kept allocation; ValueError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError("not an object")
    slice_ids = data.get("slice_ids")
    if not isinstance(slice_ids, list) or not all(isinstance(s, str) for s in slice_ids):
        raise ValueError("slice_ids is not a list of slice IDs")
    raw = data.get("grants")
    if not isinstance(raw, list) or not raw:
        raise ValueError("grants is not a list of grants")
    grants = tuple(_grant_from_json(g) for g in raw)
    stray = {g.gpu_uuid for g in grants} - _gpus_of(slice_ids)
    if stray:
        raise ValueError(f"grants on GPUs its slices are not of: {', '.join(sorted(stray))}")
    return tuple(sorted(slice_ids)), grants


class _Writer:
    """Writes the grants file on a daemon thread of its own, whole each time: of the contents
    handed to it while a write runs, only the latest is written next (each is the whole file),
    and every one handed before it counts as written with it. A content counts as written once
    the file is replaced (a daemon killed from then on finds it); the writer then syncs it to
    disk, which no one waits for."""

    def __init__(self, write: Callable[[bytes], bool], sync: Callable[[], None]) -> None:
        self._write = write
        self._sync = sync
        self._queue: queue.SimpleQueue[tuple[bytes, concurrent.futures.Future[None]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self.last: concurrent.futures.Future[None] | None = None

    def submit(self, data: bytes) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put((data, future))
        self.last = future
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vgpu-grants", daemon=True)
            self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            written = False
            try:
                written = self._write(batch[-1][0])  # logs its failure: Allocate answers anyway
            except Exception:
                log.exception("writing the allocation grants failed")
            for _, future in batch:
                future.set_result(None)
            if written and self._queue.empty():
                self._sync()


class GrantStore:
    """The book's `GrantKeeper` in device-plugin mode: every allocation's grants by allocation
    ID, mirrored to `<state_dir>/allocation-grants.json` on every change (read on first use).
    `inventory` gives the current plan, for an allocation whose grants were not kept."""

    def __init__(self, state_dir: Path, inventory: Callable[[], Inventory]) -> None:
        self._dir = state_dir
        self._inventory = inventory
        self._entries: dict[str, _Entry] = {}
        self._loaded = False
        self._writer = _Writer(self._write, self._sync)

    @property
    def path(self) -> Path:
        return self._dir / GRANTS_FILE

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            raw = read_bounded(self.path, MAX_GRANTS_BYTES)
        except FileNotFoundError:
            return
        except OSError as e:
            log.error(
                "allocation grants unreadable; allocations the kubelet names get the current "
                "plan's figures path=%s error=%s",
                self.path,
                e.strerror or e,
            )
            return
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            log.error(
                "allocation grants unreadable (not JSON); allocations the kubelet names get the "
                "current plan's figures path=%s error=%s",
                self.path,
                str(e)[:200],
            )
            return
        allocations = doc.get("allocations") if isinstance(doc, dict) else None
        if (
            not isinstance(doc, dict)
            or doc.get("version") != VERSION
            or not isinstance(allocations, dict)
        ):
            log.error(
                'allocation grants unreadable: expected {"version": %d, "allocations": {...}}; '
                "allocations the kubelet names get the current plan's figures path=%s",
                VERSION,
                self.path,
            )
            return
        for allocation, data in allocations.items():
            try:
                self._entries[str(allocation)] = _entry_from_json(data)
            except ValueError as e:
                log.warning(
                    "a kept allocation grant is skipped; the allocation gets the current "
                    "plan's figures path=%s allocation_id=%s error=%s",
                    self.path,
                    allocation,
                    e,
                )
        log.info("allocation grants read path=%s allocations=%d", self.path, len(self._entries))

    def _save(self) -> None:
        """Hand the whole file to the writer (see `kept`)."""
        doc = {
            "version": VERSION,
            "allocations": {
                allocation: {
                    "slice_ids": list(slice_ids),
                    "grants": [_grant_to_json(g) for g in grants],
                }
                for allocation, (slice_ids, grants) in sorted(self._entries.items())
            },
        }
        self._writer.submit(json.dumps(doc, separators=(",", ":")).encode())

    def _write(self, data: bytes) -> bool:
        """Replace the file with `data` (the writer's thread); whether it was replaced."""
        try:
            statefiles.write_file(self._dir, GRANTS_FILE, data, sync=False)
        except OSError as e:
            log.error(
                "cannot keep the allocation grants; after a restart of the daemon its "
                "allocations get the plan of that time path=%s error=%s",
                self.path,
                e.strerror or e,
            )
            return False
        return True

    def _sync(self) -> None:
        """The file and its directory to disk (the writer's thread, after Allocate answered)."""
        try:
            statefiles.sync_file(self._dir, GRANTS_FILE)
        except OSError as e:
            log.warning("cannot sync the allocation grants to disk path=%s error=%s", self.path, e)

    async def kept(self) -> None:
        """Until every change made so far is on disk."""
        if self._writer.last is not None:
            await asyncio.wrap_future(self._writer.last)

    def wait_kept(self, timeout_s: float = 10.0) -> None:
        """`kept`, off the event loop (tests, tools)."""
        if self._writer.last is not None:
            self._writer.last.result(timeout_s)

    def get(self, allocation_id: str) -> tuple[DeviceGrant, ...] | None:
        self._load()
        entry = self._entries.get(allocation_id)
        return None if entry is None else entry[1]

    # --- GrantKeeper -----------------------------------------------------------------------

    def made(self, record: AllocationRecord) -> None:
        self._load()
        self._entries[record.allocation_id] = (tuple(sorted(record.slice_ids)), record.grants)
        self._save()

    def grant(self, record: AllocationRecord) -> AllocationRecord:
        self._load()
        slice_ids = tuple(sorted(record.slice_ids))
        kept = self._entries.get(record.allocation_id)
        if kept is not None and kept[0] == slice_ids:
            return replace(record, grants=kept[1])
        by_id = self._inventory().by_id
        grants = slice_grants([by_id[s] for s in slice_ids if s in by_id])
        if not grants:
            return record  # none of its slices is in the plan (yet): asked again at next sync
        log.warning(
            "allocation known to the kubelet has no kept grant; it gets the current plan's "
            "figures allocation_id=%s pod=%s/%s/%s %s",
            record.allocation_id,
            record.namespace,
            record.pod,
            record.container,
            describe_grants(grants),
        )
        granted = replace(record, grants=grants)
        self.made(granted)
        return granted

    def forget(self, allocation_ids: Collection[str]) -> None:
        self._load()
        gone = [a for a in allocation_ids if self._entries.pop(a, None) is not None]
        if gone:
            self._save()

    def retain(self, allocation_ids: Collection[str]) -> None:
        self._load()
        keep = set(allocation_ids)
        gone = [a for a in self._entries if a not in keep]
        for allocation in gone:
            del self._entries[allocation]
        if gone:
            log.info("grants of allocations gone while away forgotten count=%d", len(gone))
            self._save()


def held_against_plan(
    records: Iterable[AllocationRecord], plans: Sequence[GpuPlan]
) -> list[tuple[AllocationRecord, DeviceGrant, DeviceGrant]]:
    """The device-plugin allocations whose grant on a GPU differs from what as many of that
    GPU's slices give under `plans` (a reload's new plan): (record, held, planned) per such
    GPU. A GPU the plans do not slice is left out."""
    by_gpu = {p.gpu.uuid: p for p in plans if p.sliced}
    changed: list[tuple[AllocationRecord, DeviceGrant, DeviceGrant]] = []
    for record in records:
        if record.source != SOURCE_DEVICE_PLUGIN:
            continue
        for held in record.grants:
            plan = by_gpu.get(held.gpu_uuid)
            if plan is None:
                continue
            planned = DeviceGrant(
                held.gpu_uuid,
                held.slices * plan.memory_per_slice_bytes,
                held.slices * plan.compute_share_ratio,
                held.slices,
            )
            if planned.memory_limit_bytes != held.memory_limit_bytes or not math.isclose(
                planned.compute_share_ratio, held.compute_share_ratio, rel_tol=1e-9
            ):
                changed.append((record, held, planned))
    return changed


def held_changes(
    records: Iterable[AllocationRecord], gpus: Sequence[GpuInfo], new: Config
) -> list[str]:
    """Log lines for a reload to `new`: one per running allocation and GPU whose grant the new
    plan would have changed (which it does not: it keeps what it was given)."""
    plans = plan_gpus(gpus, new.slicing, mig=new.mig, resource_name=new.resource_name)
    return [
        f"a running allocation keeps what it was given allocation_id={record.allocation_id} "
        f"pod={record.namespace}/{record.pod}/{record.container} gpu={held.gpu_uuid} "
        f"slices={held.slices} memory={format_bytes(held.memory_limit_bytes)} "
        f"compute={held.compute_share_ratio:.2f} "
        f"new_plan_memory={format_bytes(planned.memory_limit_bytes)} "
        f"new_plan_compute={planned.compute_share_ratio:.2f}"
        for record, held, planned in held_against_plan(records, plans)
    ]


def allocation_book(
    state_dir: Path, inventory: Published[Inventory], *, keep: bool
) -> AllocationBook:
    """The daemon's allocation book; with `keep` (device-plugin mode), its grants kept in
    `state_dir` and the current plan (`inventory`) for allocations whose grants were not."""
    if not keep:
        return AllocationBook()
    return AllocationBook(GrantStore(state_dir, lambda: inventory.value))


class HeldGrants:
    """A reload's part: running allocations keep what they were given (their grants); a
    WARNING says where the new plan would have given them something else."""

    def __init__(self, book: AllocationBook, inventory: Published[Inventory]) -> None:
        self._book = book
        self._inventory = inventory

    async def reconfigure(self, old: Config, new: Config) -> None:
        gpus = [plan.gpu for plan in self._inventory.value.plans]
        for line in held_changes(self._book, gpus, new):
            log.warning("config reload: %s", line)
