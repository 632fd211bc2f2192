"""MIG on real hardware: the nvml backend's MIG devices against `nvidia-smi -L`.

Skipped without an NVIDIA GPU (tests/gpu/conftest.py), and, with the reason, when no GPU of the
node is in MIG mode: these tests never change a GPU's MIG mode or layout. On a node with GPUs in
MIG mode (an A100, H100 or H200 partitioned by nvidia-smi or mig-parted) they check that every MIG
device nvidia-smi lists is read, with the same UUID and profile name, under the right GPU, that
the MIG devices' memory adds up within their GPU's, and that none reports a utilisation figure."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from deviceplugin.config import HealthConfig
from deviceplugin.gpu.nvml import NvmlBackend

pytestmark = pytest.mark.gpu

_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[^)]+)\)$")
# "  MIG 1g.10gb     Device  0: (UUID: MIG-...)"; older drivers: "MIG-GPU-<uuid>/<gi>/<ci>".
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)$")


@dataclass
class ListedGpu:
    index: int
    name: str
    uuid: str
    mig: dict[str, str] = field(default_factory=dict)  # MIG UUID -> profile


def nvidia_smi_list() -> list[ListedGpu]:
    """`nvidia-smi -L`, parsed: the GPUs and, under each, its MIG devices."""
    out = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    gpus: list[ListedGpu] = []
    for line in out.splitlines():
        if match := _GPU_LINE.match(line.strip()):
            gpus.append(ListedGpu(int(match[1]), match[2], match[3]))
        elif (match := _MIG_LINE.match(line)) and gpus:
            gpus[-1].mig[match[3]] = match[1]
    return gpus


@pytest.fixture(scope="module")
def listed() -> list[ListedGpu]:
    gpus = nvidia_smi_list()
    if not any(g.mig for g in gpus):
        pytest.skip("no GPU of this node is in MIG mode with MIG devices (nvidia-smi -L)")
    return gpus


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    b = NvmlBackend(HealthConfig(), call_timeout_s=5.0, process_list_interval_s=0.0)
    try:
        yield b
    finally:
        b.close()


def test_mig_devices_match_nvidia_smi(listed: list[ListedGpu], backend: NvmlBackend) -> None:
    reading = backend.poll()
    by_parent: dict[str, dict[str, str]] = {}
    for gpu in reading.gpus:
        if gpu.info.is_mig_device:
            by_parent.setdefault(gpu.info.parent_uuid, {})[gpu.info.uuid] = gpu.info.mig_profile

    for listed_gpu in listed:
        parent = next(g for g in reading.gpus if g.info.uuid == listed_gpu.uuid)
        assert parent.info.mig_enabled == bool(listed_gpu.mig), listed_gpu
        assert by_parent.get(listed_gpu.uuid, {}) == listed_gpu.mig


def test_mig_devices_memory_ids_and_no_utilisation(
    listed: list[ListedGpu], backend: NvmlBackend
) -> None:
    reading = backend.poll()
    for listed_gpu in listed:
        if not listed_gpu.mig:
            continue
        parent = next(g for g in reading.gpus if g.info.uuid == listed_gpu.uuid)
        devices = [g for g in reading.gpus if g.info.parent_uuid == listed_gpu.uuid]
        assert sum(d.info.memory_total_bytes for d in devices) <= parent.info.memory_total_bytes
        instances = [(d.info.gpu_instance_id, d.info.compute_instance_id) for d in devices]
        assert len(set(instances)) == len(instances)
        # Each has its own slot under the GPU: its <GPU index>:<MIG index> name is unique.
        slots = [d.info.mig_index for d in devices]
        assert None not in slots
        assert len(set(slots)) == len(slots), slots
        for device in devices:
            assert device.healthy, device.health_reason
            assert device.info.index == listed_gpu.index
            assert device.memory_used_bytes is not None
            assert 0 <= device.memory_used_bytes <= device.info.memory_total_bytes
            # NVML has no utilisation per MIG device: none is reported.
            assert device.sm_util_percent is None
            assert all(p.sm_util_percent is None for p in device.processes)
