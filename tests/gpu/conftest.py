"""Real-GPU tests (`@pytest.mark.gpu`): skipped, with the reason, on a machine without an NVIDIA
GPU and driver, so that a plain `pytest` reports them as skipped rather than as errors."""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

from deviceplugin.config import HealthConfig
from deviceplugin.errors import BackendError
from deviceplugin.gpu.nvml import NvmlBackend


@functools.cache
def no_gpu_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA GPU: nvidia-smi is not installed"
    try:
        listed = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no NVIDIA GPU: nvidia-smi -L failed: {e}"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"no NVIDIA GPU: nvidia-smi -L says {(listed.stderr or listed.stdout).strip()!r}"
    try:
        NvmlBackend(HealthConfig(enabled=False)).close()
    except BackendError as e:
        return f"NVML cannot start: {e}"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = no_gpu_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
