"""Pure: one GPU reading, the inventory and the allocations -> the node's usage snapshot.

Every container that holds slices gets one ContainerUsage per GPU it holds slices on, from the
moment of its allocation; a GPU process joins its container's usage when its allocation ID (found
by the caller in the process environment) names an allocation this daemon knows. Any other GPU
process is unattributed: it is counted on its GPU and never appears in a ContainerUsage, so the
enforcer, which acts only on containers' processes, cannot touch it.

Who each process is charged to, and which allocation tags are refused, is decided in
`usage.charges` by the attribution rules (docs/design.md §12); this module turns that into the
snapshot.

Utilisation ratios are time-weighted averages over a sliding window (docs/design.md §5,
`usage.window`), so that a scrape does not beat against a duty cycle.

A build whose inputs are those of the build before (the GPUs' process samples, the allocations
and whether each counts as confirmed, the tags, the inventory and checkpoint objects, and the
evidence's version) hands out that build's attribution again rather than deciding it anew: on a
node whose processes hold still, most polls. Evidence without a version is never reused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from deviceplugin.config import DraConfig
from deviceplugin.model import (
    SOURCE_DEVICE_PLUGIN,
    SOURCE_DRA,
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    GpuReading,
    GpuUsage,
    Inventory,
    NodeReading,
    NodeSnapshot,
)
from deviceplugin.owners import AllocationOwners
from deviceplugin.usage.charges import (
    UNCONFIRMED_AFTER_S,
    AttributionEvidence,
    Charges,
    UsageHead,
    UsageTail,
    attribute,
    charge_processes,
    confirmed,
    ratio_of,
)
from deviceplugin.usage.devices import dra_devices
from deviceplugin.usage.tags import DeviceTags, Tag
from deviceplugin.usage.window import UtilizationWindow

__all__ = [
    "UNCONFIRMED_AFTER_S",
    "AttributionEvidence",
    "DeviceTags",
    "SnapshotBuilder",
    "Tag",
    "attribute",
    "mark_stale",
]


@dataclasses.dataclass(frozen=True, slots=True)
class _Memo:
    """The last phase one and what it was computed from (the inventory and the checkpoint by
    identity: both are replaced whole when they change)."""

    key: tuple[object, ...]
    inventory: Inventory
    checkpoint: AllocationOwners | None
    charges: Charges


# A container's ContainerUsage, with the fields it was made of: before the utilisation ratio,
# after it, and the ratio.
_Built = tuple[UsageHead, UsageTail, float, ContainerUsage]


class SnapshotBuilder:
    """Builds the NodeSnapshot after every poll. Holds only the utilisation windows between
    builds, keyed by (allocation ID, GPU UUID) for containers and by GPU UUID for GPUs."""

    def __init__(self, node_name: str, window_s: float) -> None:
        self.node_name = node_name
        self._window = UtilizationWindow(window_s)
        # The previous build's ContainerUsage per (allocation ID, GPU UUID), with the values it
        # was made of: one whose values did not change is handed out again rather than rebuilt
        # (most containers, most polls), which also lets the enforcer see it is unchanged.
        self._containers: dict[tuple[str, str], _Built] = {}
        self._sorted: tuple[ContainerUsage, ...] = ()
        # The last build's charges, and each container's figure, when every container's
        # average was its figure: the same charges again need only the windows extended.
        self._steady: tuple[Charges, tuple[tuple[Hashable, float], ...]] | None = None
        self._memo: _Memo | None = None

    def build(
        self,
        reading: NodeReading,
        inventory: Inventory,
        allocations: Sequence[AllocationRecord],
        pid_allocation: Mapping[int, Tag],
        *,
        now_s: float,
        wall_s: float,
        health: DaemonHealth,
        previous_reading_s: float | None,
        evidence: AttributionEvidence | None = None,
        dra: DraConfig | None = None,
    ) -> tuple[NodeSnapshot, frozenset[str]]:
        """The snapshot of `reading`, and the allocation IDs accepted for GPU processes that are
        not in `allocations` (the caller asks pod-resources again when there are any). Processes
        whose tag was refused are in each GpuUsage's `misattributed`.

        `now_s` is the monotonic time of the reading, `previous_reading_s` that of the one before
        (None on the first build: this reading then covers no time and averages to 0.0); `wall_s`
        becomes `taken_at_s`. `pid_allocation` maps a process's PID to the allocation IDs found
        in its environment (its tag; `DeviceTags` where it names some per device); a PID it
        does not list counts as None. Without `evidence`
        every tag stands; with it, `attribute` decides. With `dra` (DRA mode: its request
        policies), each published device's claimed and free capacity is in its GpuUsage."""
        duration_s = 0.0 if previous_reading_s is None else max(now_s - previous_reading_s, 0.0)
        gpus = sorted(reading.gpus, key=lambda g: g.info.index)
        gpu_by_uuid: dict[str, GpuReading] = {g.info.uuid: g for g in gpus}
        charges = self._charges(
            gpus, inventory, allocations, pid_allocation, wall_s=wall_s, evidence=evidence
        )

        window = self._window
        live_keys: set[Hashable] = set(gpu_by_uuid)
        # On the charges of the last build, which left every container's average at its figure,
        # extending the windows is all: each average stays there, and so does every usage.
        steady = self._steady
        if (
            steady is None
            or steady[0] is not charges
            or not window.extend(steady[1], now_s, duration_s)
        ):
            self._build_containers(charges, now_s, duration_s)
        live_keys.update(self._containers)

        devices = {} if dra is None else dra_devices(inventory.plans, allocations, dra)
        gpu_usages: list[GpuUsage] = []
        for gpu in gpus:
            uuid = gpu.info.uuid
            sm_ratio: float | None = None
            if gpu.sm_util_percent is not None:
                sm_ratio = window.add(uuid, now_s, duration_s, ratio_of(gpu.sm_util_percent))
            gpu_usages.append(
                GpuUsage(
                    reading=gpu,
                    sm_utilization_ratio=sm_ratio,
                    slices_total=charges.slices_total[uuid],
                    slices_allocated=charges.slices_allocated[uuid],
                    slices_unhealthy=charges.slices_unhealthy[uuid],
                    slices_unconfirmed=charges.slices_unconfirmed[uuid],
                    unattributed=charges.unattributed[uuid],
                    misattributed=charges.misattributed[uuid],
                    unattributed_pods=charges.unattributed_pods[uuid],
                    dra=devices.get(uuid),
                )
            )
        window.forget_except(live_keys)

        snapshot = NodeSnapshot(
            taken_at_s=wall_s,
            node_name=self.node_name,
            gpus=tuple(gpu_usages),
            containers=self._sorted,
            allocations=tuple(allocations),
            stale=False,
            health=health,
            kubelet_api=SOURCE_DEVICE_PLUGIN if dra is None else SOURCE_DRA,
        )
        return snapshot, charges.unknown

    def _build_containers(self, charges: Charges, now_s: float, duration_s: float) -> None:
        """Every container's usage from `charges`, the one of the last build where its values
        are the same (which lets the enforcer see that it is unchanged), sorted by GPU index,
        namespace, pod, container and allocation ID."""
        window = self._window
        containers: list[ContainerUsage] = []
        previous = self._containers
        built: dict[tuple[str, str], _Built] = {}
        changed = len(previous) != len(charges.containers)
        at_figures = True
        for key, ratio, head, tail in charges.containers:
            average = window.add(key, now_s, duration_s, ratio) or 0.0
            at_figures = at_figures and average == ratio
            kept = previous.get(key)
            if kept is not None and kept[2] == average and kept[0] == head and kept[1] == tail:
                usage = kept[3]
            else:
                usage = ContainerUsage(*head, average, *tail)
                changed = True
            built[key] = (head, tail, average, usage)
            containers.append(usage)
        self._containers = built
        if changed or not self._sorted:
            containers.sort(
                key=lambda c: (c.gpu_index, c.namespace, c.pod, c.container, c.allocation_id)
            )
            self._sorted = tuple(containers)
        # (else every container is the one of the last build: so is their order)
        self._steady = (
            (charges, tuple((key, ratio) for key, ratio, _, _ in charges.containers))
            if at_figures
            else None
        )

    def _charges(
        self,
        gpus: Sequence[GpuReading],
        inventory: Inventory,
        allocations: Sequence[AllocationRecord],
        pid_allocation: Mapping[int, Tag],
        *,
        wall_s: float,
        evidence: AttributionEvidence | None,
    ) -> Charges:
        """Who each GPU process is charged to, and the slice counts: the same inputs give the
        same answer, so the last one is handed out again while they stay the same (a node whose
        processes and figures hold still, most polls)."""
        checked = evidence if evidence is not None and evidence.checkpoint.readable else None
        if checked is not None and checked.version is None:
            # The evidence cannot say whether its answers changed: never reused.
            self._memo = None
            return charge_processes(
                gpus, inventory, allocations, pid_allocation, wall_s=wall_s, checked=checked
            )
        checkpoint = None if checked is None else checked.checkpoint
        key = (
            tuple((g.info.uuid, g.info.index, g.processes) for g in gpus),
            tuple(allocations),
            tuple(confirmed(r, wall_s) for r in allocations),
            dict(pid_allocation),
            None
            if checked is None
            else (checked.trust_host_processes, checked.containers_known, checked.version),
        )
        memo = self._memo
        if (
            memo is not None
            and memo.inventory is inventory
            and memo.checkpoint is checkpoint
            and memo.key == key
        ):
            return memo.charges
        charges = charge_processes(
            gpus, inventory, allocations, pid_allocation, wall_s=wall_s, checked=checked
        )
        self._memo = _Memo(key, inventory, checkpoint, charges)
        return charges


def mark_stale(snapshot: NodeSnapshot, health: DaemonHealth) -> NodeSnapshot:
    """The same figures, marked stale, with the daemon's current health: for when a poll fails."""
    return dataclasses.replace(snapshot, stale=True, health=health)
