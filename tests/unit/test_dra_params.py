"""A claim's `vgpu.dev` parameters (deviceplugin.dra.params): the memory limit above what the
claim consumed, from the claim's or its class's opaque config, and the claim refused, naming
what is wrong, for anything else."""

from __future__ import annotations

from typing import Any

import pytest

from deviceplugin.dra.claims import ClaimDevice, ClaimError, PreparedClaim
from deviceplugin.dra.params import with_memory_limits

DRIVER = "vgpu.dev"
GiB = 1024**3


def prepared(*requests: str) -> PreparedClaim:
    devices = tuple(
        ClaimDevice(r, f"gpu-{i}", f"GPU-{i}", i, i, 40 * GiB, 8 * GiB, 25.0)
        for i, r in enumerate(requests or ("gpu",))
    )
    return PreparedClaim("uid-1", "team-a", "train", devices)


def parameters(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", **fields}


def claim(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"allocation": {"devices": {"config": list(entries)}}}}


def entry(params: Any, source: str = "FromClaim", requests: list[str] | None = None) -> Any:
    found: dict[str, Any] = {"source": source, "opaque": {"driver": DRIVER, "parameters": params}}
    if requests is not None:
        found["requests"] = requests
    return found


def limits(c: PreparedClaim) -> list[int | None]:
    return [d.memory_limit_bytes for d in c.devices]


def test_no_parameters_leave_the_limit_at_the_request() -> None:
    c = with_memory_limits(prepared(), claim(), DRIVER)
    assert limits(c) == [None]
    assert c.limits_per_gpu() == {"GPU-0": (8 * GiB, 8 * GiB)}


def test_a_memory_limit_is_the_hard_limit_above_what_the_claim_consumed() -> None:
    c = with_memory_limits(prepared(), claim(entry(parameters(memoryLimit="20Gi"))), DRIVER)
    assert c.limits_per_gpu() == {"GPU-0": (8 * GiB, 20 * GiB)}


def test_the_claims_own_config_wins_over_its_class() -> None:
    c = with_memory_limits(
        prepared(),
        claim(
            entry(parameters(memoryLimit="20Gi"), source="FromClaim"),
            entry(parameters(memoryLimit="12Gi"), source="FromClass"),
        ),
        DRIVER,
    )
    assert limits(c) == [20 * GiB]


def test_an_entry_applies_to_its_requests_only_and_other_drivers_are_ignored() -> None:
    other = {"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {}}}
    c = with_memory_limits(
        prepared("big", "small"),
        claim(other, entry(parameters(memoryLimit="30Gi"), requests=["big"])),
        DRIVER,
    )
    assert limits(c) == [30 * GiB, None]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (parameters(memoryLimit="4Gi"), "is below the 8589934592 bytes the claim consumed"),
        (parameters(memoryLimit="41Gi"), "is more than device gpu-0 has"),
        (parameters(memoryLimit="lots"), "memoryLimit"),
        (parameters(memoryLimit="20Gi", computeLimit=50), "unknown parameter"),
        (
            {"apiVersion": "vgpu.dev/v1", "kind": "GpuConfig"},
            "expected apiVersion vgpu.dev/v1alpha1",
        ),
        ("20Gi", "the parameters are not an object"),
    ],
)
def test_bad_parameters_refuse_the_claim_naming_it_and_the_entry(params: Any, says: str) -> None:
    with pytest.raises(ClaimError) as raised:
        with_memory_limits(prepared(), claim(entry(params)), DRIVER)
    message = str(raised.value)
    assert message.startswith("ResourceClaim team-a/train: config[0] (FromClaim)")
    assert says in message
