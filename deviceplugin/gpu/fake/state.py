"""What a fake GPU state file holds (docs/design.md §8): GPUs, their MIG devices and the real
processes listed as using them, as frozen values, and the JSON they are written back as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deviceplugin.model import GpuInfo
from deviceplugin.partitions import (
    MIN_DRIVER_MAJOR,
    PartitionMode,
    PartitionSupport,
    PollCause,
    driver_major,
    polled,
)


@dataclass(frozen=True, slots=True)
class FakeProcess:
    """A real process on this machine that the fake GPU reports as using it."""

    pid: int
    used_memory_bytes: int
    sm_demand_percent: float = 0


@dataclass(frozen=True, slots=True)
class FakeMigDevice:
    """One MIG device (a GPU instance with one compute instance) of a fake GPU in MIG mode."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    memory_total_bytes: int
    processes: tuple[FakeProcess, ...] = ()


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One fake GPU. `health_reason` explains an unhealthy GPU (like an Xid would). A GPU in MIG
    mode with a `mig` block reports its MIG devices, and its own `processes` are ignored."""

    uuid: str
    index: int
    name: str
    memory_total_bytes: int
    minor: int
    numa_node: int | None = None
    healthy: bool = True
    processes: tuple[FakeProcess, ...] = ()
    pci_bus_id: str | None = None
    mig_enabled: bool = False
    health_reason: str = ""
    mig_devices: tuple[FakeMigDevice, ...] = ()
    # Whether the file had a `mig` block (written back as one).
    mig_block: bool = False
    # The driver's version ("615.71"), and the store its memory partitions use (docs/design.md
    # §15): "dmem", "misc", or None for a driver that partitions nothing.
    driver_version: str | None = None
    memory_partitions: str | None = None

    def mig_info(self, device: FakeMigDevice) -> GpuInfo:
        """A MIG device as NVML reports it: its own UUID and memory, its parent's index, and
        its position in the GPU's `mig.devices` as its MIG index."""
        return GpuInfo(
            uuid=device.uuid,
            index=self.index,
            name=f"{self.name} MIG {device.profile}",
            memory_total_bytes=device.memory_total_bytes,
            minor=self.minor,
            numa_node=self.numa_node,
            pci_bus_id=self.pci_bus_id,
            parent_uuid=self.uuid,
            mig_profile=device.profile,
            gpu_instance_id=device.gpu_instance_id,
            compute_instance_id=device.compute_instance_id,
            mig_index=self.mig_devices.index(device),
        )

    @property
    def partition_support(self) -> PartitionSupport:
        """What this GPU's driver can enforce of its memory (docs/design.md §15): the store of
        `memory_partitions` on a driver of 615 or newer, out of MIG mode; polling otherwise."""
        if self.mig_enabled:
            return polled(PollCause.MIG, "MIG mode is on: the driver partitions no MIG device")
        if self.memory_partitions is None:
            return polled(
                PollCause.NO_PARTITIONS,
                "the driver offers no memory partitions on this GPU (memory_partitions unset)",
            )
        major = driver_major(self.driver_version)
        if major is None or major < MIN_DRIVER_MAJOR:
            return polled(
                PollCause.DRIVER_TOO_OLD,
                f"driver {self.driver_version} predates memory partitions ({MIN_DRIVER_MAJOR})",
            )
        if self.memory_partitions == "dmem":
            return PartitionSupport(PartitionMode.DMEM)
        return PartitionSupport(PartitionMode.MISC)

    @property
    def info(self) -> GpuInfo:
        return GpuInfo(
            uuid=self.uuid,
            index=self.index,
            name=self.name,
            memory_total_bytes=self.memory_total_bytes,
            minor=self.minor,
            numa_node=self.numa_node,
            pci_bus_id=self.pci_bus_id,
            mig_enabled=self.mig_enabled,
        )


@dataclass(frozen=True, slots=True)
class FakeState:
    """The content of a state file. GPUs keep the file's order."""

    gpus: tuple[FakeGpu, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The state as JSON data; `parse_state(state.to_json()) == state`. The optional keys beyond
        docs/design.md §8 (pci_bus_id, mig_enabled, health_reason, driver_version,
        memory_partitions) are written only when they are set."""
        gpus: list[dict[str, Any]] = []
        for gpu in self.gpus:
            entry: dict[str, Any] = {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "name": gpu.name,
                "memory_total_bytes": gpu.memory_total_bytes,
                "minor": gpu.minor,
                "numa_node": gpu.numa_node,
                "healthy": gpu.healthy,
                "processes": [
                    {
                        "pid": p.pid,
                        "used_memory_bytes": p.used_memory_bytes,
                        "sm_demand_percent": p.sm_demand_percent,
                    }
                    for p in gpu.processes
                ],
            }
            if gpu.pci_bus_id is not None:
                entry["pci_bus_id"] = gpu.pci_bus_id
            if gpu.mig_block:
                entry["mig"] = {
                    "enabled": gpu.mig_enabled,
                    "devices": [
                        {
                            "uuid": d.uuid,
                            "gpu_instance_id": d.gpu_instance_id,
                            "compute_instance_id": d.compute_instance_id,
                            "profile": d.profile,
                            "memory_total_bytes": d.memory_total_bytes,
                            "processes": [
                                {
                                    "pid": p.pid,
                                    "used_memory_bytes": p.used_memory_bytes,
                                    "sm_demand_percent": p.sm_demand_percent,
                                }
                                for p in d.processes
                            ],
                        }
                        for d in gpu.mig_devices
                    ],
                }
            elif gpu.mig_enabled:
                entry["mig_enabled"] = True
            if gpu.health_reason:
                entry["health_reason"] = gpu.health_reason
            if gpu.driver_version is not None:
                entry["driver_version"] = gpu.driver_version
            if gpu.memory_partitions is not None:
                entry["memory_partitions"] = gpu.memory_partitions
            gpus.append(entry)
        return {"gpus": gpus}
