"""`memoryLimits` (deviceplugin.config.memory): a resource's limit per slice above its slices
(burst), what it gives a container (allocation.burst_limit), and each bad entry named."""

from __future__ import annotations

import pytest

from deviceplugin.allocation import burst_limit
from tests.unit.test_config import parse_yaml, problems_of

GiB = 1024**3


def test_a_listed_resource_has_a_limit_per_slice_and_others_none() -> None:
    config = parse_yaml(
        """
        memoryLimits:
          resources: [{resource: nvidia.com/vgpu, limitPerSlice: 20Gi}]
        """
    )
    assert config.memory_limits.limit_per_slice("nvidia.com/vgpu") == 20 * GiB
    assert config.memory_limits.limit_per_slice("nvidia.com/other") is None
    assert parse_yaml("{}").memory_limits.resources == ()


@pytest.mark.parametrize(
    ("request_gib", "slices", "per_slice_gib", "total_gib", "limit_gib"),
    [
        (10, 1, None, 40, 10),  # not listed: the limit is the request
        (10, 1, 20, 40, 20),  # one slice: its limit per slice
        (20, 2, 20, 30, 30),  # never above the GPU's memory
        (10, 1, 8, 40, 10),  # never below the request
    ],
)
def test_a_containers_limit_is_its_slices_times_the_limit_per_slice(
    request_gib: int, slices: int, per_slice_gib: int | None, total_gib: int, limit_gib: int
) -> None:
    per_slice = None if per_slice_gib is None else per_slice_gib * GiB
    assert burst_limit(request_gib * GiB, slices, per_slice, total_gib * GiB) == limit_gib * GiB


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ("[{resource: nvidia.com/vgpu}]", "memoryLimits.resources[0]: needs limitPerSlice"),
        ("[{limitPerSlice: 20Gi}]", "memoryLimits.resources[0]: needs resource"),
        (
            "[{resource: nvidia.com/vgpu, limitPerSlice: 20Gi},"
            " {resource: nvidia.com/vgpu, limitPerSlice: 30Gi}]",
            "memoryLimits.resources[1]: resource nvidia.com/vgpu is listed twice",
        ),
        ("[{resource: nvidia.com/vgpu, limitPerSlice: lots}]", "limitPerSlice"),
        ("[{resource: vgpu, limitPerSlice: 20Gi}]", "resource"),
        ("[{resource: nvidia.com/vgpu, limitPerSlice: 20Gi, burst: true}]", "burst"),
    ],
)
def test_a_bad_entry_is_named_with_its_path(entries: str, problem: str) -> None:
    problems = problems_of(f"memoryLimits:\n  resources: {entries}\n")
    assert any(problem in p for p in problems), problems
