"""failRequestsGreaterThanOne in an NVIDIA file: carried into the allocation config (NVIDIA's
default is true with MPS, false with time-slicing), and the check-config warning says what vgpu
does."""

from __future__ import annotations

import pytest

from tests.unit.test_config_nvidia import parse


@pytest.mark.parametrize(
    ("written", "refused"),
    [
        ("", True),
        ("failRequestsGreaterThanOne: true,", True),
        ("failRequestsGreaterThanOne: false,", False),
    ],
)
def test_mps_fail_requests_is_carried_into_the_allocation_config(
    written: str, refused: bool
) -> None:
    config = parse(f"sharing: {{mps: {{{written} resources: [{{name: gpu, replicas: 2}}]}}}}")

    assert config.allocation.fail_requests_greater_than_one is refused
    warned = [w for w in config.warnings if "failRequestsGreaterThanOne" in w]
    assert bool(warned) is refused
    if refused:
        assert "vgpu refuses a container that asks for more than 1 of nvidia.com/gpu" in warned[0]


@pytest.mark.parametrize(
    ("written", "refused"),
    [
        ("", False),
        ("failRequestsGreaterThanOne: true,", True),
        ("failRequestsGreaterThanOne: false,", False),
    ],
)
def test_time_slicing_refuses_only_when_fail_requests_is_true(written: str, refused: bool) -> None:
    # NVIDIA's default with time-slicing is false; true refuses as with MPS.
    config = parse(
        f"sharing: {{timeSlicing: {{{written} resources: [{{name: gpu, replicas: 2}}]}}}}"
    )

    assert config.allocation.fail_requests_greater_than_one is refused
    warned = [w for w in config.warnings if "failRequestsGreaterThanOne" in w]
    assert bool(warned) is refused
    if refused:
        assert warned[0].startswith("sharing.timeSlicing.failRequestsGreaterThanOne: true:")
        assert "vgpu refuses a container that asks for more than 1 of nvidia.com/gpu" in warned[0]


def test_no_sharing_refuses_nothing() -> None:
    assert parse("flags: {migStrategy: none}").allocation.fail_requests_greater_than_one is False
