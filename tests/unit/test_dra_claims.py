"""A claim's allocation read into a prepared claim, its CDI spec, and the checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.allocation import (
    MPS_SHM_CONTAINER_PATH,
    mps_pipe_directory,
    mps_shm_directory,
)
from deviceplugin.config import AllocationConfig, MpsConfig, SlicingConfig
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import (
    ClaimError,
    claim_edits,
    claim_record,
    parse_quantity,
    plans_by_device,
    read_claim,
)
from deviceplugin.dra.store import ClaimStore, claims_to_json, parse_checkpoint
from deviceplugin.model import GpuInfo, GpuReading, NodeReading
from deviceplugin.slicing import build_inventory

GIB = 1 << 30
NODE = "node-a"
GPU0 = GpuInfo("GPU-aaaa", 0, "NVIDIA A100-PCIE-40GB", 40 * GIB, minor=0)
GPU1 = GpuInfo("GPU-bbbb", 1, "NVIDIA L4", 24 * GIB, minor=3)
INVENTORY = build_inventory(NodeReading(0.0, (GpuReading(GPU0), GpuReading(GPU1))), SlicingConfig())
PLANS = plans_by_device(INVENTORY)


def _claim(*results: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "train", "uid": uid},
        "status": {
            "allocation": {
                "devices": {"results": [{"driver": "vgpu.dev", "pool": NODE, **r} for r in results]}
            },
            "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "p-1"}],
        },
    }


def _read(claim: dict[str, Any]) -> Any:
    return read_claim(claim, driver_name="vgpu.dev", node_name=NODE, plans=PLANS)


@pytest.mark.parametrize(
    ("text", "value"),
    [("15Gi", 15 * GIB), ("25", 25), ("1500m", 1.5), ("1e3", 1000), ("2G", 2 * 10**9)],
)
def test_quantities(text: str, value: float) -> None:
    assert parse_quantity(text) == value


def test_bad_quantity_is_named() -> None:
    with pytest.raises(ValueError, match="'12 bananas'"):
        parse_quantity("12 bananas")


@pytest.mark.parametrize(
    "text", ["10e999999", "1e31", "1e-31", "1e999999Ki", "9" * 65, "1e1000000000000"]
)
def test_a_quantity_out_of_range_is_refused_before_it_is_converted(text: str) -> None:
    with pytest.raises(ValueError, match="is out of range"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("consumed", "problem"),
    [
        ({"memory": "41Gi"}, "more memory than device 'gpu-0' has (42949672960 bytes)"),
        ({"compute": "101"}, "more compute than device 'gpu-0' has (100)"),
        ({"memory": "1e20"}, "more memory than device 'gpu-0' has"),
        ({"compute": "10e999999"}, "consumed compute '10e999999' is out of range"),
    ],
)
def test_a_claim_consuming_more_than_its_device_is_refused_naming_it(
    consumed: dict[str, str], problem: str
) -> None:
    with pytest.raises(ClaimError, match=re.escape(problem)):
        _read(_claim({"request": "gpu", "device": "gpu-0", "consumedCapacity": consumed}))


def test_consumed_capacity_becomes_the_limits_and_the_env() -> None:
    claim = _read(
        _claim(
            {
                "request": "gpu",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "15Gi", "compute": "30"},
                "shareID": "s1",
            }
        )
    )
    assert claim.pods == (("trainer-0", "p-1"),)
    (d,) = claim.devices
    assert (d.gpu_uuid, d.memory_bytes, d.compute_percent, d.share_id) == (
        "GPU-aaaa",
        15 * GIB,
        30.0,
        "s1",
    )
    edits = claim_edits(claim, AllocationConfig(), MpsConfig(), device_nodes=False)
    env = edits.env
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert env["VGPU_MEMORY_LIMIT_MIB_0"] == "15360"
    assert env["VGPU_COMPUTE_SHARE_PERCENT_0"] == "30"
    assert env["VGPU_ALLOCATION_ID"] == claim.allocation_id
    assert len(claim.allocation_id) == 16
    # (15Gi - 512Mi reserve) / 40Gi, rounded down to hundredths.
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.36"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert edits.device_nodes == ()
    (grant,) = claim_record(claim).grants
    assert (grant.gpu_uuid, grant.memory_limit_bytes, grant.compute_share_ratio) == (
        "GPU-aaaa",
        15 * GIB,
        0.3,
    )


def test_two_shares_of_one_gpu_add_up_and_two_gpus_get_two_ordinals() -> None:
    claim = _read(
        _claim(
            {
                "request": "a",
                "device": "gpu-1",
                "consumedCapacity": {"memory": "4Gi", "compute": "10"},
            },
            {
                "request": "b",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "8Gi", "compute": "20"},
            },
            {
                "request": "c",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "2Gi", "compute": "5"},
            },
        )
    )
    mps_edits = claim_edits(claim, AllocationConfig(), MpsConfig(enabled=True), device_nodes=True)
    env = mps_edits.env
    # Allocate's MPS mounts: the pipe directory read-only (a pod must not replace the control
    # daemon's files), the shared memory read-write.
    root = MpsConfig(enabled=True).root
    assert mps_edits.mounts == (
        (mps_pipe_directory(root), mps_pipe_directory(root), True),
        (mps_shm_directory(root), MPS_SHM_CONTAINER_PATH, False),
    )
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"
    # Per device as well as per ordinal, as Allocate gives them: keys that two claims of one
    # container on different GPUs do not both set.
    assert env["VGPU_MEMORY_LIMIT_MIB_GPU_AAAA"] == str(10 * 1024)
    assert env["VGPU_ALLOCATION_ID_GPU_BBBB"] == claim.allocation_id
    assert env["VGPU_MEMORY_LIMIT_MIB_0"] == str(10 * 1024)
    assert env["VGPU_COMPUTE_SHARE_PERCENT_0"] == "25"
    assert env["VGPU_MEMORY_LIMIT_MIB_1"] == str(4 * 1024)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M,1=4096M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    nodes = claim_edits(claim, AllocationConfig(), MpsConfig(), device_nodes=True).device_nodes
    assert nodes[-2:] == ("/dev/nvidia0", "/dev/nvidia3")


def test_a_whole_device_without_consumed_capacity() -> None:
    claim = _read(_claim({"request": "gpu", "device": "gpu-1"}))
    (d,) = claim.devices
    assert (d.memory_bytes, d.compute_percent) == (24 * GIB, 100.0)


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        ({"metadata": {"namespace": "ml", "name": "train"}}, "is not allocated"),
        (_claim({"request": "g", "device": "gpu-7"}), "'gpu-7' is not published by this node"),
        (_claim({"request": "g", "device": "gpu-0", "pool": "node-b"}), "not this node's pool"),
        (
            _claim({"request": "g", "device": "gpu-0", "consumedCapacity": {"memory": "x"}}),
            "'x' is not a quantity",
        ),
        (
            _claim({"request": "g", "device": "gpu-0", "driver": "gpu.nvidia.com"}),
            "holds no device of driver vgpu.dev",
        ),
    ],
)
def test_claims_that_cannot_be_prepared_say_why(claim: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        _read(claim)


def test_a_claim_is_an_allocation_granted_what_it_consumed_per_gpu_and_holds_no_slice() -> None:
    claim = _read(
        _claim(
            {
                "request": "a",
                "device": "gpu-1",
                "consumedCapacity": {"memory": "4Gi", "compute": "10"},
            },
            {
                "request": "b",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "1Gi", "compute": "5"},
            },
            {
                "request": "c",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "2Gi", "compute": "20"},
            },
        )
    )
    record = claim_record(claim, "main")
    assert record.slice_ids == ()
    assert (record.source, record.claim, record.pod, record.container) == (
        "dra",
        "ml/train",
        "trainer-0",
        "main",
    )
    assert [(g.gpu_uuid, g.memory_limit_bytes, g.compute_share_ratio) for g in record.grants] == [
        ("GPU-aaaa", 3 * GIB, 0.25),
        ("GPU-bbbb", 4 * GIB, 0.1),
    ]


def test_cdi_spec_is_owner_only_replaced_whole_and_never_through_a_symlink(tmp_path: Path) -> None:
    claim = _read(
        _claim(
            {
                "request": "g",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "1Gi", "compute": "5"},
            }
        )
    )
    edits = claim_edits(claim, AllocationConfig(), MpsConfig(), device_nodes=True)
    cdi_dir = tmp_path / "cdi"
    path = cdi.write_spec(cdi_dir, "vgpu.dev", claim, edits)
    assert path.name == "vgpu.dev-claim_uid-1.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["kind"] == "vgpu.dev/claim"
    assert doc["devices"][0]["name"] == "uid-1"
    assert {"path": "/dev/nvidia0"} in doc["devices"][0]["containerEdits"]["deviceNodes"]
    assert cdi.cdi_ids("vgpu.dev", claim, nvidia=True) == (
        "vgpu.dev/claim=uid-1",
        "nvidia.com/gpu=GPU-aaaa",
    )
    assert cdi.spec_claim_uids(cdi_dir, "vgpu.dev") == ["uid-1"]
    # A symlink planted at the spec's name is replaced, its target left alone.
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path.unlink()
    path.symlink_to(victim)
    cdi.write_spec(cdi_dir, "vgpu.dev", claim, edits)
    assert victim.read_text() == "keep"
    assert not path.is_symlink()
    assert cdi.remove_spec(cdi_dir, "vgpu.dev", "uid-1")
    assert not cdi.remove_spec(cdi_dir, "vgpu.dev", "uid-1")
    assert sorted(os.listdir(cdi_dir)) == []
    # A CDI directory that is a symlink is refused.
    link = tmp_path / "cdi-link"
    link.symlink_to(cdi_dir)
    with pytest.raises(NotADirectoryError):
        cdi.write_spec(link, "vgpu.dev", claim, edits)


def test_the_checkpoint_keeps_prepared_claims_across_a_restart(tmp_path: Path) -> None:
    claim = _read(
        _claim(
            {
                "request": "g",
                "device": "gpu-0",
                "consumedCapacity": {"memory": "3Gi", "compute": "7"},
            }
        )
    )
    store = ClaimStore(tmp_path)
    store.put(claim)
    again = ClaimStore(tmp_path)
    again.load()
    assert again.get("uid-1") == claim
    assert again.remove("uid-1")
    third = ClaimStore(tmp_path)
    third.load()
    assert len(third) == 0


def test_a_malformed_checkpoint_is_moved_aside_naming_what_is_wrong(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    content = '{"version": 1, "claims": [{"uid": 3}]}'
    (tmp_path / "dra-claims.json").write_text(content)
    store = ClaimStore(tmp_path, wall_clock=lambda: 1700000000.0)
    store.load()
    assert len(store) == 0
    aside = tmp_path / "dra-claims.json.unreadable-1700000000"
    assert aside.read_text() == content
    assert not (tmp_path / "dra-claims.json").exists()
    assert "claims[0].uid is 3, not a string" in caplog.text
    assert f"moved_to={aside}" in caplog.text


def _checkpoint_with(**device: object) -> str:
    claim = _read(
        _claim({"request": "g", "device": "gpu-0", "consumedCapacity": {"memory": "3Gi"}})
    )
    claims = claims_to_json([claim])
    claims[0]["devices"][0].update(device)
    return json.dumps({"version": 1, "claims": claims})


@pytest.mark.parametrize(
    ("device", "problem"),
    [
        ({"compute_percent": math.nan}, "compute_percent is nan, not a number from 0 to 100"),
        ({"compute_percent": 100.5}, "compute_percent is 100.5, not a number from 0 to 100"),
        ({"memory_bytes": -1}, "memory_bytes is -1, not an integer from 0 to"),
        ({"memory_bytes": 41 * GIB}, f"memory_bytes is {41 * GIB}, not an integer from 0 to"),
        ({"memory_bytes": 1.5}, "memory_bytes is 1.5, not an integer"),
        ({"gpu_index": True}, "gpu_index is True, not an integer"),
        ({"memory_total_bytes": 0}, "memory_total_bytes is 0, not an integer from 1"),
        ({"device": None}, "device is None, not a string"),
    ],
)
def test_a_checkpoint_value_out_of_range_is_refused_naming_it(
    device: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_checkpoint(_checkpoint_with(**device).encode())


@pytest.mark.parametrize(
    ("claim", "problem"),
    [
        ({"uid": "a/b"}, "uid 'a/b' is not a claim UID"),
        ({"namespace": "../x"}, "namespace '../x' is not a DNS-1123 label"),
        ({"devices": []}, "claims[0].devices is empty"),
        ({"pods": [["p"]]}, "claims[0].pods[0] is not a [name, uid] pair"),
    ],
)
def test_a_checkpoint_claim_that_is_not_one_is_refused_naming_it(
    claim: dict[str, object], problem: str
) -> None:
    doc = json.loads(_checkpoint_with())
    doc["claims"][0].update(claim)
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_checkpoint(json.dumps(doc).encode())


def test_a_valid_checkpoint_reads_back_what_was_written() -> None:
    assert len(parse_checkpoint(_checkpoint_with().encode())) == 1
