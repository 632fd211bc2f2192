"""What a DRA node says about its devices, on a real kubelet v1.36.2 and scheduler (docs/dra.md):
per device the memory and compute the prepared claims consumed and what is left, the claims on
it, in `/status`, in `vgpu-device-plugin status` and in `/metrics`; never slices.

Two claims (15Gi with 30% of the compute, then 25Gi with the default 25%) fill the 40Gi fake
A100's memory; a third (10Gi) then stays Pending, and the node says why: no memory is left."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import REPO, Cluster, Daemon, wait_until
from tests.e2e.test_dra import GPU, NS, _install, claim_of, claim_pod, start_dra

RUNTIME = "fakecri"
GiB = 1024**3


@pytest.fixture
def dra(cluster: Cluster) -> Iterator[Daemon]:
    """Our daemon as the node's DRA driver, with the DeviceClasses and claim templates."""
    _install(cluster)
    daemon = start_dra(cluster)
    try:
        yield daemon
    finally:
        daemon.kill()


def device_of(daemon: Daemon) -> dict[str, Any]:
    """The A100 in /status (the node's only GPU)."""
    status = daemon.status()
    assert status["kubelet_api"] == "dra"
    (gpu,) = status["gpus"]
    assert gpu["uuid"] == GPU.uuid
    assert gpu["slices"] is None  # no slice, synthetic or other, on a DRA node
    result: dict[str, Any] = gpu["dra"]
    return result


def claimed_by(daemon: Daemon, pods: int) -> dict[str, Any]:
    """The device once the claims of `pods` pods are prepared on it and named."""

    def ready() -> dict[str, Any] | None:
        device = device_of(daemon)
        claims = device["claims"]
        return device if len(claims) == pods and all(c["pod"] for c in claims) else None

    found: dict[str, Any] = wait_until(ready, timeout_s=30, what=f"{pods} claims on gpu-0")
    return found


def view(cluster: Cluster, daemon: Daemon) -> str:
    """`vgpu-device-plugin status` against the daemon, as run in its pod."""
    return cluster.run_in_namespaces(
        ["env", f"PYTHONPATH={REPO}", sys.executable, "-m", "deviceplugin", "status",
         "--address", f"127.0.0.1:{daemon.port}"],
    )  # fmt: skip


def device_series(daemon: Daemon) -> dict[str, float]:
    """The vgpu_dra_device_* samples of gpu-0, by name; and no vgpu_slices at all."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(daemon.metrics()):
        for sample in family.samples:
            assert sample.name != "vgpu_slices", f"a DRA node exposes slices: {sample}"
            if sample.name.startswith("vgpu_dra_device_"):
                assert sample.labels["device"] == "gpu-0", sample
                assert sample.labels["gpu_uuid"] == GPU.uuid, sample
                found[sample.name] = sample.value
    return found


def test_each_device_says_what_its_claims_consumed_and_what_is_left(
    cluster: Cluster, dra: Daemon
) -> None:
    cluster.create_pod(claim_pod("p15", "m15-c30"))
    cluster.wait_running("p15")
    claim15 = f"{NS}/{claim_of(cluster, 'p15')['metadata']['name']}"
    device = claimed_by(dra, 1)
    assert {k: v for k, v in device.items() if k != "claims"} == {
        "device": "gpu-0",
        "memory_claimed_bytes": 15 * GiB,
        "memory_free_bytes": 25 * GiB,
        "compute_claimed_ratio": 0.3,
        "compute_free_ratio": 0.7,
        "full": False,
    }
    (claim,) = device["claims"]
    assert (claim["claim"], claim["namespace"], claim["pod"]) == (claim15, NS, "p15")
    assert (claim["memory_bytes"], claim["compute_ratio"]) == (15 * GiB, 0.3)
    (allocation,) = [a for a in dra.status()["allocations"] if a["claim"] == claim15]
    assert allocation["slice_ids"] == []
    assert [(g["memory_limit_bytes"], g["compute_share_ratio"]) for g in allocation["grants"]] == [
        (15 * GiB, 0.3)
    ]
    shown = view(cluster, dra)
    assert "DRA driver registered" in shown
    assert "device gpu-0: 1 claim" in shown
    assert "claimed: memory 15Gi (25Gi free), compute 30% (70% free)" in shown
    assert f"claim {claim15}" in shown
    assert "slices" not in shown
    assert device_series(dra) == {
        "vgpu_dra_device_memory_claimed_bytes": 15 * GiB,
        "vgpu_dra_device_memory_free_bytes": 25 * GiB,
        "vgpu_dra_device_compute_claimed_ratio": 0.3,
        "vgpu_dra_device_compute_free_ratio": 0.7,
        "vgpu_dra_device_claims": 1,
        "vgpu_dra_device_full": 0,
    }

    # The second claim takes the rest of the memory: a third cannot fit, and the node says so.
    cluster.create_pod(claim_pod("p25", "m25"))
    cluster.wait_running("p25")
    device = claimed_by(dra, 2)
    assert (device["memory_claimed_bytes"], device["memory_free_bytes"]) == (40 * GiB, 0)
    assert (device["compute_claimed_ratio"], device["compute_free_ratio"]) == (0.55, 0.45)
    assert device["full"] is True
    assert sorted(c["pod"] for c in device["claims"]) == ["p15", "p25"]
    cluster.create_pod(claim_pod("p10", "m10-c10"))
    cluster.assert_stays_pending("p10", seconds=4)
    assert device_of(dra)["memory_free_bytes"] == 0  # why p10 waits: no memory left on gpu-0
    shown = view(cluster, dra)
    assert "device gpu-0: 2 claims" in shown
    assert "claimed: memory 40Gi (0B free), compute 55% (45% free), FULL" in shown
    series = device_series(dra)
    assert (series["vgpu_dra_device_memory_free_bytes"], series["vgpu_dra_device_full"]) == (0, 1)
    assert series["vgpu_dra_device_claims"] == 2

    # Freed, the device is free again and the waiting claim is prepared.
    cluster.delete_pod("p15")
    cluster.wait_running("p10")
    device = claimed_by(dra, 2)
    assert (device["memory_claimed_bytes"], device["memory_free_bytes"]) == (35 * GiB, 5 * GiB)
    assert device["full"] is False
