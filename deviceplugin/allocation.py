"""The Allocate response for one container (docs/design.md §3), as plain data.

Pure: device IDs + inventory + config -> ContainerAllocation. The gRPC servicer turns the result
into protobuf and maps AllocationError to INVALID_ARGUMENT.

Validation comes first and is all-or-nothing: every bad ID (duplicate, not advertised, unhealthy)
is named in one message, and nothing is handed out when any is bad.

What the container gets:

- `NVIDIA_VISIBLE_DEVICES`: the distinct GPUs of its slices, by UUID, in GPU index order. That order
  fixes the CUDA ordinals the container sees, so the per-ordinal variables below use it too.
  With `allocation.deviceIDStrategy: index` the runtime is told NVML's indices instead, as
  NVIDIA's plugin tells it: `0` for a GPU, `<GPU index>:<MIG index>` for a MIG device (the slot
  NVML gives it under its GPU), here and in the volume mounts and CDI names below. Each device is
  named once, however many of its slices the container holds. Everything else keeps UUIDs:
  the per-device keys, `gpu_uuids` (attribution, metrics).
- `VGPU_ALLOCATION_ID`: `model.allocation_id` of the slice IDs; the monitor reads it from
  `/proc/<pid>/environ` to attribute processes, and it can be recomputed from pod-resources.
- `VGPU_MEMORY_LIMIT_MIB_<i>` and `VGPU_COMPUTE_SHARE_PERCENT_<i>` per visible ordinal i: k slices
  of a GPU give k times a slice's memory and `floor(k * 100 / replicas)` percent of its compute,
  computed in integers so that 3 of 3 slices is exactly 100.
- Per device, under keys named after it (`<UUID>` upper-cased, every character outside A-Z and
  0-9 turned into `_`): `VGPU_ALLOCATION_ID_<UUID>`, `VGPU_MEMORY_LIMIT_MIB_<UUID>`,
  `VGPU_COMPUTE_SHARE_PERCENT_<UUID>` and (with hints) `VGPU_MEMORY_FRACTION_<UUID>`. A container
  that holds slices of several resources (a full-GPU slice and a MIG slice) gets one Allocate
  answer per resource, and the kubelet keeps one value per env key across them (the first, in
  an order of its own): every key above that is not named after a device then holds one
  resource's value, while these never collide.
- With MPS, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in CUDA's per-device form (`0=20480M,1=10240M`, the
  same ordinals), and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. The latter is one value for every device
  of an MPS client, so it is the smallest per-GPU share: never more than any GPU's quota. MPS
  rejects 0, so it is at least 1.

Device-list strategies, any combination (the config's `deviceListStrategy`; an empty list means the
default, `envvar`):

- `envvar`: the UUIDs (or indices) in `NVIDIA_VISIBLE_DEVICES`.
- `volume-mounts`: one mount per GPU, `/dev/null` -> `/var/run/nvidia-container-devices/<UUID>`
  (or `<index>`),
  read-only. The NVIDIA container runtime, with `accept-nvidia-visible-devices-as-volume-mounts`,
  reads the GPU list from these mount points, so a pod cannot widen its GPUs through its env.
  Without `envvar`, `NVIDIA_VISIBLE_DEVICES` is set to that directory, which is what the runtime
  looks for in that mode.
- `cdi-annotations`: the annotation `cdi.k8s.io/vgpu-device-plugin_<allocation id>` listing
  `nvidia.com/gpu=<UUID>` (or `=<index>`, the names `nvidia-ctk cdi generate` gives too) per
  GPU, for runtimes that read CDI requests from annotations.
- `cdi-cri`: the same CDI device names in the CRI's CDIDevices field.
- `device-specs`: the device nodes themselves (`/dev/nvidiactl`, `/dev/nvidia-uvm`,
  `/dev/nvidia-uvm-tools`, then `/dev/nvidia<minor>` per GPU), same path on host and in container.

With neither `envvar` nor `volume-mounts`, `NVIDIA_VISIBLE_DEVICES` is `void`: the NVIDIA runtime
then injects nothing on its own, and the GPUs come only from CDI or the device specs.

Where the node serves several resources (`several_resources`: the mixed MIG strategy), `envvar`
alone cannot be right for a container that holds slices of more than one: the kubelet keeps one
`NVIDIA_VISIBLE_DEVICES` of them. Mounts are merged by container path and CDI devices by name,
so each resource's devices reach the runtime. There `envvar` also brings the `volume-mounts`
mounts (`NVIDIA_VISIBLE_DEVICES` keeps its list): a toolkit that accepts the mounts gives the
container every device; one that does not reads the env as before.

Framework hints (unless `allocation.frameworkHints: false`), so that frameworks that reserve GPU
memory up front fit their slices instead of being killed for it. A GPU's fraction is
(the container's memory limit on it - `allocation.contextReserve`) / the GPU's memory, rounded
down to two decimals, computed in integers; the reserve stays free for the CUDA context and the
libraries' workspaces, which live outside a framework's pool:

- `VGPU_MEMORY_FRACTION_<i>` per visible ordinal i: for PyTorch's
  `torch.cuda.set_per_process_memory_fraction` and vLLM's `--gpu-memory-utilization`.
- `XLA_PYTHON_CLIENT_MEM_FRACTION` (JAX): one value for every GPU of the process, so the
  fraction of the tightest GPU.
- `TF_FORCE_GPU_ALLOW_GROWTH=true` (TensorFlow): allocate as needed rather than all at start.

A GPU whose limit is no more than the reserve gets no fraction (it would be 0), and then neither
does JAX; TensorFlow's hint stands.

With MPS the fractions are of one slice, whatever the container holds: the GPU holds each MPS
client process to one slice's memory, so a JAX process told its container's k slices would fail
to reserve them at start. The container still gets k slices' worth across its processes.

With MPS, the container also gets the MPS pipe directory (`<mps.root>/pipe`, mounted at the same
path, named by `CUDA_MPS_PIPE_DIRECTORY`) and the MPS server's shared memory (`<mps.root>/shm`
mounted at `/dev/shm`), without which a client cannot reach the server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.config import AllocationConfig, DeviceIdStrategy, DeviceListStrategy, MpsConfig
from deviceplugin.errors import AllocationError
from deviceplugin.model import (
    ContainerAllocation,
    DeviceGrant,
    DeviceNodeSpec,
    GpuInfo,
    GpuPlan,
    Inventory,
    MountSpec,
    Slice,
    allocation_id,
)

ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_ALLOCATION_ID = "VGPU_ALLOCATION_ID"
ENV_MEMORY_LIMIT_MIB_PREFIX = "VGPU_MEMORY_LIMIT_MIB_"
ENV_COMPUTE_SHARE_PERCENT_PREFIX = "VGPU_COMPUTE_SHARE_PERCENT_"
ENV_MPS_PINNED_DEVICE_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_MPS_ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_XLA_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ENV_TF_ALLOW_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
ENV_MEMORY_FRACTION_PREFIX = "VGPU_MEMORY_FRACTION_"
MPS_SHM_CONTAINER_PATH = "/dev/shm"  # noqa: S108 (the path MPS uses, not a temp file)

VISIBLE_DEVICES_VOID = "void"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/vgpu-device-plugin_"
CDI_KIND = "nvidia.com/gpu"
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
GPU_DEVICE_NODE_PREFIX = "/dev/nvidia"

MIB = 1 << 20


def mps_pipe_directory(root: str) -> str:
    return f"{root.rstrip('/')}/pipe"


def mps_log_directory(root: str) -> str:
    return f"{root.rstrip('/')}/log"


def mps_shm_directory(root: str) -> str:
    return f"{root.rstrip('/')}/shm"


@dataclass(frozen=True, slots=True)
class MpsDefaults:
    """What the MPS control daemon holds each new client to: one slice's memory per GPU (by
    UUID, in MiB) and one slice's share of the threads. The control daemon's thread percentage
    is one value for every GPU, so it is the smallest slice share of any GPU; MPS rejects 0."""

    pinned_mem_limit_mib: tuple[tuple[str, int], ...] = ()
    active_thread_percentage: int | None = None

    def commands(self) -> tuple[str, ...]:
        """The control commands that set these defaults, one per line of stdin."""
        lines = [
            f"set_default_device_pinned_mem_limit {uuid} {mib}M"
            for uuid, mib in self.pinned_mem_limit_mib
        ]
        if self.active_thread_percentage is not None:
            lines.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        return tuple(lines)


def mps_defaults(all_plans: Sequence[GpuPlan]) -> MpsDefaults:
    """One slice's limits on every sliced GPU of the plan."""
    plans = [p for p in all_plans if p.sliced]
    if not plans:
        return MpsDefaults()
    return MpsDefaults(
        pinned_mem_limit_mib=tuple((p.gpu.uuid, p.memory_per_slice_bytes // MIB) for p in plans),
        active_thread_percentage=max(1, min(100 // p.replicas for p in plans)),
    )


def memory_fraction_hundredths(limit_bytes: int, reserve_bytes: int, total_bytes: int) -> int:
    """floor(100 * (limit - reserve) / total), at least 0: a fraction in hundredths."""
    if total_bytes <= 0:
        return 0
    return max(0, (limit_bytes - reserve_bytes) * 100 // total_bytes)


def format_hundredths(hundredths: int) -> str:
    """1 -> "0.01", 75 -> "0.75", 100 -> "1.00"."""
    return f"{hundredths // 100}.{hundredths % 100:02d}"


def framework_hints(
    limits_bytes: Sequence[int], totals_bytes: Sequence[int], reserve_bytes: int
) -> dict[str, str]:
    """The framework hints for a container with `limits_bytes[i]` of memory on its visible GPU
    i of `totals_bytes[i]`."""
    fractions = [
        memory_fraction_hundredths(limit, reserve_bytes, total)
        for limit, total in zip(limits_bytes, totals_bytes, strict=True)
    ]
    envs = {
        f"{ENV_MEMORY_FRACTION_PREFIX}{ordinal}": format_hundredths(f)
        for ordinal, f in enumerate(fractions)
        if f > 0
    }
    if fractions and min(fractions) > 0:
        envs[ENV_XLA_MEM_FRACTION] = format_hundredths(min(fractions))
    envs[ENV_TF_ALLOW_GROWTH] = "true"
    return envs


def _validate(device_ids: Sequence[str], inventory: Inventory) -> list[Slice]:
    if not device_ids:
        raise AllocationError("the request names no device IDs")
    problems: list[str] = []
    counts = Counter(device_ids)
    problems.extend(f'device ID "{i}" is requested {n} times' for i, n in counts.items() if n > 1)
    slices: list[Slice] = []
    for device_id in counts:
        found = inventory.by_id.get(device_id)
        if found is None:
            problems.append(f'unknown device ID "{device_id}": not advertised by this node')
        elif not found.healthy:
            problems.append(f'device ID "{device_id}" is unhealthy')
        else:
            slices.append(found)
    if problems:
        raise AllocationError("; ".join(problems))
    return slices


def burst_limit(request_bytes: int, slices: int, limit_per_slice: int | None, total: int) -> int:
    """A container's memory limit on a GPU where it holds `slices` slices worth `request_bytes`:
    `limit_per_slice` times its slices (docs/design.md §15), never below its request nor above
    the GPU's memory; its request where the resource has no limit per slice."""
    if limit_per_slice is None:
        return request_bytes
    return max(request_bytes, min(total, slices * limit_per_slice))


def slice_grants(
    slices: Sequence[Slice],
    *,
    limit_per_slice: int | None = None,
    totals: Mapping[str, int] | None = None,
) -> tuple[DeviceGrant, ...]:
    """What `slices` give per GPU, in the order of their GPUs' first slices: the sum of their
    memory (the request) and of their compute shares, and how many they are; with
    `limit_per_slice` (and each GPU's memory in `totals`), a memory limit above the request.
    Allocate's grants; also what the current plan gives an allocation recovered without them."""
    by_gpu: dict[str, list[Slice]] = {}
    for s in slices:
        by_gpu.setdefault(s.id.gpu_uuid, []).append(s)
    grants: list[DeviceGrant] = []
    for uuid, held in by_gpu.items():
        request = sum(s.memory_limit_bytes for s in held)
        total = (totals or {}).get(uuid, request)
        limit = burst_limit(request, len(held), limit_per_slice, total)
        grants.append(
            DeviceGrant(
                uuid,
                limit,
                sum(s.compute_share_ratio for s in held),
                len(held),
                None if limit == request else request,
            )
        )
    return tuple(grants)


def _gpu_info(inventory: Inventory, first: Slice) -> tuple[GpuInfo, int]:
    """The GPU of a slice and its replica count, from the inventory's plan."""
    plan = inventory.plan_for(first.id.gpu_uuid)
    if plan is None or not plan.sliced:
        raise AllocationError(
            f'device ID "{first.device_id}" belongs to GPU {first.id.gpu_uuid}, '
            "which this node does not slice"
        )
    return plan.gpu, plan.replicas


def runtime_device_id(gpu: GpuInfo, strategy: DeviceIdStrategy) -> str:
    """What the container runtime is told a GPU or MIG device is called (NVIDIA's
    deviceIDStrategy): its UUID, or its NVML index (`<GPU index>:<MIG index>` for a MIG device).
    Raises AllocationError for a MIG device whose index under its GPU is not known."""
    if strategy is DeviceIdStrategy.UUID:
        return gpu.uuid
    if not gpu.is_mig_device:
        return str(gpu.index)
    if gpu.mig_index is None:
        raise AllocationError(
            f"MIG device {gpu.uuid} has no known MIG index for deviceIDStrategy: index; "
            "set deviceIDStrategy: uuid"
        )
    return f"{gpu.index}:{gpu.mig_index}"


def device_env_suffix(uuid: str) -> str:
    """The part of an env key that names a device: its UUID upper-cased, every character outside
    A-Z and 0-9 turned into `_` (`MIG-4f1e...` -> `MIG_4F1E...`)."""
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in uuid.upper())


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What a container holds of one visible device, in CUDA ordinal order: its memory, what
    one of its processes may hold there (less with MPS: one slice), its compute share in whole
    percent, and the device's memory."""

    uuid: str
    memory_bytes: int
    process_bytes: int
    share_percent: int
    total_bytes: int


def limits_env(
    alloc_id: str, devices: Sequence[DeviceLimits], cfg: AllocationConfig, mps: MpsConfig
) -> dict[str, str]:
    """The environment of §3 but for NVIDIA_VISIBLE_DEVICES: the allocation ID, the limits per
    ordinal and per device, the MPS variables, the framework hints. Allocate and a prepared DRA
    claim's CDI spec both carry it."""
    envs = {ENV_ALLOCATION_ID: alloc_id}
    memory_mib = [d.memory_bytes // MIB for d in devices]
    for ordinal, (mib, d) in enumerate(zip(memory_mib, devices, strict=True)):
        envs[f"{ENV_MEMORY_LIMIT_MIB_PREFIX}{ordinal}"] = str(mib)
        envs[f"{ENV_COMPUTE_SHARE_PERCENT_PREFIX}{ordinal}"] = str(d.share_percent)
    suffixes = [device_env_suffix(d.uuid) for d in devices]
    for suffix, mib, d in zip(suffixes, memory_mib, devices, strict=True):
        envs[f"{ENV_ALLOCATION_ID}_{suffix}"] = alloc_id
        envs[f"{ENV_MEMORY_LIMIT_MIB_PREFIX}{suffix}"] = str(mib)
        envs[f"{ENV_COMPUTE_SHARE_PERCENT_PREFIX}{suffix}"] = str(d.share_percent)
    if mps.enabled:
        envs[ENV_MPS_PINNED_DEVICE_MEM_LIMIT] = ",".join(
            f"{ordinal}={mib}M" for ordinal, mib in enumerate(memory_mib)
        )
        envs[ENV_MPS_ACTIVE_THREAD_PERCENTAGE] = str(max(1, min(d.share_percent for d in devices)))
        envs[ENV_MPS_PIPE_DIRECTORY] = mps_pipe_directory(mps.root)
    if cfg.framework_hints:
        hints = framework_hints(
            [d.process_bytes for d in devices],
            [d.total_bytes for d in devices],
            cfg.context_reserve_bytes,
        )
        for ordinal, suffix in enumerate(suffixes):
            fraction = hints.get(f"{ENV_MEMORY_FRACTION_PREFIX}{ordinal}")
            if fraction is not None:
                hints[f"{ENV_MEMORY_FRACTION_PREFIX}{suffix}"] = fraction
        envs.update(hints)
    return envs


def mps_mounts(mps: MpsConfig) -> list[MountSpec]:
    """With MPS on, what a container mounts to reach the node's control daemon."""
    if not mps.enabled:
        return []
    # The pipe directory read-only: the MPS client connects to sockets there (which needs no
    # write access to the mount), and a pod must not replace the control daemon's files.
    # /dev/shm read-write: the client shares memory with the MPS server through it.
    pipe = mps_pipe_directory(mps.root)
    return [
        MountSpec(container_path=pipe, host_path=pipe, read_only=True),
        MountSpec(
            container_path=MPS_SHM_CONTAINER_PATH,
            host_path=mps_shm_directory(mps.root),
            read_only=False,
        ),
    ]


def build_container_allocation(
    device_ids: Sequence[str],
    inventory: Inventory,
    cfg: AllocationConfig,
    mps: MpsConfig,
    *,
    several_resources: bool = False,
    limit_per_slice: int | None = None,
) -> ContainerAllocation:
    """What one container gets for `device_ids`. Raises AllocationError naming every bad ID.
    `several_resources`: the node serves more than one resource, so a container may hold slices
    of several (see the module's docstring). `limit_per_slice`: the resource's memory limit per
    slice (burst, `memoryLimits`): the slices are the request, this times them the limit."""
    slices = _validate(device_ids, inventory)
    if cfg.fail_requests_greater_than_one and len(slices) > 1:
        # NVIDIA's plugin's refusal, word for word, so that alerts on it keep matching.
        raise AllocationError(
            f"request for '{slices[0].resource_name}: {len(slices)}' too large: maximum request"
            " size for shared resources is 1"
        )
    slices.sort(key=lambda s: (s.gpu_index, s.id.gpu_uuid, s.id.n))  # SliceId's order, faster

    by_gpu: dict[str, list[Slice]] = {}
    for s in slices:
        by_gpu.setdefault(s.id.gpu_uuid, []).append(s)

    alloc_id = allocation_id(s.device_id for s in slices)
    envs: dict[str, str] = {}
    gpus: list[GpuInfo] = []
    limits: list[DeviceLimits] = []
    for gpu_slices in by_gpu.values():
        gpu, replicas = _gpu_info(inventory, gpu_slices[0])
        gpus.append(gpu)
        memory = sum(s.memory_limit_bytes for s in gpu_slices)
        limit = burst_limit(memory, len(gpu_slices), limit_per_slice, gpu.memory_total_bytes)
        # What one process may hold: with MPS, the GPU holds every client process to one slice,
        # whatever the container holds (a client cannot raise the control daemon's limit).
        # Frameworks are told of the request, not the limit: burst is reclaimed under pressure.
        process = min(s.memory_limit_bytes for s in gpu_slices) if mps.enabled else memory
        share = len(gpu_slices) * 100 // replicas
        limits.append(DeviceLimits(gpu.uuid, limit, process, share, gpu.memory_total_bytes))
    uuids = [g.uuid for g in gpus]
    # What the runtime is told each device is called; the daemon's own keys keep the UUIDs.
    runtime_ids = [runtime_device_id(g, cfg.device_id_strategy) for g in gpus]

    strategies = set(cfg.device_list_strategy) or {DeviceListStrategy.ENVVAR}
    # Env alone cannot name every device of a container holding several resources: the mounts
    # can, through a toolkit that reads them.
    mounts_too = several_resources and DeviceListStrategy.ENVVAR in strategies
    if DeviceListStrategy.ENVVAR in strategies:
        envs[ENV_VISIBLE_DEVICES] = ",".join(runtime_ids)
    elif DeviceListStrategy.VOLUME_MOUNTS in strategies:
        envs[ENV_VISIBLE_DEVICES] = VOLUME_MOUNTS_ROOT
    else:
        envs[ENV_VISIBLE_DEVICES] = VISIBLE_DEVICES_VOID
    envs.update(limits_env(alloc_id, limits, cfg, mps))

    mounts: list[MountSpec] = []
    if DeviceListStrategy.VOLUME_MOUNTS in strategies or mounts_too:
        mounts.extend(
            MountSpec(
                container_path=f"{VOLUME_MOUNTS_ROOT}/{device}",
                host_path=VOLUME_MOUNT_HOST_PATH,
                read_only=True,
            )
            for device in runtime_ids
        )
    mounts.extend(mps_mounts(mps))

    cdi_names = tuple(f"{CDI_KIND}={device}" for device in runtime_ids)
    annotations: dict[str, str] = {}
    if DeviceListStrategy.CDI_ANNOTATIONS in strategies:
        annotations[f"{CDI_ANNOTATION_PREFIX}{alloc_id}"] = ",".join(cdi_names)
    cdi_devices = cdi_names if DeviceListStrategy.CDI_CRI in strategies else ()

    devices: tuple[DeviceNodeSpec, ...] = ()
    if DeviceListStrategy.DEVICE_SPECS in strategies:
        paths = [*CONTROL_DEVICE_NODES, *(f"{GPU_DEVICE_NODE_PREFIX}{g.minor}" for g in gpus)]
        devices = tuple(
            DeviceNodeSpec(container_path=p, host_path=p, permissions="rw") for p in paths
        )

    return ContainerAllocation(
        allocation_id=alloc_id,
        slice_ids=tuple(s.device_id for s in slices),
        gpu_uuids=tuple(uuids),
        envs=envs,
        mounts=tuple(mounts),
        devices=devices,
        annotations=annotations,
        cdi_devices=cdi_devices,
        grants=slice_grants(
            slices,
            limit_per_slice=limit_per_slice,
            totals={g.uuid: g.memory_total_bytes for g in gpus},
        ),
    )


__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "ENV_ALLOCATION_ID",
    "ENV_COMPUTE_SHARE_PERCENT_PREFIX",
    "ENV_MEMORY_FRACTION_PREFIX",
    "ENV_MEMORY_LIMIT_MIB_PREFIX",
    "ENV_MPS_ACTIVE_THREAD_PERCENTAGE",
    "ENV_MPS_PINNED_DEVICE_MEM_LIMIT",
    "ENV_MPS_PIPE_DIRECTORY",
    "ENV_TF_ALLOW_GROWTH",
    "ENV_VISIBLE_DEVICES",
    "ENV_XLA_MEM_FRACTION",
    "DeviceLimits",
    "MpsDefaults",
    "build_container_allocation",
    "device_env_suffix",
    "format_hundredths",
    "framework_hints",
    "limits_env",
    "memory_fraction_hundredths",
    "mps_defaults",
    "mps_log_directory",
    "mps_mounts",
    "mps_pipe_directory",
    "mps_shm_directory",
    "runtime_device_id",
    "slice_grants",
]
