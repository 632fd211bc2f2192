"""DRA mode's snapshot, /status document and view: per device the memory and compute the
prepared claims consumed and what is left, the claims on it, no slices."""

from __future__ import annotations

import json
from typing import Any

from deviceplugin.config import DraConfig
from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    DeviceGrant,
    DraDevice,
    GpuPlan,
    GpuReading,
    Inventory,
    NodeReading,
)
from deviceplugin.usage.attribution import SnapshotBuilder
from deviceplugin.usage.devices import dra_devices
from deviceplugin.usage.statusdoc import snapshot_to_json
from deviceplugin.usage.statusview import render_compact, render_status
from tests.unit.test_attribution import HEALTH
from tests.unit.test_metrics import (
    DRA_CLAIMS,
    DRA_GPU,
    DRA_MIG,
    DRA_MIG_PARENT,
    GiB,
    dra_sample_snapshot,
    sample_snapshot,
)

MiB = 1 << 20
PLANS = (
    GpuPlan(DRA_GPU, 4, 10 * GiB, 0.25),
    GpuPlan(DRA_MIG_PARENT, 0, 0, 0.0, excluded_reason="MIG mode"),
    GpuPlan(DRA_MIG, 1, 40 * GiB, 1.0),
)


def claim(
    allocation: str, memory: int, compute: float, uuid: str = DRA_GPU.uuid
) -> AllocationRecord:
    return AllocationRecord(
        allocation, (), 0.0, grants=(DeviceGrant(uuid, memory, compute),), source=SOURCE_DRA
    )


def test_a_half_claimed_gpu_shows_what_is_left_and_takes_more_claims() -> None:
    devices = dra_devices(PLANS, [claim("a", 15 * GiB, 0.3)], DraConfig())
    assert devices[DRA_GPU.uuid] == DraDevice("gpu-0", 15 * GiB, 25 * GiB, 0.3, 0.7, 1, False)
    # The GPU in MIG mode is no device; its MIG device is one.
    assert set(devices) == {DRA_GPU.uuid, DRA_MIG.uuid}
    assert devices[DRA_MIG.uuid] == DraDevice("gpu-1-mig-1-0", 0, 40 * GiB, 0.0, 1.0, 0, False)


def test_a_device_is_full_when_less_than_the_policys_minimum_is_left() -> None:
    claims = [claim("a", 15 * GiB, 0.3), claim("b", 25 * GiB - 200 * MiB, 0.25)]
    # 200Mi left: below the default minimum of 256Mi, so no claim fits.
    (gpu0, _) = dra_devices(PLANS, claims, DraConfig()).values()
    assert (gpu0.memory_free_bytes, gpu0.compute_free_ratio, gpu0.full) == (200 * MiB, 0.45, True)
    assert not dra_devices(PLANS, claims, DraConfig(memory_min_bytes=128 * MiB))[DRA_GPU.uuid].full
    # All the compute claimed: full too, with memory to spare.
    compute = dra_devices(PLANS, [claim("a", 1 * GiB, 0.7), claim("b", 1 * GiB, 0.3)], DraConfig())
    assert (compute[DRA_GPU.uuid].compute_free_ratio, compute[DRA_GPU.uuid].full) == (0.0, True)


def test_the_snapshot_speaks_dra_only_when_built_for_it() -> None:
    reading = NodeReading(
        1.0, (GpuReading(DRA_GPU), GpuReading(DRA_MIG_PARENT), GpuReading(DRA_MIG))
    )
    inventory = Inventory.of(PLANS, ())

    def build(dra: DraConfig | None) -> Any:
        snapshot, _ = SnapshotBuilder("n", 5.0).build(
            reading,
            inventory,
            DRA_CLAIMS,
            {},
            now_s=1.0,
            wall_s=1.0,
            health=HEALTH,
            previous_reading_s=None,
            dra=dra,
        )
        return snapshot

    snapshot = build(DraConfig())
    assert snapshot.kubelet_api == "dra"
    assert [g.dra for g in snapshot.gpus] == [
        DraDevice("gpu-0", 40 * GiB, 0, 0.55, 0.45, 2, True),
        None,
        DraDevice("gpu-1-mig-1-0", 0, 40 * GiB, 0.0, 1.0, 0, False),
    ]
    # Each claim is a container held to its grant there.
    assert [(c.pod, c.memory_limit_bytes) for c in snapshot.containers] == [
        ("p15", 15 * GiB),
        ("p25", 25 * GiB),
    ]
    plugin = build(None)
    assert plugin.kubelet_api == "device-plugin"
    assert [g.dra for g in plugin.gpus] == [None, None, None]


def doc() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(snapshot_to_json(dra_sample_snapshot())))
    return loaded


def test_status_has_per_device_claimed_and_free_and_the_claims_on_it_but_no_slices() -> None:
    status = doc()
    assert status["kubelet_api"] == "dra"
    gpu0, parent, mig = status["gpus"]
    assert gpu0["slices"] is None
    assert gpu0["dra"] == {
        "device": "gpu-0",
        "memory_claimed_bytes": 40 * GiB,
        "memory_free_bytes": 0,
        "compute_claimed_ratio": 0.55,
        "compute_free_ratio": 0.45,
        "full": True,
        "claims": [
            {
                "claim": "ml/p15-gpu",
                "allocation_id": "c1a1c1a1c1a1c1a1",
                "namespace": "ml",
                "pod": "p15",
                "container": "main",
                "memory_bytes": 15 * GiB,
                "memory_limit_bytes": 15 * GiB,
                "compute_ratio": 0.3,
            },
            {
                "claim": "ml/p25-gpu",
                "allocation_id": "c2a2c2a2c2a2c2a2",
                "namespace": "ml",
                "pod": "p25",
                "container": "main",
                "memory_bytes": 25 * GiB,
                "memory_limit_bytes": 25 * GiB,
                "compute_ratio": 0.25,
            },
        ],
    }
    assert (parent["slices"], parent["dra"]) == (None, None)
    assert mig["dra"]["memory_free_bytes"] == 40 * GiB
    assert mig["dra"]["claims"] == []
    # Not a slice ID anywhere: a claim's allocation lists its grants.
    assert [a["slice_ids"] for a in status["allocations"]] == [[], []]
    assert status["allocations"][0]["grants"] == [
        {
            "gpu_uuid": DRA_GPU.uuid,
            "memory_limit_bytes": 15 * GiB,
            "memory_request_bytes": 15 * GiB,
            "compute_share_ratio": 0.3,
            "slices": 1,
        }
    ]


def test_device_plugin_status_keeps_its_slices_and_has_no_dra_device() -> None:
    status = snapshot_to_json(sample_snapshot())
    assert status["kubelet_api"] == "device-plugin"
    assert [g["dra"] for g in status["gpus"]] == [None, None]
    assert status["gpus"][0]["slices"]["total"] == 4


def test_the_view_shows_each_devices_claims_and_what_is_left() -> None:
    lines = render_status(doc(), width=100)
    text = "\n".join(lines)
    assert "DRA driver registered" in lines[1]
    assert "slices" not in text
    assert "GPU 1  NVIDIA A100-SXM4-80GB  healthy  no device of its own" in lines
    (gpu0,) = [line for line in lines if line.startswith("GPU 0")]
    assert gpu0.endswith("healthy  device gpu-0: 2 claims")
    assert "  claimed: memory 40Gi (0B free), compute 55% (45% free), FULL" in lines
    assert "    claimed: memory 0B (40Gi free), compute 0% (100% free)" in text
    assert "claim ml/p15-gpu" in text
    compact = "\n".join(render_compact(doc(), width=100, height=9))
    assert "free 0B 45% FULL" in compact
    assert "slices" not in compact
