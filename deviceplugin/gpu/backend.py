"""The seam between the daemon and the GPUs.

Shaped after what NVML offers, so that the real backend and the fake one answer the same way:
- inventory: per GPU, nvmlDeviceGetUUID/Index/Name/MemoryInfo/MinorNumber/PciInfo/MigMode;
- usage: per GPU, nvmlDeviceGetMemoryInfo().used and nvmlDeviceGetUtilizationRates().gpu;
- processes: nvmlDeviceGetComputeRunningProcesses (pid, usedGpuMemory, which may be unknown);
- per-process SM utilisation: nvmlDeviceGetProcessUtilization, averaged since the previous call;
- health: from NVML events (Xid, ECC) and from calls that fail with GPU_IS_LOST.

A backend is polled from one place (the poll loop), off the event loop, one call at a time.
"""

from __future__ import annotations

from typing import Protocol

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
