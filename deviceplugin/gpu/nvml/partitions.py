"""GPU memory partitions on the node's real GPUs (docs/design.md §15): what each GPU's driver can
enforce, and the calls that set, read and clear a cgroup's limits.

Detection, once per node at start (`node_facts`) and per GPU on its worker once its inventory is
read (`detect`), the first failing check naming the reason to poll:
1. the driver's major version is 615 or newer, and the binding (nvidia-ml-py) has
   nvmlDeviceSetMemoryLimits_v1;
2. the hierarchy's mount is cgroup v2 (statfs magic 0x63677270);
3. the GPU is not in MIG mode (the driver partitions no MIG device);
4. the store: `dmem` when the hierarchy's `dmem.capacity` lists the GPU's PCI bus ID
   (`nvidia/<bus id>/vidmem <bytes>`), `misc` otherwise; on dmem every level from the root down
   to the pods' cgroups must enable `dmem` for its children (`cgroup.subtree_control`), or the
   pods' leaves have no dmem files to take a limit;
5. a real set (soft 0, hard 1 GiB or half the GPU), get (the same read back) and clear (soft 0,
   hard MAX) on a throw-away cgroup `<probe root>/vgpu-probe-<pid>-<index>`, made for it and
   removed after; FUNCTION_NOT_FOUND there is a driver without the calls, any other code a
   failed probe.

The calls take the structs of the binding (`c_nvmlSetMemoryLimits_v1_t`,
`c_nvmlGetMemoryLimits_v1_t`), whose `nameSpace` is the cgroup's directory as this process sees
it (`<mount><cgroup>`), as bytes. `nvml` is the pynvml module or the driver model: nothing here
imports pynvml.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin.gpu.cgrouptree import subtree_controllers
from deviceplugin.gpu.nvml.library import NvmlLibrary
from deviceplugin.model import GpuInfo
from deviceplugin.partitions import (
    LIMIT_MAX,
    MIN_DRIVER_MAJOR,
    NVML_CODE_MEANINGS,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    PartitionMode,
    PartitionSupport,
    PollCause,
    driver_major,
    polled,
)
from deviceplugin.safefs import open_directory

logger = logging.getLogger(__name__)

CGROUP2_SUPER_MAGIC = 0x63677270
PROBE_HARD_BYTES = 1 << 30
_MAX_CAPACITY_BYTES = 64 << 10


def filesystem_magic(path: Path) -> int:
    """The file system type of `path` (statfs's f_type). OSError when it cannot be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class CgroupHost:
    """The unified hierarchy as the daemon sees it: its `mount`, the cgroup (from the
    hierarchy's root) under which the daemon may make its probes (`probe_root`; None: none may
    be made, and every GPU is polled), and the cgroups its pods live under (`pod_roots`, e.g.
    "/kubepods.slice/kubepods-burstable.slice"), whose way down must enable dmem."""

    mount: Path = Path("/sys/fs/cgroup")
    probe_root: str | None = None
    pod_roots: tuple[str, ...] = ()
    fs_magic: Callable[[Path], int] = filesystem_magic

    def path(self, cgroup: str) -> str:
        return str(self.mount) if cgroup == "/" else f"{self.mount}{cgroup}"


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What detection reads once per node: a reason every GPU is polled (or None), the PCI bus
    IDs `dmem.capacity` lists, and the levels that lack dmem on the way to the pods."""

    problem: PartitionSupport | None
    dmem_devices: frozenset[str] = frozenset()
    dmem_gaps: tuple[str, ...] = ()


def normal_bus_id(bus_id: str) -> str:
    """A PCI bus ID as sysfs writes it: lower case, a 4-digit domain (00000000:17:00.0 ->
    0000:17:00.0)."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep:
        return bus_id.strip().lower()
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id.strip().lower()


def dmem_devices(mount: Path) -> frozenset[str]:
    """The NVIDIA GPUs (PCI bus IDs) the dmem controller accounts, from `dmem.capacity`."""
    try:
        with open(mount / "dmem.capacity", "rb") as f:
            content = f.read(_MAX_CAPACITY_BYTES).decode("ascii", "replace")
    except OSError:
        return frozenset()
    found: set[str] = set()
    for line in content.splitlines():
        region = line.split()[0] if line.split() else ""
        parts = region.split("/")
        if len(parts) == 3 and parts[0] == "nvidia":
            found.add(normal_bus_id(parts[1]))
    return frozenset(found)


def dmem_gaps(host: CgroupHost) -> tuple[str, ...]:
    """The cgroups from the root down to each pod root (inclusive) whose `cgroup.subtree_control`
    lacks dmem, in order."""
    gaps: list[str] = []
    for root in host.pod_roots:
        parts = [p for p in root.split("/") if p]
        levels = ["/"] + ["/" + "/".join(parts[: n + 1]) for n in range(len(parts))]
        for level in levels:
            if level not in gaps and "dmem" not in subtree_controllers(Path(host.path(level))):
                gaps.append(level)
    return tuple(gaps)


def node_facts(nvml: Any, host: CgroupHost, driver_version: str | None) -> NodeFacts:
    major = driver_major(driver_version)
    if major is None or major < MIN_DRIVER_MAJOR:
        return NodeFacts(
            polled(
                PollCause.DRIVER_TOO_OLD,
                f"driver {driver_version or 'of unknown version'} predates memory partitions "
                f"({MIN_DRIVER_MAJOR})",
            )
        )
    if not hasattr(nvml, "nvmlDeviceSetMemoryLimits_v1"):
        return NodeFacts(
            polled(
                PollCause.FUNCTION_NOT_FOUND,
                "the NVML binding lacks nvmlDeviceSetMemoryLimits_v1: nvidia-ml-py 13.615 or "
                "newer has it",
            )
        )
    try:
        magic = host.fs_magic(host.mount)
    except OSError as e:
        return NodeFacts(
            polled(PollCause.NOT_CGROUP_V2, f"{host.mount} cannot be read: {e.strerror or e}")
        )
    if magic != CGROUP2_SUPER_MAGIC:
        return NodeFacts(
            polled(
                PollCause.NOT_CGROUP_V2,
                f"{host.mount} is not the cgroup v2 hierarchy (file system magic {magic:#x})",
            )
        )
    return NodeFacts(None, dmem_devices(host.mount), dmem_gaps(host))


class LimitCalls:
    """nvmlDeviceSetMemoryLimits_v1 and nvmlDeviceGetMemoryLimits_v1 with the binding's structs.
    Raise the binding's NVMLError."""

    def __init__(self, lib: NvmlLibrary) -> None:
        self._nvml = lib.nvml

    def set(self, handle: object, name_space: str, soft_bytes: int, hard_bytes: int) -> None:
        limits = self._nvml.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = os.fsencode(name_space)
        limits.softLimit = soft_bytes
        limits.hardLimit = hard_bytes
        self._nvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)

    def get(self, handle: object, name_space: str) -> tuple[int, int, int]:
        """(soft, hard, current used) in bytes."""
        limits = self._nvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = os.fsencode(name_space)
        self._nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
        return int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed)


def detect(
    lib: NvmlLibrary, handle: object, info: GpuInfo, host: CgroupHost, facts: NodeFacts
) -> PartitionSupport:
    """What the GPU's driver can enforce (see the module's docstring). On the GPU's worker."""
    if facts.problem is not None:
        return facts.problem
    if info.mig_enabled:
        return polled(PollCause.MIG, "MIG mode is on: the driver partitions no MIG device")
    dmem = info.pci_bus_id is not None and normal_bus_id(info.pci_bus_id) in facts.dmem_devices
    if dmem and facts.dmem_gaps:
        return polled(
            PollCause.DMEM_GAP,
            "dmem is not enabled for the children of "
            + ", ".join(facts.dmem_gaps)
            + " (cgroup.subtree_control): the pods' cgroups would take no limit",
            facts.dmem_gaps,
        )
    if host.probe_root is None:
        return polled(
            PollCause.NO_PROBE_ROOT, "no cgroup is configured for the probe that confirms it"
        )
    failed = _probe(lib, handle, info, host)
    if failed is not None:
        return failed
    return PartitionSupport(PartitionMode.DMEM if dmem else PartitionMode.MISC)


def _probe(
    lib: NvmlLibrary, handle: object, info: GpuInfo, host: CgroupHost
) -> PartitionSupport | None:
    """Set, read back and clear a limit on a throw-away cgroup; None when all went as asked."""
    assert host.probe_root is not None
    name = f"vgpu-probe-{os.getpid()}-{info.index}"
    cgroup = f"{host.probe_root.rstrip('/')}/{name}"
    try:
        parent = open_directory(host.path(host.probe_root), create=False)
    except OSError as e:
        return polled(
            PollCause.PROBE_FAILED,
            f"the probe's cgroup root {host.probe_root} cannot be opened: {e}",
        )
    calls = LimitCalls(lib)
    hard = min(PROBE_HARD_BYTES, max(1, info.memory_total_bytes // 2))
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent.fd)
        try:
            calls.set(handle, host.path(cgroup), 0, hard)
            soft_read, hard_read, _ = calls.get(handle, host.path(cgroup))
            calls.set(handle, host.path(cgroup), 0, LIMIT_MAX)
        except lib.nvml_error as e:
            code = lib.code(e)
            cause = (
                PollCause.FUNCTION_NOT_FOUND
                if code == NVML_ERROR_FUNCTION_NOT_FOUND
                else PollCause.PROBE_FAILED
            )
            meaning = NVML_CODE_MEANINGS.get(code, "")
            return polled(
                cause,
                f"the probe on {cgroup} failed with {lib.error_name(e)}"
                + (f": {meaning}" if meaning else ""),
            )
        if (soft_read, hard_read) != (0, hard):
            return polled(
                PollCause.PROBE_FAILED,
                f"the probe on {cgroup} set soft 0 hard {hard} and read back soft {soft_read} "
                f"hard {hard_read}",
            )
        return None
    except OSError as e:
        return polled(PollCause.PROBE_FAILED, f"the probe's cgroup {cgroup} cannot be made: {e}")
    finally:
        try:
            os.rmdir(name, dir_fd=parent.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("probe cgroup not removed cgroup=%s error=%s", cgroup, e)
        os.close(parent.fd)
