"""The Allocate response for one container (docs/design.md §3), as plain data.

Pure: device IDs + inventory + config -> ContainerAllocation. The gRPC servicer turns the result
into protobuf and maps AllocationError to INVALID_ARGUMENT.

Validation comes first and is all-or-nothing: every bad ID (duplicate, not advertised, unhealthy)
is named in one message, and nothing is handed out when any is bad.

What the container gets:

- `NVIDIA_VISIBLE_DEVICES`: the distinct GPUs of its slices, by UUID, in GPU index order. That order
  fixes the CUDA ordinals the container sees, so the per-ordinal variables below use it too.
- `VGPU_ALLOCATION_ID`: `model.allocation_id` of the slice IDs; the monitor reads it from
  `/proc/<pid>/environ` to attribute processes, and it can be recomputed from pod-resources.
- `VGPU_MEMORY_LIMIT_MIB_<i>` and `VGPU_COMPUTE_SHARE_PERCENT_<i>` per visible ordinal i: k slices
  of a GPU give k times a slice's memory and `floor(k * 100 / replicas)` percent of its compute,
  computed in integers so that 3 of 3 slices is exactly 100.
- With MPS, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in CUDA's per-device form (`0=20480M,1=10240M`, the
  same ordinals), and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. The latter is one value for every device
  of an MPS client, so it is the smallest per-GPU share: never more than any GPU's quota. MPS
  rejects 0, so it is at least 1.

Device-list strategies, any combination (the config's `deviceListStrategy`; an empty list means the
default, `envvar`):

- `envvar`: the UUIDs in `NVIDIA_VISIBLE_DEVICES`.
- `volume-mounts`: one mount per GPU, `/dev/null` -> `/var/run/nvidia-container-devices/<UUID>`,
  read-only. The NVIDIA container runtime, with `accept-nvidia-visible-devices-as-volume-mounts`,
  reads the GPU list from these mount points, so a pod cannot widen its GPUs through its env.
  Without `envvar`, `NVIDIA_VISIBLE_DEVICES` is set to that directory, which is what the runtime
  looks for in that mode.
- `cdi-annotations`: the annotation `cdi.k8s.io/vgpu-device-plugin_<allocation id>` listing
  `nvidia.com/gpu=<UUID>` per GPU, for runtimes that read CDI requests from annotations.
- `cdi-cri`: the same CDI device names in the CRI's CDIDevices field.
- `device-specs`: the device nodes themselves (`/dev/nvidiactl`, `/dev/nvidia-uvm`,
  `/dev/nvidia-uvm-tools`, then `/dev/nvidia<minor>` per GPU), same path on host and in container.

With neither `envvar` nor `volume-mounts`, `NVIDIA_VISIBLE_DEVICES` is `void`: the NVIDIA runtime
then injects nothing on its own, and the GPUs come only from CDI or the device specs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from deviceplugin.config import AllocationConfig, DeviceListStrategy, MpsConfig
from deviceplugin.errors import AllocationError
from deviceplugin.model import (
    ContainerAllocation,
    DeviceNodeSpec,
    GpuInfo,
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

VISIBLE_DEVICES_VOID = "void"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/vgpu-device-plugin_"
CDI_KIND = "nvidia.com/gpu"
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
GPU_DEVICE_NODE_PREFIX = "/dev/nvidia"

MIB = 1 << 20


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


def _gpu_info(inventory: Inventory, first: Slice) -> tuple[GpuInfo, int]:
    """The GPU of a slice and its replica count, from the inventory's plan."""
    plan = inventory.plan_for(first.id.gpu_uuid)
    if plan is None or not plan.sliced:
        raise AllocationError(
            f'device ID "{first.device_id}" belongs to GPU {first.id.gpu_uuid}, '
            "which this node does not slice"
        )
    return plan.gpu, plan.replicas


def build_container_allocation(
    device_ids: Sequence[str],
    inventory: Inventory,
    cfg: AllocationConfig,
    mps: MpsConfig,
) -> ContainerAllocation:
    """What one container gets for `device_ids`. Raises AllocationError naming every bad ID."""
    slices = _validate(device_ids, inventory)
    slices.sort(key=lambda s: (s.gpu_index, s.id.gpu_uuid, s.id.n))  # SliceId's order, faster

    by_gpu: dict[str, list[Slice]] = {}
    for s in slices:
        by_gpu.setdefault(s.id.gpu_uuid, []).append(s)

    alloc_id = allocation_id(s.device_id for s in slices)
    envs: dict[str, str] = {}
    gpus: list[GpuInfo] = []
    memory_mib: list[int] = []
    share_percent: list[int] = []
    for gpu_slices in by_gpu.values():
        gpu, replicas = _gpu_info(inventory, gpu_slices[0])
        gpus.append(gpu)
        memory_mib.append(sum(s.memory_limit_bytes for s in gpu_slices) // MIB)
        share_percent.append(len(gpu_slices) * 100 // replicas)
    uuids = [g.uuid for g in gpus]

    strategies = set(cfg.device_list_strategy) or {DeviceListStrategy.ENVVAR}
    if DeviceListStrategy.ENVVAR in strategies:
        envs[ENV_VISIBLE_DEVICES] = ",".join(uuids)
    elif DeviceListStrategy.VOLUME_MOUNTS in strategies:
        envs[ENV_VISIBLE_DEVICES] = VOLUME_MOUNTS_ROOT
    else:
        envs[ENV_VISIBLE_DEVICES] = VISIBLE_DEVICES_VOID
    envs[ENV_ALLOCATION_ID] = alloc_id
    for ordinal, (mib, percent) in enumerate(zip(memory_mib, share_percent, strict=True)):
        envs[f"{ENV_MEMORY_LIMIT_MIB_PREFIX}{ordinal}"] = str(mib)
        envs[f"{ENV_COMPUTE_SHARE_PERCENT_PREFIX}{ordinal}"] = str(percent)
    if mps.enabled:
        envs[ENV_MPS_PINNED_DEVICE_MEM_LIMIT] = ",".join(
            f"{ordinal}={mib}M" for ordinal, mib in enumerate(memory_mib)
        )
        envs[ENV_MPS_ACTIVE_THREAD_PERCENTAGE] = str(max(1, min(share_percent)))

    mounts: tuple[MountSpec, ...] = ()
    if DeviceListStrategy.VOLUME_MOUNTS in strategies:
        mounts = tuple(
            MountSpec(
                container_path=f"{VOLUME_MOUNTS_ROOT}/{uuid}",
                host_path=VOLUME_MOUNT_HOST_PATH,
                read_only=True,
            )
            for uuid in uuids
        )

    cdi_names = tuple(f"{CDI_KIND}={uuid}" for uuid in uuids)
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
        mounts=mounts,
        devices=devices,
        annotations=annotations,
        cdi_devices=cdi_devices,
    )


__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "ENV_ALLOCATION_ID",
    "ENV_COMPUTE_SHARE_PERCENT_PREFIX",
    "ENV_MEMORY_LIMIT_MIB_PREFIX",
    "ENV_MPS_ACTIVE_THREAD_PERCENTAGE",
    "ENV_MPS_PINNED_DEVICE_MEM_LIMIT",
    "ENV_VISIBLE_DEVICES",
    "build_container_allocation",
]
