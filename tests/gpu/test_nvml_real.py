"""The nvml backend on real hardware: the inventory against nvidia-smi, and a CUDA process started
by the test showing up with its memory and, under load, its SM utilisation.

Skipped without an NVIDIA GPU and driver (tests/gpu/conftest.py). The load test needs a Python
with CUDA-enabled torch (this interpreter or `python3` on PATH) and is skipped, with the reason,
without one. Runs unchanged on any NVIDIA GPU and driver (written on an H200-class machine's terms:
one or more GPUs, driver 5xx/6xx, possibly in MIG mode or inside a PID namespace)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deviceplugin.config import HealthConfig
from deviceplugin.gpu.nvml import NvmlBackend
from deviceplugin.model import GpuReading, ProcessSample

pytestmark = pytest.mark.gpu

GiB = 1024**3
MiB = 1024**2
LOAD_SECONDS = 40.0
READY_TIMEOUT_S = 180.0
APPEAR_TIMEOUT_S = 20.0

# Allocates 1 GiB on the one visible GPU, says "ready", then keeps the GPU busy with matmuls.
CHILD = r"""
import sys, time
import torch

device = torch.device("cuda:0")
hold = torch.empty(1 << 30, dtype=torch.uint8, device=device)
a = torch.randn(4096, 4096, device=device)
b = torch.randn(4096, 4096, device=device)
torch.cuda.synchronize()
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(8):
        c = a @ b
    torch.cuda.synchronize()
"""


def smi(*args: str) -> list[list[str]]:
    """nvidia-smi CSV output (noheader, nounits) as rows of stripped fields."""
    out = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [
        [field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()
    ]


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    # Generous timeouts: this is about answers, not latency.
    b = NvmlBackend(HealthConfig(), call_timeout_s=5.0, process_list_interval_s=0.0)
    try:
        yield b
    finally:
        b.close()


def test_inventory_matches_nvidia_smi(backend: NvmlBackend) -> None:
    rows = smi("--query-gpu=uuid,index,name,memory.total,pci.bus_id")
    # The GPUs themselves; MIG devices are compared in test_mig_real.py.
    gpus = [g for g in backend.poll().gpus if not g.info.is_mig_device]

    assert len(gpus) == len(rows)
    for gpu, (uuid, index, name, memory_mib, bus_id) in zip(gpus, rows, strict=True):
        info = gpu.info
        assert info.uuid == uuid
        assert info.index == int(index)
        assert info.name == name
        assert abs(info.memory_total_bytes // MiB - int(memory_mib)) <= 1, (info, memory_mib)
        assert (info.pci_bus_id or "").upper() == bus_id.upper()
        assert gpu.healthy, gpu.health_reason
        assert gpu.memory_used_bytes is not None
        assert 0 <= gpu.memory_used_bytes <= info.memory_total_bytes
    (driver,) = {row[0] for row in smi("--query-gpu=driver_version")}
    assert backend.driver_version == driver
    assert backend.cuda_version is not None
    assert backend.cuda_version.split(".")[0].isdigit()


def test_numa_nodes_are_those_of_sysfs(backend: NvmlBackend) -> None:
    for gpu in backend.poll().gpus:
        domain, _, rest = (gpu.info.pci_bus_id or "").lower().partition(":")
        path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}" / "numa_node"
        if not path.exists():
            assert gpu.info.numa_node is None
            continue
        node = int(path.read_text())
        assert gpu.info.numa_node == (node if node >= 0 else None)


@functools.cache
def torch_python() -> str | None:
    """A Python interpreter that can run CUDA with torch, or None."""
    candidates = [sys.executable, shutil.which("python3"), shutil.which("python")]
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            probe = subprocess.run(
                [
                    python,
                    "-c",
                    "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
                ],
                capture_output=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return python
    return None


@dataclass
class Load:
    process: subprocess.Popen[str]
    gpu_index: int
    baseline_pids: frozenset[int]

    def find(self, gpu: GpuReading) -> ProcessSample | None:
        """The load's process on `gpu`: by pid, or, inside a PID namespace where the driver
        reports host pids, the one new process holding at least 1 GiB."""
        for p in gpu.processes:
            if p.pid == self.process.pid:
                return p
        new = [
            p
            for p in gpu.processes
            if p.pid not in self.baseline_pids and (p.used_memory_bytes or 0) >= GiB
        ]
        return new[0] if len(new) == 1 else None


@pytest.fixture(scope="module")
def load(backend: NvmlBackend) -> Iterator[Load]:
    python = torch_python()
    if python is None:
        pytest.skip("no Python with CUDA-enabled torch here to start a CUDA process")
    gpu = backend.poll().gpus[0]
    if gpu.info.mig_enabled:
        pytest.skip(f"GPU {gpu.info.index} is in MIG mode; the load test needs a whole GPU")
    baseline = frozenset(p.pid for p in gpu.processes)
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=gpu.info.uuid)
    process = subprocess.Popen(
        [python, "-c", CHILD, str(LOAD_SECONDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = ""
        while time.monotonic() < deadline and process.poll() is None:
            line = process.stdout.readline()
            if line.strip() == "ready":
                break
        if line.strip() != "ready":
            process.kill()
            _, err = process.communicate(timeout=30)
            pytest.fail(
                f"the CUDA load did not start: rc={process.returncode} stderr={err[-2000:]}"
            )
        yield Load(process, gpu.info.index, baseline)
    finally:
        process.kill()
        process.wait(timeout=30)


def wait_for_sample(
    backend: NvmlBackend, load: Load, *, busy: bool = False
) -> tuple[GpuReading, ProcessSample]:
    """Poll until the load's process shows (with SM utilisation > 0 when `busy`)."""
    deadline = time.monotonic() + APPEAR_TIMEOUT_S
    seen: list[GpuReading] = []
    while time.monotonic() < deadline:
        gpu = next(g for g in backend.poll().gpus if g.info.index == load.gpu_index)
        seen.append(gpu)
        sample = load.find(gpu)
        if sample is not None and (not busy or (sample.sm_util_percent or 0) > 0):
            return gpu, sample
        time.sleep(0.5)
    pytest.fail(
        f"pid {load.process.pid} never showed{' busy' if busy else ''} on GPU {load.gpu_index}; "
        f"last readings: {seen[-3:]}"
    )


def test_a_cuda_process_shows_up_with_its_memory(backend: NvmlBackend, load: Load) -> None:
    gpu, sample = wait_for_sample(backend, load)

    assert gpu.healthy, gpu.health_reason
    assert sample.used_memory_bytes is not None
    # 1 GiB held, plus the CUDA context and the matrices.
    assert GiB <= sample.used_memory_bytes <= gpu.info.memory_total_bytes
    assert gpu.memory_used_bytes is not None
    assert gpu.memory_used_bytes >= sample.used_memory_bytes


def test_its_utilisation_becomes_non_zero_under_load(backend: NvmlBackend, load: Load) -> None:
    gpu, sample = wait_for_sample(backend, load, busy=True)

    assert sample.sm_util_percent is not None
    assert 0 < sample.sm_util_percent <= 100
    deadline = time.monotonic() + APPEAR_TIMEOUT_S
    while (gpu.sm_util_percent or 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        gpu = next(g for g in backend.poll().gpus if g.info.index == load.gpu_index)
    assert gpu.sm_util_percent is not None
    assert gpu.sm_util_percent > 0
    assert gpu.healthy, gpu.health_reason
