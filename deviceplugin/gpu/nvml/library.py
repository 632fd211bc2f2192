"""The NVML library as the backend meets it: starting and stopping it, and its errors.

`nvml` is the pynvml module (from the nvidia-ml-py distribution), or in tests a driver model
with the same functions; nothing here imports pynvml itself.

Errors: every NVML error gets a log line and a decision, made by the module that called.
- At start, a missing library or driver, or no permission, raises BackendError with one line that
  says what to check and that `--backend fake:PATH` runs without a GPU.
- NOT_SUPPORTED (or FUNCTION_NOT_FOUND) from a measurement turns that measurement off for that GPU,
  with one log line; it is reported as unknown (None) from then on.
- NOT_FOUND from nvmlDeviceGetProcessUtilization means "no new samples".
- INSUFFICIENT_SIZE from a process list (processes started between NVML's two calls) keeps the last
  list until the next poll.
- GPU_IS_LOST and any other error mark that GPU unhealthy; its last good reading is reported
  with healthy=False and the error in health_reason.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from typing import Any

from deviceplugin.errors import BackendError

logger = logging.getLogger(__name__)

INIT_HINT = "use --backend fake:PATH to try vgpu without a GPU"
# What a failed nvmlInit means, by error name, for the one-line start-up error.
_INIT_PROBLEMS: Mapping[str, str] = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "the NVML library libnvidia-ml.so.1 was not found; is the NVIDIA driver installed on this"
        " node and mounted into this container?"
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the NVIDIA kernel driver is not loaded; is this a GPU node, and does nvidia-smi work?"
    ),
    "NVML_ERROR_NO_PERMISSION": (
        "no permission to open the GPUs' device nodes (/dev/nvidia*); give the container access"
        " to them"
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVML library and the loaded kernel driver are different versions; reload the driver"
        " or reboot the node"
    ),
}


def text(value: object) -> str:
    """pynvml returns str from most calls, bytes from ctypes fields and old bindings."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def handle_key(handle: object) -> object:
    """A hashable key for a device handle. NVML hands out one pointer per device, so a handle in
    an event compares equal to the one nvmlDeviceGetHandleByIndex gave, by address."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
    except (TypeError, ctypes.ArgumentError):
        return handle


def cuda_version_text(version: int) -> str:
    """NVML's CUDA driver version number (12040) as text (12.4)."""
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlLibrary:
    """The NVML module with its error classes and codes named: `nvml_error` is the class every
    NVML error derives from, `mismatch_errors` those a binding raises for a call the driver does
    not have (empty where the binding has none)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.nvml_error: type[Exception] = nvml.NVMLError
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self.mismatch_errors: tuple[type[Exception], ...] = (mismatch,) if mismatch else ()
        self._error_names = {getattr(nvml, n): n for n in dir(nvml) if n.startswith("NVML_ERROR_")}

    def init(self) -> None:
        """nvmlInit, or BackendError with one line that says what to check."""
        try:
            self.nvml.nvmlInit()
        except self.nvml_error as e:
            name = self.error_name(e)
            problem = _INIT_PROBLEMS.get(name, f"NVML could not start ({e})")
            raise BackendError(
                f"cannot start the nvml backend: {problem} [{name}]; {INIT_HINT}"
            ) from e

    def shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml_error as e:
            logger.warning("nvmlShutdown failed error=%s", self.describe_error(e))

    def code(self, error: Exception) -> int:
        value = getattr(error, "value", None)
        return value if isinstance(value, int) else -1

    def error_name(self, error: Exception) -> str:
        return self._error_names.get(self.code(error), f"NVML error {self.code(error)}")

    def describe_error(self, error: Exception) -> str:
        """`NVML_ERROR_GPU_IS_LOST (GPU is lost)`."""
        return f"{self.error_name(error)} ({error})"

    def is_unsupported(self, error: Exception) -> bool:
        return self.code(error) in (
            self.nvml.NVML_ERROR_NOT_SUPPORTED,
            self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        )
