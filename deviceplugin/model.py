"""Plain values passed between the parts of the daemon: frozen, slotted, with units in their names.

Nothing here does I/O. Every other module speaks in these types.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from deviceplugin.limitsview import MemoryLimitsView

SLICE_SEPARATOR = "::"
MAX_DEVICE_ID_LENGTH = 63  # the kubelet's limit for Device.ID


@dataclass(frozen=True, slots=True, order=True)
class SliceId:
    """One slice of a GPU: `<GPU-UUID>::<n>` on the wire (docs/design.md §2, a contract)."""

    gpu_uuid: str
    n: int

    def __str__(self) -> str:
        return f"{self.gpu_uuid}{SLICE_SEPARATOR}{self.n}"

    @classmethod
    def parse(cls, text: str) -> SliceId:
        """Parse a device ID; ValueError (naming the ID) if it is not `<uuid>::<n>`."""
        uuid, sep, number = text.rpartition(SLICE_SEPARATOR)
        if not sep or not uuid or not number.isdigit() or (len(number) > 1 and number[0] == "0"):
            raise ValueError(f"device ID {text!r} is not of the form <GPU-UUID>::<n>")
        return cls(uuid, int(number))


def allocation_id(slice_ids: Iterable[str]) -> str:
    """VGPU_ALLOCATION_ID (docs/design.md §3, a contract): the first 16 hex digits of the SHA-256
    of the container's slice IDs, sorted and joined with commas. Recomputable from pod-resources."""
    joined = ",".join(sorted(slice_ids))
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def mig_profile_name(gpu_slices: int, compute_slices: int, memory_mib: int) -> str:
    """A MIG device's profile name as NVIDIA's tools write it (nvidia-smi, k8s-device-plugin,
    mig-parted): `<g>g.<m>gb`, g the GPU instance's slice count and m its memory in GB rounded up
    from MiB (an A100-80GB's 9728 MiB instance is "1g.10gb"); `<c>c.<g>g.<m>gb` when the compute
    instance holds fewer slices than its GPU instance. From nvmlDeviceGetAttributes:
    gpuInstanceSliceCount, computeInstanceSliceCount, memorySizeMB."""
    memory_gb = (memory_mib + 1024 - 1) // 1024
    if compute_slices and compute_slices != gpu_slices:
        return f"{compute_slices}c.{gpu_slices}g.{memory_gb}gb"
    return f"{gpu_slices}g.{memory_gb}gb"


def dra_device_name(gpu: GpuInfo) -> str:
    """The name of a GPU's device in the DRA driver's ResourceSlice: `gpu-<index>`, or
    `gpu-<index>-mig-<gi>-<ci>` for a MIG device."""
    if gpu.parent_uuid:
        return f"gpu-{gpu.index}-mig-{gpu.gpu_instance_id}-{gpu.compute_instance_id}"
    return f"gpu-{gpu.index}"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """What the driver says about one physical GPU. Static while the GPU is present."""

    uuid: str
    index: int
    name: str
    memory_total_bytes: int
    minor: int
    numa_node: int | None = None
    pci_bus_id: str | None = None
    mig_enabled: bool = False
    # A MIG device (one GPU instance with one compute instance) is reported like a GPU: its own
    # UUID (MIG-...), memory and processes, the index of its parent GPU, and these fields set.
    parent_uuid: str = ""
    mig_profile: str = ""  # NVIDIA's profile name, e.g. "1g.10gb"
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    # The MIG device's index under its parent: the slot nvmlDeviceGetMigDeviceHandleByIndex
    # gives it by, the `<m>` of the `<GPU index>:<m>` that NVIDIA's runtime takes in
    # NVIDIA_VISIBLE_DEVICES (allocation.deviceIDStrategy: index).
    mig_index: int | None = None

    @property
    def is_mig_device(self) -> bool:
        return bool(self.parent_uuid)


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One process using a GPU, as measured over the interval since the previous poll.

    `used_memory_bytes` is None where the driver does not report it; `sm_util_percent` is None
    where no utilisation sample exists for the process."""

    pid: int
    used_memory_bytes: int | None
    sm_util_percent: float | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU in one poll: its facts, health and usage."""

    info: GpuInfo
    healthy: bool = True
    health_reason: str = ""
    memory_used_bytes: int | None = None
    sm_util_percent: float | None = None
    processes: tuple[ProcessSample, ...] = ()
    # Counters since the backend started: how often this GPU went unhealthy, and the Xid errors
    # seen on it as (xid, count) pairs in Xid order, critical and ignored alike.
    unhealthy_transitions: int = 0
    xid_errors: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class NodeReading:
    """Everything a backend saw in one poll, in GPU index order."""

    timestamp_s: float
    gpus: tuple[GpuReading, ...]


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """How one GPU is sliced. `excluded_reason` is set for a GPU left out of slicing (MIG)."""

    gpu: GpuInfo
    replicas: int
    memory_per_slice_bytes: int
    compute_share_ratio: float
    excluded_reason: str = ""
    # The extended resource its slices are advertised under; "" for an excluded GPU.
    resource_name: str = ""

    @property
    def sliced(self) -> bool:
        return not self.excluded_reason and self.replicas > 0


@dataclass(frozen=True, slots=True)
class Slice:
    """One advertised device."""

    id: SliceId
    gpu_index: int
    numa_node: int | None
    memory_limit_bytes: int
    compute_share_ratio: float
    healthy: bool
    resource_name: str = ""
    # `<GPU-UUID>::<n>`, made once: Allocate and GetPreferredAllocation read it for every slice
    # of the node on every call.
    device_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_id", str(self.id))


@dataclass(frozen=True, slots=True)
class Inventory:
    """The slices this node advertises, and the plan they come from. Immutable: a change is a new
    Inventory. `slices` is ordered by GPU index, then device UUID (the MIG devices of one GPU
    share its index), then slice number.

    A node may advertise several resources (full GPUs under one name, MIG devices under one name
    per profile): each plan and slice carries its resource name, and `for_resource` is the part
    that one plugin endpoint serves."""

    plans: tuple[GpuPlan, ...] = ()
    slices: tuple[Slice, ...] = ()
    by_id: Mapping[str, Slice] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, plans: Iterable[GpuPlan], slices: Iterable[Slice]) -> Inventory:
        ordered = tuple(sorted(slices, key=lambda s: (s.gpu_index, s.id.gpu_uuid, s.id.n)))
        return cls(tuple(plans), ordered, {s.device_id: s for s in ordered})

    @property
    def resource_names(self) -> tuple[str, ...]:
        """The resources that have at least one slice (healthy or not), sorted."""
        return tuple(sorted({s.resource_name for s in self.slices}))

    def for_resource(self, resource_name: str) -> Inventory:
        """The plans and slices of one resource."""
        return Inventory.of(
            (p for p in self.plans if p.resource_name == resource_name),
            (s for s in self.slices if s.resource_name == resource_name),
        )

    def plan_for(self, gpu_uuid: str) -> GpuPlan | None:
        for plan in self.plans:
            if plan.gpu.uuid == gpu_uuid:
                return plan
        return None


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class DeviceNodeSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What Allocate hands one container (docs/design.md §3), before it becomes protobuf."""

    allocation_id: str
    slice_ids: tuple[str, ...]
    gpu_uuids: tuple[str, ...]
    envs: Mapping[str, str]
    mounts: tuple[MountSpec, ...] = ()
    devices: tuple[DeviceNodeSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    # What its environment states per GPU: the allocation's grants (DeviceGrant), in the order
    # of `gpu_uuids`.
    grants: tuple[DeviceGrant, ...] = ()


SOURCE_DEVICE_PLUGIN = "device-plugin"
SOURCE_DRA = "dra"


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """What an allocation may use of one GPU (or MIG device), fixed when the allocation is made:
    its memory limit in bytes and its compute share (0..1), the figures its environment states
    for its whole life (docs/design.md §3). A device-plugin allocation's are its slices' at
    Allocate (`slices` of them); a DRA claim's, the capacity it consumed (memory, compute / 100;
    `slices` 1). Never recomputed from a later plan: a reload changes only what new allocations
    get.

    `memory_request_bytes` is what it is guaranteed, at most the limit; None: the limit. A
    request below the limit (burst, docs/design.md §15) is a device-plugin resource's with a
    limit per slice, or a DRA claim's with a memory limit in its parameters."""

    gpu_uuid: str
    memory_limit_bytes: int
    compute_share_ratio: float
    slices: int = 1
    memory_request_bytes: int | None = None

    @property
    def request_bytes(self) -> int:
        """What it is guaranteed: its request, or its limit where it has none."""
        if self.memory_request_bytes is None:
            return self.memory_limit_bytes
        return self.memory_request_bytes


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """An allocation this daemon made or recovered, what it was granted and who holds it.

    Source-agnostic: attribution, the snapshot and the enforcer see an allocation ID, who holds
    it and its `grants` (one per GPU it holds), never where it came from. Where it came from is
    kept beside: a device-plugin allocation names the extended resource and its slices
    (`resource_name`, `slice_ids`: the kubelet's bookkeeping, and the slice counts of /status);
    a DRA claim (`source` dra) names the claim (`claim`, its namespace/name) and holds no slice,
    its grants being the capacity it consumed. A record without grants (recovered from the
    kubelet before the daemon has looked for what it was given) is granted on entering the
    allocation book (`state.AllocationBook`)."""

    allocation_id: str
    slice_ids: tuple[str, ...]
    allocated_at_s: float
    namespace: str = ""
    pod: str = ""
    container: str = ""
    # Whether the kubelet's pod-resources API lists it (or it is too fresh to be listed yet).
    # Slices of an allocation the kubelet does not list count as unconfirmed, not allocated.
    listed: bool = True
    # The extended resource it was made under ("" where unknown), and whether this node no
    # longer serves that name (a reload renamed it): held until the kubelet frees it.
    resource_name: str = ""
    retired_resource: bool = False
    grants: tuple[DeviceGrant, ...] = ()
    source: str = SOURCE_DEVICE_PLUGIN
    claim: str = ""
    # A pod's init container's, which has finished (pod-resources lists regular containers only;
    # the kubelet's checkpoint names it): its devices stay the pod's until the pod goes.
    init_container: bool = False


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One container's use of one GPU, in one snapshot.

    A container is known by its allocation; namespace, pod and container stay "" until the
    kubelet's pod-resources API has named it. Ratios are 0..1, averaged over the compute window.
    `processes` are its GPU processes on this GPU, as the backend measured them."""

    allocation_id: str
    gpu_uuid: str
    gpu_index: int
    slices: int
    memory_used_bytes: int
    memory_limit_bytes: int
    sm_utilization_ratio: float
    compute_share_ratio: float
    processes: tuple[ProcessSample, ...] = ()
    namespace: str = ""
    pod: str = ""
    container: str = ""
    # What it is guaranteed of the GPU's memory (its request, docs/design.md §15): at most its
    # limit; None where it is the limit.
    memory_request_bytes: int | None = None
    # Enforcement state (the enforcer fills these): the fraction of each duty cycle its processes
    # may run (None when not throttled), and the total time they have spent stopped.
    duty_cycle_ratio: float | None = None
    throttled_seconds_total: float = 0.0
    # The share of the GPU it may use now (docs/design.md §4): compute_share_ratio, raised under
    # work-conserving sharing by time others leave idle. None until the enforcer has decided.
    entitlement_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class DraDevice:
    """DRA mode: a GPU (or MIG device) as the node's ResourceSlice publishes it, what the claims
    prepared on it consumed (the sums of their grants there) and what is left for more claims.
    `full`: no claim fits any more, as less memory or compute is left than the request
    policy's minimum (the config's `dra.memory.min`, `dra.compute.min`)."""

    name: str
    memory_claimed_bytes: int
    memory_free_bytes: int
    compute_claimed_ratio: float
    compute_free_ratio: float
    claims: int
    full: bool


@dataclass(frozen=True, slots=True)
class GpuUsage:
    """One GPU in one snapshot: the backend's reading plus what the daemon derived from it."""

    reading: GpuReading
    # SM utilisation averaged over the compute window, 0..1; None where the GPU does not report it.
    sm_utilization_ratio: float | None
    slices_total: int = 0
    slices_allocated: int = 0
    slices_unhealthy: int = 0
    # Slices held by an allocation that the kubelet has not listed in the seconds after it was
    # made (its pod deleted before a refresh, a non-restartable init container): neither free
    # nor surely allocated.
    slices_unconfirmed: int = 0
    # GPU processes that belong to no allocation of this daemon: counted, never acted upon.
    unattributed: tuple[ProcessSample, ...] = ()
    # GPU processes that claimed an allocation their pod does not hold (per the kubelet's
    # checkpoint): never charged to, or acted on for, the allocation they claimed.
    misattributed: tuple[ProcessSample, ...] = ()
    # (PID, pod UID) of the unattributed processes that run in a pod's cgroup: that pod's use
    # outside its GPU containers (a sidecar), never charged to them.
    unattributed_pods: tuple[tuple[int, str], ...] = ()
    # DRA mode: the device the driver publishes for it; None in device-plugin mode, and for a
    # GPU it publishes no device of (one in MIG mode: its MIG devices are the devices).
    dra: DraDevice | None = None

    @property
    def info(self) -> GpuInfo:
        return self.reading.info

    @property
    def slices_free(self) -> int:
        return (
            self.slices_total
            - self.slices_allocated
            - self.slices_unhealthy
            - self.slices_unconfirmed
        )


@dataclass(frozen=True, slots=True)
class EnforcementCount:
    """How many times the enforcer took `action` for `kind` on one container and GPU."""

    allocation_id: str
    gpu_uuid: str
    kind: str  # "memory" | "compute"
    action: str  # "kill" | "throttle" | "monitor"; a dry run: "would_kill" | "would_throttle"
    count: int
    namespace: str = ""
    pod: str = ""
    container: str = ""


@dataclass(frozen=True, slots=True)
class MpsNamespace:
    """An MPS v3 namespace held for one container (device plugin) or claim (DRA): every client
    whose pipe directory is `pipe_directory` shares its caps on the GPUs it holds."""

    # The allocation ID or claim UID it was made for.
    owner: str
    server: str
    name: str
    # `<mps.root>/pipe/<server>/<name>`: what the container mounts (read-only, at the same
    # path) and names in CUDA_MPS_PIPE_DIRECTORY.
    pipe_directory: str
    gpu_uuids: tuple[str, ...]
    active_thread_percentage: int
    pinned_memory_mib: int


@dataclass(frozen=True, slots=True)
class MpsStatus:
    """The node's MPS control daemon, as the daemon that supervises it sees it."""

    up: bool = False
    pid: int | None = None
    # Times it was found dead (or not answering) and started again.
    restarts_total: int = 0
    # Monotonic time since which it has been down; 0 while up.
    down_since_s: float = 0.0
    pipe_directory: str = ""
    # Why it is down, or why the last start or command failed; "" when all is well.
    error: str = ""
    # Changes made through the control socket behind the daemon's back, each undone: (what,
    # count), what being pinned_mem_limit, active_thread_percentage, quit or namespace.
    drift_total: tuple[tuple[str, int], ...] = ()
    # The MPS protocol it runs: 2, or 3 (namespaces) where the driver has it.
    protocol: int = 2
    # MPS clients terminated through the control daemon before a stop (a drain), and clients
    # stopped without one because the control daemon could not be reached.
    drains_total: int = 0
    undrained_total: int = 0
    # Wedges found (a drain past its bound, a canary that hung), each followed by a restart.
    wedges_total: int = 0
    # Why the last canary failed without hanging ("" when it passed or none ran).
    canary_error: str = ""
    # MPS v3: the namespaces held, by owner.
    namespaces: tuple[MpsNamespace, ...] = ()
    # MPS clients running as root (PIDs): under multiuser MPS one can raise its own caps or
    # delete another container's namespace.
    root_clients: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DaemonHealth:
    """The daemon's own state, for /healthz and the self-metrics."""

    registered: bool = False
    # Monotonic time since which the plugin has not been registered; 0 while registered.
    unregistered_since_s: float = 0.0
    registrations_total: int = 0
    registration_failures_total: int = 0
    last_poll_success_s: float = 0.0  # wall-clock time of the last successful poll, 0 = never
    poll_failures_consecutive: int = 0
    pod_resources_ok: bool = False
    # None unless mps.enabled.
    mps: MpsStatus | None = None
    # How long the poll loop waits between polls now: pollInterval, or idlePollInterval while no
    # slice is allocated and no GPU process runs (`polling_idle`).
    poll_interval_s: float = 0.0
    polling_idle: bool = False
    # When the plugin was last unregistered, on the wall clock (for /status, which says how long
    # ago that was); 0 while registered.
    unregistered_since_wall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """Everything the exporter, /status and the enforcer read, replaced whole after every poll.

    `stale` is true when the latest poll failed and these figures are from an earlier one."""

    taken_at_s: float
    node_name: str
    gpus: tuple[GpuUsage, ...] = ()
    containers: tuple[ContainerUsage, ...] = ()
    allocations: tuple[AllocationRecord, ...] = ()
    stale: bool = False
    health: DaemonHealth = field(default_factory=DaemonHealth)
    enforcement: tuple[EnforcementCount, ...] = ()
    # Signals the enforcer decided on but did not send, by reason (moved, permission_denied).
    signals_not_sent: tuple[tuple[str, int], ...] = ()
    # How the kubelet is served: SOURCE_DEVICE_PLUGIN (slices) or SOURCE_DRA (devices, claims).
    kubelet_api: str = SOURCE_DEVICE_PLUGIN
    # The memory limits the driver enforces (docs/design.md §15).
    memory_limits: MemoryLimitsView = field(default_factory=MemoryLimitsView)
