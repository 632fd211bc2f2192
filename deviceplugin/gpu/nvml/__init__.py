"""The nvml GPU backend: the node's real GPUs, read through NVML (`import pynvml`, from the
nvidia-ml-py distribution). This package is the only code that imports pynvml, and within it
only `backend` does, as the default of NvmlBackend's `nvml` argument; tests pass a driver model
with the same functions.

By concern, each module with its own docstring:
- `library`: NVML itself: init and shutdown, error names and what each error means, byte decoding.
- `workers`: one worker thread per GPU, which makes every NVML call on that GPU, so that one slow
  or hung GPU delays the others by at most one call timeout, once.
- `inventory`: what a GPU is (read once at start: UUID, memory, PCI bus ID, NUMA node, MIG mode;
  its event registration) and the facts of its MIG devices.
- `sampling`: what a GPU is doing, at every poll: memory, utilisation, process lists (paced, the
  newest call the driver offers) and per-process SM samples, and its MIG devices.
- `health`: the Xid and ECC event watcher, hung calls, the recovery policy, per-GPU counters.
- `backend`: NvmlBackend, the GpuBackend that composes them, and `open_nvml_backend`.
"""

from deviceplugin.gpu.nvml.backend import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_EVENT_WAIT_TIMEOUT_S,
    DEFAULT_PROCESS_LIST_INTERVAL_S,
    NvmlBackend,
    open_nvml_backend,
)
from deviceplugin.gpu.nvml.health import (
    DOUBLE_BIT_ECC_XID,
    NO_INSTANCE,
    XID_MEANINGS,
    GpuHealthStats,
    xid_meaning,
)
from deviceplugin.gpu.nvml.inventory import numa_node_from_sysfs

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_EVENT_WAIT_TIMEOUT_S",
    "DEFAULT_PROCESS_LIST_INTERVAL_S",
    "DOUBLE_BIT_ECC_XID",
    "NO_INSTANCE",
    "XID_MEANINGS",
    "GpuHealthStats",
    "NvmlBackend",
    "numa_node_from_sysfs",
    "open_nvml_backend",
    "xid_meaning",
]
