"""The example node's GPUs: two GPUs of different models and a third in MIG mode. The demo runs
on them, and check-config plans for them when no backend is named."""

from __future__ import annotations

from deviceplugin.gpu.fake import FakeGpu, FakeMigDevice
from deviceplugin.model import GpuInfo

GiB = 1024**3
MiB = 1024**2

DEMO_GPUS = (
    FakeGpu(
        uuid="GPU-3f8a1c2e-5b7d-4e9f-a1b2-c3d4e5f60001",
        index=0,
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GiB,
        minor=0,
        numa_node=0,
    ),
    FakeGpu(
        uuid="GPU-9b2e4d6f-8a1c-4b3d-9e5f-a7b8c9d00002",
        index=1,
        name="NVIDIA L4",
        memory_total_bytes=23034 * MiB,
        minor=1,
        numa_node=1,
    ),
    # In MIG mode (as mig-parted leaves it): one 3g.40gb and two 1g.10gb instances.
    FakeGpu(
        uuid="GPU-c4d5e6f7-1a2b-4c3d-8e9f-b0c1d2e30003",
        index=2,
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * GiB,
        minor=2,
        numa_node=1,
        mig_enabled=True,
        mig_block=True,
        mig_devices=(
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0301", 2, 0, "3g.40gb", 40 * GiB),
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0302", 9, 0, "1g.10gb", 10 * GiB),
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0303", 10, 0, "1g.10gb", 10 * GiB),
        ),
    ),
)


def example_gpus() -> list[GpuInfo]:
    """The demo's GPUs, also used by check-config when no backend is named."""
    gpus: list[GpuInfo] = []
    for g in DEMO_GPUS:
        gpus.append(g.info)
        gpus.extend(g.mig_info(d) for d in g.mig_devices)
    return gpus
