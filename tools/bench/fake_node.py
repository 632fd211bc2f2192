"""The fake GPU every benchmark's node is made of: an H200, numbered as NVML would number it."""

from __future__ import annotations

from deviceplugin.gpu.fake import FakeGpu


def fake_gpu(i: int) -> FakeGpu:
    """GPU `i` of a node of H200s, four to a NUMA node."""
    return FakeGpu(
        uuid=f"GPU-00000000-0000-4000-8000-{i:012d}",
        index=i,
        name="NVIDIA H200",
        memory_total_bytes=141 * 1024**3,
        minor=i,
        numa_node=i // 4,
    )
