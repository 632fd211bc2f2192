"""What a GPU is: its inventory, read once per GPU at start, its event registration, and the
facts of its MIG devices.

Inventory: UUID, index, name, total memory, minor number, PCI bus ID, MIG mode, and the NUMA node
from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`; NVML's own nvmlDeviceGetNumaNodeId names the
NUMA node a coherent GPU's memory forms, not the CPUs the GPU sits next to, which is what the
kubelet's topology hint needs). MIG mode is read once, at start: switching it needs a GPU reset
and a restart of the daemon.

A MIG device's GPU and compute instance IDs and profile name (`mig_profile_name` of
nvmlDeviceGetAttributes) do not change while it exists: they are read when it is first seen and
kept by UUID until it is gone (the devices themselves are listed at every poll, see `sampling`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from deviceplugin.gpu.nvml.library import NvmlLibrary, text
from deviceplugin.gpu.nvml.workers import GpuWorker
from deviceplugin.model import GpuInfo, mig_profile_name

logger = logging.getLogger(__name__)


def numa_node_from_sysfs(sysfs_root: Path, pci_bus_id: str) -> int | None:
    """The NUMA node of a PCI device from sysfs, or None when the kernel does not know it.

    NVML writes bus IDs with an 8-digit domain (`00000000:17:00.0`); sysfs uses 4 digits, in lower
    case (`0000:17:00.0`). The kernel writes -1 when the device has no NUMA affinity."""
    bus_id = pci_bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and len(domain) == 8:
        # sysfs drops the leading zeros down to 4 digits: 00000000 -> 0000, 00010000 -> 10000.
        bus_id = f"{int(domain, 16):04x}:{rest}"
    path = sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        logger.debug("no NUMA node in sysfs path=%s", path)
        return None
    return node if node >= 0 else None


class GpuInventory(GpuWorker):
    """A GPU's worker with its static facts, and those of its MIG devices."""

    def __init__(self, lib: NvmlLibrary, index: int, clock: Callable[[], float]) -> None:
        # MIG device facts that do not change while it exists, by UUID: (GI, CI, profile).
        self._mig_facts: dict[str, tuple[int, int, str]] = {}
        super().__init__(lib, index, clock)

    def read_inventory(self, sysfs_root: Path) -> GpuInfo:
        """The GPU's static facts. Raises GpuFaultError when its identity cannot be read."""
        self.handle = self._required("nvmlDeviceGetHandleByIndex", self.index)
        uuid = text(self._required("nvmlDeviceGetUUID", self.handle))
        self.uuid = uuid
        name = text(self._required("nvmlDeviceGetName", self.handle))
        memory_total = int(self._required("nvmlDeviceGetMemoryInfo", self.handle).total)
        minor = self._optional("minor number", "nvmlDeviceGetMinorNumber", self.handle)
        if minor is None:
            logger.warning("gpu minor number unknown %s; using the index instead", self.label())
            minor = self.index
        pci = self._optional("PCI info", "nvmlDeviceGetPciInfo", self.handle)
        bus_id = text(pci.busId) if pci is not None else None
        mig = self._optional("MIG mode", "nvmlDeviceGetMigMode", self.handle)
        mig_enabled = mig is not None and int(mig[0]) == self._nvml.NVML_DEVICE_MIG_ENABLE
        numa = numa_node_from_sysfs(sysfs_root, bus_id) if bus_id else None
        return GpuInfo(
            uuid=uuid,
            index=self.index,
            name=name,
            memory_total_bytes=memory_total,
            minor=int(minor),
            numa_node=numa,
            pci_bus_id=bus_id,
            mig_enabled=mig_enabled,
        )

    def register_events(self, event_set: object, mask: int) -> None:
        """Register this GPU's Xid and ECC events on the set, where it supports them."""
        supported = self._optional("events", "nvmlDeviceGetSupportedEventTypes", self.handle)
        wanted = mask & int(supported or 0)
        if not wanted:
            logger.warning(
                "gpu reports no Xid or ECC events %s; its health comes from polling alone",
                self.label(),
            )
            return
        try:
            self.call("nvmlDeviceRegisterEvents", self.handle, wanted, event_set)
        except self._lib.nvml_error as e:
            if self._lib.is_unsupported(e):
                self._disable("events", f"nvmlDeviceRegisterEvents: {e}")
                return
            raise self._fault("nvmlDeviceRegisterEvents", e) from e
        logger.debug("gpu events registered %s mask=%#x", self.label(), wanted)

    def _mig_device_facts(self, handle: object, uuid: str) -> tuple[int, int, str]:
        """A MIG device's (GPU instance ID, compute instance ID, profile), read when first seen."""
        facts = self._mig_facts.get(uuid)
        if facts is None:
            attributes = self.call("nvmlDeviceGetAttributes", handle)
            facts = (
                int(self.call("nvmlDeviceGetGpuInstanceId", handle)),
                int(self.call("nvmlDeviceGetComputeInstanceId", handle)),
                mig_profile_name(
                    int(attributes.gpuInstanceSliceCount),
                    int(attributes.computeInstanceSliceCount),
                    int(attributes.memorySizeMB),
                ),
            )
            self._mig_facts[uuid] = facts
            logger.info(
                "MIG device found %s mig_uuid=%s gpu_instance_id=%d compute_instance_id=%d "
                "profile=%s; NVML has no utilisation per MIG device: memory and processes only",
                self.label(),
                uuid,
                *facts,
            )
        return facts

    def _forget_mig_devices_but(self, seen: set[str]) -> None:
        """Drop the facts of MIG devices that are gone (a re-partitioning)."""
        self._mig_facts = {u: f for u, f in self._mig_facts.items() if u in seen}
