"""The seam between the daemon and the GPUs.

Shaped after what NVML offers, so that the real backend and the fake one answer the same way:
- inventory: per GPU, nvmlDeviceGetUUID/Index/Name/MemoryInfo/MinorNumber/PciInfo/MigMode;
- usage: per GPU, nvmlDeviceGetMemoryInfo().used and nvmlDeviceGetUtilizationRates().gpu;
- processes: nvmlDeviceGetComputeRunningProcesses (pid, usedGpuMemory, which may be unknown);
- per-process SM utilisation: nvmlDeviceGetProcessUtilization, averaged since the previous call;
- health: from NVML events (Xid, ECC) and from calls that fail with GPU_IS_LOST;
- memory partitions (docs/design.md §15): per GPU what its driver can enforce of its memory
  (dmem, misc or nothing: polling), and a cgroup's limits set, read and cleared through
  nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1.

A backend is polled from one place (the poll loop), off the event loop, one call at a time; the
memory-limit calls come from any thread, beside the polls. `open_backend` opens the one a command
line names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from deviceplugin.config import Config
from deviceplugin.errors import BackendError
from deviceplugin.model import NodeReading
from deviceplugin.partitions import MemoryLimits, PartitionSupport


class PartitionBackend(Protocol):
    """GPU memory partitions (docs/design.md §15). The backend, not the daemon, says what each
    GPU can do; every call may come from any thread, beside the polls, and blocks at most the
    backend's call timeout.

    A cgroup is named by its path from the root of the unified hierarchy ("/kubepods.slice/...");
    the backend joins it to the hierarchy's mount it was given. Limits are bytes; a hard limit
    of LIMIT_MAX is none. Every refusal raises MemoryLimitError naming the GPU, the cgroup and
    the NVML code (`code`, `code_name`)."""

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        """Per GPU UUID, how its memory can be enforced: `driver-dmem`, `driver-misc`, or
        `poll` with the reason. A GPU (or MIG device) not listed is polled."""
        ...

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None:
        """Set the cgroup's soft and hard limit on the GPU (0 <= soft <= hard)."""
        ...

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        """The cgroup's limits on the GPU as the driver reads them; None when none is set."""
        ...

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        """Clear the cgroup's limits on the GPU: soft to 0 first, then hard to MAX (see
        deviceplugin.partitions.clear_limits). Whether any limit was set."""
        ...


class GpuBackend(PartitionBackend, Protocol):
    """A source of GPU readings. Implementations are not required to be thread-safe: the daemon
    calls `poll` from one worker at a time and `close` once, after the last poll."""

    @property
    def name(self) -> str:
        """A short description for logs, e.g. "fake:/tmp/state.json" or "nvml"."""
        ...

    def poll(self) -> NodeReading:
        """Read every GPU: facts, health, memory and utilisation, and processes with their usage
        since the previous poll. Raises BackendError when nothing can be read at all; a problem
        with one GPU is reported as that GPU's health, not raised."""
        ...

    def close(self) -> None:
        """Release the backend's resources (threads, NVML). Idempotent."""
        ...

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Have `wake` called, from any thread, when the backend learns between two polls of
        something the next poll should report at once (a GPU turned unhealthy by an Xid): the
        poll loop then polls without waiting out its interval."""
        ...


def no_wake() -> None:
    """The `set_wake` callback of a backend whose poll loop is not running."""


def open_backend(
    spec: str,
    config: Config | None = None,
    *,
    cgroup_mount: Path = Path("/sys/fs/cgroup"),
    probe_root: str | None = None,
    pod_roots: tuple[str, ...] = (),
) -> GpuBackend:
    """`fake:PATH` or `nvml`. Raises BackendError with what to do instead. `config` (default:
    the defaults) sets the nvml backend's health checks and call timeout. Memory partitions
    (docs/design.md §15): `cgroup_mount` is the unified hierarchy as the daemon sees it; the nvml
    backend probes each GPU under `probe_root` (None: no probe, every GPU polled) and checks dmem
    down to `pod_roots`."""
    if spec.startswith("fake:"):
        from deviceplugin.gpu.fake import FakeBackend  # noqa: PLC0415 (only the chosen backend)

        path = spec.removeprefix("fake:")
        if not path:
            raise BackendError("--backend fake:PATH needs the path of a state file")
        return FakeBackend(Path(path), cgroup_root=cgroup_mount)
    if spec == "nvml":
        from deviceplugin.gpu.nvml import open_nvml_backend  # noqa: PLC0415 (pynvml only here)
        from deviceplugin.gpu.nvml.partitions import CgroupHost  # noqa: PLC0415

        return open_nvml_backend(
            config or Config(), CgroupHost(cgroup_mount, probe_root, pod_roots)
        )
    raise BackendError(f"unknown backend {spec!r}: use nvml or fake:PATH")
