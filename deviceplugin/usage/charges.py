"""Pure: who each GPU process is charged to, by the attribution rules (docs/design.md §12), and
the slice counts per GPU. What each container may use on a GPU is its allocation's grant there
(`model.DeviceGrant`), whatever source made it and whatever the inventory says now.

The allocation ID in a process's environment, its allocation tag (`usage.tags`), is one any
process can set, and the ID is predictable. Given evidence (the pod and container cgroup of each
process, and the kubelet's device checkpoint), `attribute` decides per process which
allocation, if any, it belongs to, and whether its tag is refused ("misattributed"). Without a
readable checkpoint every tag stands.
Otherwise:
1. A tag (the process's own, or its nearest ancestor's: for a process on device U,
   `VGPU_ALLOCATION_ID_<U>` where that environment sets it, else `VGPU_ALLOCATION_ID`) that the
   checkpoint records for the process's own pod stands; where the kubelet's container names
   are known (its container log links, `usage.containerlogs`), only from the very container the
   checkpoint records it for: a tag from another container of the pod (a sidecar that copied
   the ID), or from a container the kubelet does not know, is refused.
2. A tag from a process in no pod cgroup (a host process) is refused, whatever it names;
   `trust_host_processes` lets it stand, for workloads that run outside pod cgroups (the kubelet
   simulator, the demo, tests): `serve` refuses that setting outside a fake backend.
3. A tag of an allocation the process's pod does not hold is refused.
4. A process of a pod whose tag did not stand (none, invalid or refused) is charged only when
   it shares its container cgroup with a process whose tag stood, and then to that process's
   allocation (where that container's tags stood for several, the one holding slices of the
   process's GPU; rule 5 applies to it). Otherwise it is its pod's unattributed use
   (`GpuUsage.unattributed_pods`): it counts on its GPU and never makes the enforcer act on
   another process.
5. A tag that stood for an allocation holding no slice of the process's GPU is charged to
   the one allocation of the same container (by the checkpoint) that holds slices of that GPU:
   a container holding slices of several resources cannot move its use on one device to an
   allocation with no limit there by naming its other allocation in its environment.

So a process can neither charge its GPU use to another pod's container (nor get that container's
processes killed or throttled for it) by copying its ID, nor push its own pod's GPU container over
its limit from a sidecar that holds no slices. A misattributed process never counts for the
allocation it named; it is counted apart per GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence

from deviceplugin.allocation import device_env_suffix
from deviceplugin.kubelet.checkpoint import DeviceCheckpoint
from deviceplugin.model import (
    AllocationRecord,
    DeviceGrant,
    GpuReading,
    Inventory,
    ProcessSample,
)
from deviceplugin.usage.tags import DeviceTags, Tag


def ratio_of(percent: float) -> float:
    """A percentage as a ratio clamped to 0..1 (drivers' per-process sums may exceed 100)."""
    return min(max(percent / 100.0, 0.0), 1.0)


# An allocation the kubelet has not listed counts as allocated for this long after Allocate
# (pod-resources is asked right after it, and every 10 s), then as unconfirmed.
UNCONFIRMED_AFTER_S = 15.0


def _no_cgroup(pid: int) -> str | None:
    return None


def _no_container(pid: int) -> tuple[str, str] | None:
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class AttributionEvidence:
    """What `attribute` checks the allocation IDs processes name against: the kubelet's device
    checkpoint, the UID of the pod whose cgroup holds a PID (None for a process in no pod
    cgroup), and the cgroup path that names that pod (the container's cgroup; None where
    unknown)."""

    checkpoint: DeviceCheckpoint
    pod_uid_of: Callable[[int], str | None]
    trust_host_processes: bool = False
    cgroup_of: Callable[[int], str | None] = _no_cgroup
    # (pod UID, container name) of the container a PID runs in, as the kubelet named it, and
    # whether those names could be read at all: when they could, a tag stands only from the
    # very container the checkpoint gives the allocation (not from another of its pod's).
    container_of: Callable[[int], tuple[str, str] | None] = _no_container
    containers_known: bool = False
    # Changes whenever `pod_uid_of` or `cgroup_of` may answer differently for a PID (the
    # resolver's generation); None when unknown. With it, a build whose inputs all stayed the
    # same hands out the previous build's attribution rather than deciding it again.
    version: Hashable | None = None


def attribute(
    tag: str | None,
    pod_uid: str | None,
    gpu_uuid: str,
    evidence: AttributionEvidence,
    container: tuple[str, str] | None = None,
) -> tuple[str | None, bool]:
    """The allocation a process on `gpu_uuid` belongs to by its own tag (None: not by its
    tag), and whether its tag is refused. `tag` is the valid allocation ID found in its
    environment, if any; `pod_uid` its pod (normalised), if any; `container` its container's
    (pod UID, name) where the kubelet's names are known. Rules 1 to 3 of this module's
    docstring; rule 4 (container cgroups) needs the other processes and is applied in
    `SnapshotBuilder.build`."""
    checkpoint = evidence.checkpoint
    if not checkpoint.readable:
        return tag, False
    if pod_uid is None and evidence.trust_host_processes:
        return tag, False
    owners = checkpoint.owners.get(tag) if tag is not None else None
    if owners is not None and pod_uid is not None and pod_uid in owners:
        if not evidence.containers_known:
            return tag, False
        if container is not None and container[0] == pod_uid:
            assert tag is not None
            if container in checkpoint.pod_of(tag):
                return tag, False
    return None, tag is not None


def _holder_on(
    tag: str,
    pod_uid: str,
    gpu_uuid: str,
    checkpoint: DeviceCheckpoint,
    held_on: frozenset[tuple[str, str]],
) -> str:
    """Rule 5: for a tag that stood but holds nothing of `gpu_uuid`, the one allocation of
    the same container (by the checkpoint) that holds slices of it; else the tag itself."""
    holders = checkpoint.pod_gpu_allocations.get((pod_uid, gpu_uuid))
    if not holders:
        return tag
    containers = set(checkpoint.pod_of(tag))
    found = [
        a
        for a in holders
        if a != tag and (a, gpu_uuid) in held_on and containers.intersection(checkpoint.pod_of(a))
    ]
    return found[0] if len(found) == 1 else tag


def confirmed(record: AllocationRecord, wall_s: float) -> bool:
    """Whether the slices `record` holds count as allocated (else as unconfirmed): the kubelet
    lists it, or it was made less than UNCONFIRMED_AFTER_S ago."""
    return record.listed or wall_s - record.allocated_at_s < UNCONFIRMED_AFTER_S


@dataclasses.dataclass(slots=True)
class _Accumulator:
    """One (allocation, GPU) while a snapshot is built."""

    record: AllocationRecord
    slices: int = 0
    memory_limit_bytes: int = 0
    memory_request_bytes: int = 0
    compute_share_ratio: float = 0.0
    memory_used_bytes: int = 0
    sm_util_percent: float = 0.0
    processes: list[ProcessSample] = dataclasses.field(default_factory=list)

    def grant(self, grant: DeviceGrant) -> None:
        self.slices += grant.slices
        self.memory_limit_bytes += grant.memory_limit_bytes
        self.memory_request_bytes += grant.request_bytes
        self.compute_share_ratio += grant.compute_share_ratio

    def add(self, process: ProcessSample) -> None:
        self.processes.append(process)
        self.memory_used_bytes += process.used_memory_bytes or 0
        self.sm_util_percent += process.sm_util_percent or 0.0


# ContainerUsage's fields before `sm_utilization_ratio`, and after it up to
# `memory_request_bytes`.
UsageHead = tuple[str, str, int, int, int, int]
UsageTail = tuple[float, tuple[ProcessSample, ...], str, str, str, int | None]
Charged = tuple[tuple[str, str], float, UsageHead, UsageTail]


@dataclasses.dataclass(frozen=True, slots=True)
class Charges:
    """Phase one of a build: what is charged to each (allocation ID, GPU UUID), and per GPU UUID
    the processes charged to no allocation, the refused tags, the pods' unattributed processes
    and the slice counts; the accepted allocation IDs this daemon does not know."""

    # Per (allocation ID, GPU UUID), in charge order: its utilisation ratio this poll, and the
    # ContainerUsage fields before and after `sm_utilization_ratio` (up to `container`).
    containers: tuple[Charged, ...]
    unattributed: Mapping[str, tuple[ProcessSample, ...]]
    misattributed: Mapping[str, tuple[ProcessSample, ...]]
    unattributed_pods: Mapping[str, tuple[tuple[int, str], ...]]
    unknown: frozenset[str]
    slices_total: Mapping[str, int]
    slices_allocated: Mapping[str, int]
    slices_unhealthy: Mapping[str, int]
    slices_unconfirmed: Mapping[str, int]


def charge_processes(
    gpus: Sequence[GpuReading],
    inventory: Inventory,
    allocations: Sequence[AllocationRecord],
    pid_allocation: Mapping[int, Tag],
    *,
    wall_s: float,
    checked: AttributionEvidence | None,
) -> Charges:
    """Phase one of a build: each process of `gpus` charged to an allocation, or counted as
    unattributed (and misattributed where its tag was refused), by the rules of this module's
    docstring; `checked` is the evidence when its checkpoint is readable, else None."""
    gpu_by_uuid = {g.info.uuid: g for g in gpus}
    records = {r.allocation_id: r for r in allocations}
    holdings = _Holdings.of(records.values(), inventory, gpu_by_uuid, wall_s)
    ledger = _Ledger(records, holdings.accumulators, gpu_by_uuid)
    for gpu in gpus:
        uuid = gpu.info.uuid
        for process, found in _tags_on(gpu, pid_allocation):
            if checked is None:
                # Without a readable checkpoint every tag stands: `attribute` is not asked.
                ledger.charge(uuid, process, found)
            else:
                ledger.check(uuid, process, found, checked, holdings.held_on)
    if checked is not None and ledger.pending:
        ledger.charge_pending(checked.checkpoint, holdings.held_on)
        ledger.put_in_driver_order(gpus)
    total, unhealthy = _slice_counts(inventory, gpu_by_uuid)
    return ledger.charges(total, holdings.slices_allocated, unhealthy, holdings.slices_unconfirmed)


def _slice_counts(
    inventory: Inventory, gpu_by_uuid: Mapping[str, GpuReading]
) -> tuple[dict[str, int], dict[str, int]]:
    """Per GPU read this poll: its slices in the inventory, and how many of them are unhealthy."""
    total = dict.fromkeys(gpu_by_uuid, 0)
    unhealthy = dict.fromkeys(gpu_by_uuid, 0)
    for slice_ in inventory.slices:
        uuid = slice_.id.gpu_uuid
        if uuid in total:
            total[uuid] += 1
            if not slice_.healthy:
                unhealthy[uuid] += 1
    return total, unhealthy


@dataclasses.dataclass(frozen=True, slots=True)
class _Holdings:
    """What the allocations hold of the GPUs read this poll: per (allocation, GPU) its grants
    there (an accumulator, no process charged yet), those pairs (`held_on`), and per GPU the
    slices held by allocations that count as allocated and by those still unconfirmed."""

    accumulators: dict[tuple[str, str], _Accumulator]
    held_on: frozenset[tuple[str, str]]
    slices_allocated: dict[str, int]
    slices_unconfirmed: dict[str, int]

    @classmethod
    def of(
        cls,
        records: Collection[AllocationRecord],
        inventory: Inventory,
        gpu_by_uuid: Mapping[str, GpuReading],
        wall_s: float,
    ) -> _Holdings:
        accumulators: dict[tuple[str, str], _Accumulator] = {}
        for record in records:
            # What it may use is what it was granted, whatever the inventory says now.
            for grant in record.grants:
                if grant.gpu_uuid in gpu_by_uuid:
                    key = (record.allocation_id, grant.gpu_uuid)
                    acc = accumulators.get(key)
                    if acc is None:
                        acc = accumulators[key] = _Accumulator(record)
                    acc.grant(grant)
        allocated, unconfirmed = _held_slices(records, inventory, gpu_by_uuid, wall_s)
        return cls(accumulators, frozenset(accumulators), allocated, unconfirmed)


def _held_slices(
    records: Collection[AllocationRecord],
    inventory: Inventory,
    gpu_by_uuid: Mapping[str, GpuReading],
    wall_s: float,
) -> tuple[dict[str, int], dict[str, int]]:
    """Per GPU read this poll, its healthy slices that device-plugin allocations hold: those
    that count as allocated, and those held only by allocations still unconfirmed."""
    held_healthy: set[str] = set()
    # Held by allocations the kubelet does not list, past the first seconds after Allocate.
    held_unconfirmed: set[str] = set()
    by_id = inventory.by_id
    for record in records:
        if not record.slice_ids:
            continue
        held = held_healthy if confirmed(record, wall_s) else held_unconfirmed
        for slice_id in record.slice_ids:
            s = by_id.get(slice_id)
            if s is not None and s.healthy and s.id.gpu_uuid in gpu_by_uuid:
                held.add(slice_id)
    allocated = dict.fromkeys(gpu_by_uuid, 0)
    for slice_id in held_healthy:
        allocated[by_id[slice_id].id.gpu_uuid] += 1
    unconfirmed = dict.fromkeys(gpu_by_uuid, 0)
    for slice_id in held_unconfirmed - held_healthy:
        unconfirmed[by_id[slice_id].id.gpu_uuid] += 1
    return allocated, unconfirmed


def _tags_on(
    gpu: GpuReading, pid_allocation: Mapping[int, Tag]
) -> Iterator[tuple[ProcessSample, str | None]]:
    """Each process of `gpu` with the allocation ID its environment names for that GPU: its
    per-device key's for the GPU where its environment sets one, else its `VGPU_ALLOCATION_ID`."""
    suffix: str | None = None
    tag_of = pid_allocation.get
    for process in gpu.processes:
        tag = tag_of(process.pid)
        if isinstance(tag, DeviceTags):
            if suffix is None:
                suffix = device_env_suffix(gpu.info.uuid)
            yield process, tag.on(suffix)
        else:
            yield process, tag


class _Ledger:
    """Where a build's processes are counted: per (allocation, GPU) and, per GPU, the
    unattributed, misattributed and pods' unattributed processes; and, while the build goes on,
    what rule 4 needs: the processes of pods whose tag did not stand, and the allocations
    that stood per container cgroup."""

    def __init__(
        self,
        records: Mapping[str, AllocationRecord],
        accumulators: dict[tuple[str, str], _Accumulator],
        gpu_by_uuid: Mapping[str, GpuReading],
    ) -> None:
        self._records = records
        self._accumulators = accumulators
        self._gpu_by_uuid = gpu_by_uuid
        self._unknown: set[str] = set()
        self._unattributed: dict[str, list[ProcessSample]] = {uuid: [] for uuid in gpu_by_uuid}
        self._misattributed: dict[str, list[ProcessSample]] = {uuid: [] for uuid in gpu_by_uuid}
        self._unattributed_pods: dict[str, list[tuple[int, str]]] = {
            uuid: [] for uuid in gpu_by_uuid
        }
        # (GPU UUID, process, pod UID, container cgroup) of each process whose tag did not stand.
        self.pending: list[tuple[str, ProcessSample, str, str | None]] = []
        self._cgroup_allocations: dict[str, set[str]] = {}

    def charge(self, uuid: str, process: ProcessSample, found: str | None) -> None:
        """Count `process` for the allocation it was found to belong to (None: none)."""
        if found is None:
            self._unattributed[uuid].append(process)
            return
        owner = self._records.get(found)
        if owner is None:
            self._unattributed[uuid].append(process)
            self._unknown.add(found)
            return
        key = (found, uuid)
        acc = self._accumulators.get(key)
        if acc is None:
            acc = self._accumulators[key] = _Accumulator(owner)
        acc.add(process)

    def check(
        self,
        uuid: str,
        process: ProcessSample,
        tag: str | None,
        evidence: AttributionEvidence,
        held_on: frozenset[tuple[str, str]],
    ) -> None:
        """Rules 1 to 3 and 5 for a process whose environment names `tag` on `uuid`: charge
        it, or (a pod's process whose tag did not stand) keep it for rule 4."""
        pid = process.pid
        pod_uid = evidence.pod_uid_of(pid)
        container = evidence.container_of(pid) if evidence.containers_known else None
        found, refused = attribute(tag, pod_uid, uuid, evidence, container)
        if refused:
            self._misattributed[uuid].append(process)
        elif found is not None and pod_uid is not None and (found, uuid) not in held_on:
            found = _holder_on(found, pod_uid, uuid, evidence.checkpoint, held_on)
        if pod_uid is not None:
            cgroup = evidence.cgroup_of(pid)
            if found is None:
                self.pending.append((uuid, process, pod_uid, cgroup))
                return
            if cgroup is not None:
                self._cgroup_allocations.setdefault(cgroup, set()).add(found)
        self.charge(uuid, process, found)

    def charge_pending(
        self, checkpoint: DeviceCheckpoint, held_on: frozenset[tuple[str, str]]
    ) -> None:
        """Rule 4: each pod's process whose tag did not stand goes to the allocation whose
        tag stood in its container cgroup, where there is one; else it is its pod's
        unattributed use."""
        for uuid, process, pod_uid, cgroup in self.pending:
            sharing = self._cgroup_allocations.get(cgroup, set()) if cgroup is not None else set()
            if len(sharing) > 1:
                # A container holding several allocations (slices of several resources): the
                # one that holds this GPU.
                sharing = {a for a in sharing if (a, uuid) in held_on}
            if len(sharing) == 1:
                found = next(iter(sharing))
                if (found, uuid) not in held_on:
                    found = _holder_on(found, pod_uid, uuid, checkpoint, held_on)
                self.charge(uuid, process, found)
            else:
                self._unattributed_pods[uuid].append((process.pid, pod_uid))
                self.charge(uuid, process, None)

    def put_in_driver_order(self, gpus: Sequence[GpuReading]) -> None:
        """Rule 4 charged its processes after the others: every list back in the driver's order."""
        order = {p.pid: n for gpu in gpus for n, p in enumerate(gpu.processes)}
        lists = [*self._unattributed.values(), *(a.processes for a in self._accumulators.values())]
        for processes in lists:
            if len(processes) > 1:
                processes.sort(key=lambda p: order.get(p.pid, 0))

    def charges(
        self,
        slices_total: Mapping[str, int],
        slices_allocated: Mapping[str, int],
        slices_unhealthy: Mapping[str, int],
        slices_unconfirmed: Mapping[str, int],
    ) -> Charges:
        return Charges(
            tuple(self._charged(key, acc) for key, acc in self._accumulators.items()),
            {uuid: tuple(ps) for uuid, ps in self._unattributed.items()},
            {uuid: tuple(ps) for uuid, ps in self._misattributed.items()},
            {uuid: tuple(ps) for uuid, ps in self._unattributed_pods.items()},
            frozenset(self._unknown),
            slices_total,
            slices_allocated,
            slices_unhealthy,
            slices_unconfirmed,
        )

    def _charged(self, key: tuple[str, str], acc: _Accumulator) -> Charged:
        record = acc.record
        index = self._gpu_by_uuid[key[1]].info.index
        head = (key[0], key[1], index, acc.slices, acc.memory_used_bytes, acc.memory_limit_bytes)
        tail = (
            acc.compute_share_ratio,
            tuple(acc.processes),
            record.namespace,
            record.pod,
            record.container,
            # None where it is the limit: the snapshot of a container without burst is as before.
            None
            if acc.memory_request_bytes == acc.memory_limit_bytes
            else acc.memory_request_bytes,
        )
        return key, ratio_of(acc.sm_util_percent), head, tail
