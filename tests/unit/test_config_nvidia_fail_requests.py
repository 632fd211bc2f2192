"""sharing.mps.failRequestsGreaterThanOne in an NVIDIA file: carried into the allocation config
(NVIDIA's default with MPS is true), and the check-config warning says what vgpu does."""

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


def test_time_slicing_and_no_sharing_refuse_nothing() -> None:
    for text in (
        "sharing: {timeSlicing: {failRequestsGreaterThanOne: true,"
        " resources: [{name: gpu, replicas: 2}]}}",
        "flags: {migStrategy: none}",
    ):
        assert parse(text).allocation.fail_requests_greater_than_one is False, text
