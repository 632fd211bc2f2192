"""GPU memory partitions: what a GPU's driver can enforce per cgroup, and the limits it holds.

From driver R615 (CUDA 13.4) NVIDIA's driver limits the GPU memory of a cgroup
(`nvmlDeviceSetMemoryLimits_v1`): a *hard* limit, past which an allocation fails with
out-of-memory in the process, and a *soft* limit, the part that is guaranteed. Two stores exist
(docs/design.md §15): `dmem`, the kernel's device-memory controller (hierarchical: a limit on a
cgroup bounds everything below it, and every ancestor's `dmem.min` carries the sum of its leaves'
soft limits), and `misc`, the driver's own map (not hierarchical: a cgroup is bounded by its
nearest limited ancestor-or-self only). Elsewhere memory is enforced by polling (docs/design.md §4).

Plain values, and the one rule both GPU backends follow to clear a limit. No I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

# NVML_DEVICE_MEMORY_LIMIT_MAX: a hard limit of "no limit".
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF
# The NVML return codes a memory-limit call is known to give, by name (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_CODE_NAMES = {
    NVML_ERROR_INVALID_ARGUMENT: "NVML_ERROR_INVALID_ARGUMENT",
    NVML_ERROR_NOT_SUPPORTED: "NVML_ERROR_NOT_SUPPORTED",
    NVML_ERROR_NO_PERMISSION: "NVML_ERROR_NO_PERMISSION",
    NVML_ERROR_NOT_FOUND: "NVML_ERROR_NOT_FOUND",
    NVML_ERROR_FUNCTION_NOT_FOUND: "NVML_ERROR_FUNCTION_NOT_FOUND",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
}
# What each code means when a memory-limit call returns it, for log lines and hook answers.
NVML_CODE_MEANINGS = {
    NVML_ERROR_INVALID_ARGUMENT: "the driver refused the values (soft above hard?)",
    NVML_ERROR_NOT_SUPPORTED: "no memory partitions on this GPU or driver, or the root cgroup",
    NVML_ERROR_NO_PERMISSION: "setting a limit needs root",
    NVML_ERROR_NOT_FOUND: "no such cgroup, or it has no dmem files (its parent lacks +dmem)",
    NVML_ERROR_FUNCTION_NOT_FOUND: "the driver predates memory partitions (R615)",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "the NVML binding does not match the driver",
}
MIN_DRIVER_MAJOR = 615


def nvml_code_name(code: int) -> str:
    return NVML_CODE_NAMES.get(code, f"NVML error {code}")


class PartitionMode(enum.StrEnum):
    """How a GPU's memory is enforced: by the driver through dmem or misc, or by polling."""

    DMEM = "driver-dmem"
    MISC = "driver-misc"
    POLL = "poll"


class PollCause(enum.StrEnum):
    """Why a GPU's memory is polled rather than partitioned by its driver (a metric label)."""

    NONE = ""
    DRIVER_TOO_OLD = "driver-too-old"  # driver major below 615, or unknown
    FUNCTION_NOT_FOUND = "function-not-found"  # the driver or the binding lacks the calls
    NOT_CGROUP_V2 = "not-cgroup-v2"  # the cgroup mount is not the unified hierarchy
    MIG = "mig"  # MIG mode: the driver partitions no MIG device
    NO_PARTITIONS = "no-partitions"  # the driver offers neither store on this GPU
    DMEM_GAP = "dmem-gap"  # a level down to the pods' cgroups lacks +dmem
    NO_PROBE_ROOT = "no-probe-root"  # nowhere to make the cgroup that confirms it
    PROBE_FAILED = "probe-failed"  # the set/get/clear on a throw-away cgroup failed
    UNHEALTHY = "unhealthy"  # the GPU is unhealthy: a set might not be answered
    OFF = "off"  # the daemon applies no memory limits (serve --memory-limits off)


@dataclass(frozen=True, slots=True)
class PartitionSupport:
    """What one GPU's driver can enforce. `reason` says, for a human, why a GPU is polled (empty
    otherwise); `dmem_gaps` names the cgroups (from the hierarchy's root) whose
    `cgroup.subtree_control` lacks `dmem` on the way down to the pods' cgroups."""

    mode: PartitionMode
    cause: PollCause = PollCause.NONE
    reason: str = ""
    dmem_gaps: tuple[str, ...] = ()

    @property
    def enforced(self) -> bool:
        return self.mode is not PartitionMode.POLL

    def describe(self) -> str:
        """`driver-dmem`, or `poll (reason)`, for a log line."""
        return self.mode.value if self.enforced else f"{self.mode.value} ({self.reason})"


def polled(cause: PollCause, reason: str, gaps: tuple[str, ...] = ()) -> PartitionSupport:
    return PartitionSupport(PartitionMode.POLL, cause, reason, gaps)


@dataclass(frozen=True, slots=True)
class GpuLimit:
    """The memory a container is given on one GPU, in bytes: `soft_bytes` (its request, what
    is guaranteed) and `hard_bytes` (its limit, past which an allocation fails)."""

    soft_bytes: int
    hard_bytes: int

    def __post_init__(self) -> None:
        check_limit_values(self.soft_bytes, self.hard_bytes)

    def __add__(self, other: GpuLimit) -> GpuLimit:
        return GpuLimit(
            min(LIMIT_MAX, self.soft_bytes + other.soft_bytes),
            min(LIMIT_MAX, self.hard_bytes + other.hard_bytes),
        )


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """A cgroup's limits on one GPU, as the driver reads them back, in bytes. `used_bytes` is the
    GPU memory charged to the cgroup (NVML's `currentUsed`), None where not known."""

    soft_bytes: int
    hard_bytes: int
    used_bytes: int | None = None

    @property
    def unlimited(self) -> bool:
        """Soft 0 with hard MAX: how the driver reads a cgroup with no limit."""
        return self.soft_bytes == 0 and self.hard_bytes == LIMIT_MAX


def cgroup_ancestors(cgroup: str) -> list[str]:
    """The cgroups above `cgroup` (a path from the hierarchy's root), nearest first, the root
    excluded: "/a/b/c" -> ["/a/b", "/a"]."""
    found: list[str] = []
    parent = cgroup.rsplit("/", 1)[0]
    while parent:
        found.append(parent)
        parent = parent.rsplit("/", 1)[0]
    return found


def driver_major(version: str | None) -> int | None:
    """The major number of a driver version ("615.71.09" -> 615); None when it is not one."""
    if not version:
        return None
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def rfc3339(wall_s: float) -> str:
    """A wall-clock time as RFC 3339 in UTC with microseconds: `2026-12-04T22:23:01.123456Z`."""
    moment = datetime.fromtimestamp(wall_s, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def check_limit_values(soft_bytes: int, hard_bytes: int) -> None:
    """ValueError unless 0 <= soft <= hard <= LIMIT_MAX: values the daemon never sends."""
    if not 0 <= soft_bytes <= hard_bytes <= LIMIT_MAX:
        raise ValueError(
            f"memory limits must satisfy 0 <= soft <= hard <= {LIMIT_MAX}, got soft={soft_bytes}"
            f" hard={hard_bytes}"
        )


class LimitCalls(Protocol):
    """A backend's set and get of one cgroup's limits on one GPU."""

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None: ...

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None: ...


def read_back(soft_bytes: int, hard_bytes: int, used_bytes: int) -> MemoryLimits | None:
    """What a Get read, None when it is no limit (soft 0, hard MAX)."""
    limits = MemoryLimits(soft_bytes, hard_bytes, used_bytes)
    return None if limits.unlimited else limits


def clear_on(backend: LimitCalls, gpu_uuid: str, cgroup: str) -> bool:
    """`clear_limits` through a backend's own calls."""
    return clear_limits(
        lambda: backend.get_memory_limits(gpu_uuid, cgroup),
        lambda soft, hard: backend.set_memory_limits(gpu_uuid, cgroup, soft, hard),
    )


def clear_limits(
    get: Callable[[], MemoryLimits | None], set_limits: Callable[[int, int], None]
) -> bool:
    """Clear a cgroup's limits on one GPU with the backend's `get` and `set_limits(soft, hard)`:
    soft to 0 first (keeping the hard limit), then hard to MAX. On dmem a leaf removed while its
    soft limit stands leaves that reservation in every ancestor's `dmem.min`; zeroing it first
    means that whatever happens to the second call, nothing leaks. Whether anything was set."""
    current = get()
    if current is None or current.unlimited:
        return False
    if current.soft_bytes:
        set_limits(0, current.hard_bytes)
    if current.hard_bytes != LIMIT_MAX:
        set_limits(0, LIMIT_MAX)
    return True
