"""Who holds which allocation: the evidence attribution checks a process's claimed allocation
against (docs/design.md §12). Each frontend gives it from its own source: the device-plugin
frontend from the kubelet's device checkpoint (`kubelet.checkpoint`), the DRA frontend from its
prepared claims, the pods they are reserved for and the containers pod-resources lists with
them. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def normalize_pod_uid(uid: str) -> str:
    """A pod UID as compared here: lowercase, with dashes (systemd slice names use underscores)."""
    return uid.strip().lower().replace("_", "-")


@dataclass(frozen=True, slots=True)
class OwnerEntry:
    """One container holding one allocation: its pod, its devices of our resource (none for a
    DRA claim, which holds no slice) and the GPUs they are on."""

    pod_uid: str  # normalised
    container: str
    allocation_id: str
    device_ids: tuple[str, ...]  # sorted, distinct
    gpu_uuids: frozenset[str]
    resource_name: str = ""


@dataclass(frozen=True, slots=True)
class AllocationOwners:
    """Who holds which allocation. `reason` is "" when the source was read, and otherwise why
    it could not be (the owners are then none: no evidence either way)."""

    entries: tuple[OwnerEntry, ...] = ()
    reason: str = "not read"
    # Indexes over `entries`: allocation ID -> pod UIDs; pod UID -> allocation IDs;
    # (pod UID, GPU UUID) -> the allocation IDs of that pod with slices of that GPU.
    owners: Mapping[str, frozenset[str]] = field(default_factory=dict, repr=False)
    pod_allocations: Mapping[str, frozenset[str]] = field(default_factory=dict, repr=False)
    pod_gpu_allocations: Mapping[tuple[str, str], frozenset[str]] = field(
        default_factory=dict, repr=False
    )

    @property
    def readable(self) -> bool:
        return not self.reason

    @classmethod
    def of(cls, entries: tuple[OwnerEntry, ...]) -> AllocationOwners:
        owners: dict[str, set[str]] = {}
        pods: dict[str, set[str]] = {}
        pod_gpus: dict[tuple[str, str], set[str]] = {}
        for e in entries:
            owners.setdefault(e.allocation_id, set()).add(e.pod_uid)
            pods.setdefault(e.pod_uid, set()).add(e.allocation_id)
            for uuid in e.gpu_uuids:
                pod_gpus.setdefault((e.pod_uid, uuid), set()).add(e.allocation_id)
        return cls(
            entries,
            "",
            {k: frozenset(v) for k, v in owners.items()},
            {k: frozenset(v) for k, v in pods.items()},
            {k: frozenset(v) for k, v in pod_gpus.items()},
        )

    @classmethod
    def unreadable(cls, reason: str) -> AllocationOwners:
        return cls((), reason or "unreadable")

    def pod_of(self, allocation: str) -> tuple[tuple[str, str], ...]:
        """The (pod UID, container name) pairs that hold `allocation`: one, normally; none for an
        allocation the kubelet did not record; more where it reused an init container's devices
        for a later container of the same pod."""
        return tuple(
            (e.pod_uid, e.container) for e in self.entries if e.allocation_id == allocation
        )
