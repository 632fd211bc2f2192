"""The seam between the daemon and the GPUs.

Shaped after what NVML offers, so that the real backend and the fake one answer the same way:
- inventory: per GPU, nvmlDeviceGetUUID/Index/Name/MemoryInfo/MinorNumber/PciInfo/MigMode;
- usage: per GPU, nvmlDeviceGetMemoryInfo().used and nvmlDeviceGetUtilizationRates().gpu;
- processes: nvmlDeviceGetComputeRunningProcesses (pid, usedGpuMemory, which may be unknown);
- per-process SM utilisation: nvmlDeviceGetProcessUtilization, averaged since the previous call;
- health: from NVML events (Xid, ECC) and from calls that fail with GPU_IS_LOST.

A backend is polled from one place (the poll loop), off the event loop, one call at a time.
`open_backend` opens the one a command line names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from deviceplugin.config import Config
from deviceplugin.errors import BackendError
from deviceplugin.model import NodeReading


class GpuBackend(Protocol):
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


def open_backend(spec: str, config: Config | None = None) -> GpuBackend:
    """`fake:PATH` or `nvml`. Raises BackendError with what to do instead. `config` (default:
    the defaults) sets the nvml backend's health checks and call timeout."""
    if spec.startswith("fake:"):
        from deviceplugin.gpu.fake import FakeBackend  # noqa: PLC0415 (only the chosen backend)

        path = spec.removeprefix("fake:")
        if not path:
            raise BackendError("--backend fake:PATH needs the path of a state file")
        return FakeBackend(Path(path))
    if spec == "nvml":
        from deviceplugin.gpu.nvml import open_nvml_backend  # noqa: PLC0415 (pynvml only here)

        return open_nvml_backend(config or Config())
    raise BackendError(f"unknown backend {spec!r}: use nvml or fake:PATH")
