"""The node's ResourceSlice: what the scheduler sees of each GPU and MIG device."""

from __future__ import annotations

from dataclasses import replace

from deviceplugin.config import DraConfig, MigConfig, MigStrategy, SlicingConfig
from deviceplugin.config.model import SliceRule
from deviceplugin.dra.slices import build_devices, build_slice, slice_name
from deviceplugin.model import GpuInfo, GpuReading, Inventory, NodeReading
from deviceplugin.slicing import build_inventory

GIB = 1 << 30


def _gpu(index: int, memory_gib: int = 40, **kw: object) -> GpuInfo:
    return GpuInfo(
        uuid=f"GPU-{index:04d}",
        index=index,
        name="NVIDIA A100-SXM4-40GB",
        memory_total_bytes=memory_gib * GIB,
        minor=index,
        **kw,  # type: ignore[arg-type]
    )


def _inventory(*readings: GpuReading, mig: MigConfig | None = None, replicas: int = 4) -> Inventory:
    return build_inventory(
        NodeReading(0.0, tuple(readings)),
        SlicingConfig(default=SliceRule(replicas=replicas)),
        mig=mig,
    )


def test_one_device_per_gpu_with_both_capacities_and_one_slice_as_default() -> None:
    inventory = _inventory(GpuReading(_gpu(0)), GpuReading(_gpu(1)))
    devices = build_devices(inventory, DraConfig(), "vgpu.dev")
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-1"]
    d = devices[0]
    assert d["allowMultipleAllocations"] is True
    assert d["attributes"] == {
        "uuid": {"string": "GPU-0000"},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "type": {"string": "gpu"},
    }
    memory = d["capacity"]["memory"]
    assert memory["value"] == str(40 * GIB)
    # A claim naming no memory gets one device-plugin slice's worth: 40Gi / 4.
    assert memory["requestPolicy"]["default"] == str(10 * GIB)
    assert memory["requestPolicy"]["validRange"]["step"] == str(256 << 20)
    compute = d["capacity"]["compute"]
    assert compute["value"] == "100"
    assert compute["requestPolicy"]["default"] == "25"
    assert "taints" not in d


def test_default_lands_on_the_step_grid() -> None:
    # 39.9 GiB / 3 is not a multiple of 256 MiB: the default is rounded down onto the grid
    # (the API server refuses a default the range does not allow).
    odd = replace(_gpu(0), memory_total_bytes=40_000 << 20)
    devices = build_devices(_inventory(GpuReading(odd), replicas=3), DraConfig(), "vgpu.dev")
    default = int(devices[0]["capacity"]["memory"]["requestPolicy"]["default"])
    step = 256 << 20
    assert default % step == 0
    assert (40_000 << 20) // 3 - step < default <= (40_000 << 20) // 3
    assert devices[0]["capacity"]["compute"]["requestPolicy"]["default"] == "33"


def test_unhealthy_gpu_is_tainted_noschedule_and_a_lost_one_noexecute() -> None:
    inventory = _inventory(
        GpuReading(_gpu(0), healthy=False, health_reason="Xid 48: double-bit ECC error"),
        GpuReading(_gpu(1), healthy=False, health_reason="Xid 79: GPU has fallen off the bus"),
        GpuReading(_gpu(2)),
    )
    reasons = {
        "GPU-0000": "Xid 48: double-bit ECC error",
        "GPU-0001": "Xid 79: GPU has fallen off the bus",
    }
    devices = build_devices(inventory, DraConfig(), "vgpu.dev", reasons)
    assert devices[0]["taints"] == [{"key": "vgpu.dev/unhealthy", "effect": "NoSchedule"}]
    assert devices[1]["taints"] == [{"key": "vgpu.dev/lost", "effect": "NoExecute"}]
    assert "taints" not in devices[2]


def test_mig_devices_are_devices_when_the_strategy_is_not_none() -> None:
    parent = _gpu(0, 80, mig_enabled=True)
    mig = _gpu(
        0,
        40,
        parent_uuid="GPU-0000",
        mig_profile="3g.40gb",
        gpu_instance_id=1,
        compute_instance_id=0,
    )
    mig = replace(mig, uuid="MIG-1")
    reading = (GpuReading(parent), GpuReading(mig))
    none = build_devices(_inventory(*reading, mig=MigConfig()), DraConfig(), "vgpu.dev")
    assert none == []
    single = build_devices(
        _inventory(*reading, mig=MigConfig(strategy=MigStrategy.SINGLE)),
        DraConfig(),
        "vgpu.dev",
    )
    assert [d["name"] for d in single] == ["gpu-0-mig-1-0"]
    attrs = single[0]["attributes"]
    assert attrs["type"] == {"string": "mig"}
    assert attrs["migProfile"] == {"string": "3g.40gb"}
    assert attrs["parentUUID"] == {"string": "GPU-0000"}
    assert single[0]["capacity"]["memory"]["value"] == str(40 * GIB)


def test_slice_is_the_nodes_pool_owned_by_its_node() -> None:
    obj = build_slice("Node-1", "vgpu.dev", [], 3, {"name": "Node-1", "uid": "u-1"})
    assert obj["metadata"]["name"] == slice_name("Node-1", "vgpu.dev") == "node-1-vgpu.dev"
    assert obj["spec"]["pool"] == {"name": "Node-1", "generation": 3, "resourceSliceCount": 1}
    assert obj["spec"]["nodeName"] == "Node-1"
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_request_policies_come_from_the_config() -> None:
    from deviceplugin.config.load import config_from_bytes

    cfg = config_from_bytes(
        b"dra:\n  driverName: gpu.example.com\n"
        b"  memory: {min: 1Gi, step: 512Mi, default: 4Gi}\n"
        b"  compute: {min: 5, step: 5, default: 10}\n",
        "test",
    )
    assert cfg.dra.driver_name == "gpu.example.com"
    (d,) = build_devices(_inventory(GpuReading(_gpu(0))), cfg.dra, "x")
    memory = d["capacity"]["memory"]["requestPolicy"]
    assert memory == {
        "default": str(4 * GIB),
        "validRange": {"min": str(GIB), "max": str(40 * GIB), "step": str(512 << 20)},
    }
    compute = d["capacity"]["compute"]["requestPolicy"]
    assert compute == {"default": "10", "validRange": {"min": "5", "max": "100", "step": "5"}}


def test_bad_dra_config_is_refused_naming_the_key() -> None:
    import pytest

    from deviceplugin.config.load import config_from_bytes
    from deviceplugin.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        config_from_bytes(b"dra: {driverName: Not_A_Name, compute: {step: 0}, colour: red}", "t")
    problems = " ".join(e.value.problems)
    assert "dra.driverName" in problems
    assert "dra.compute.step" in problems
    assert "dra.colour" in problems or "colour" in problems


MIB = 1 << 20
# What NVML reports as total memory for real cards (MiB): none is a multiple of 256Mi.
REAL_GPUS = {
    "NVIDIA H100 80GB HBM3": 81559,
    "NVIDIA H200": 143771,
    "NVIDIA L4": 23034,
    "NVIDIA A10G": 23028,
    "NVIDIA L40S": 46068,
}
# A100 80GB MIG devices as NVML sizes them (MiB).
REAL_MIG = {"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}


def _real_node() -> Inventory:
    readings = [
        GpuReading(replace(_gpu(i), name=name, memory_total_bytes=mib * MIB))
        for i, (name, mib) in enumerate(REAL_GPUS.items())
    ]
    parent = replace(_gpu(9, 80, mig_enabled=True), name="NVIDIA A100-SXM4-80GB")
    readings.append(GpuReading(parent))
    for gi, (profile, mib) in enumerate(REAL_MIG.items(), start=1):
        mig = _gpu(9, parent_uuid=parent.uuid, mig_profile=profile, gpu_instance_id=gi,
                   compute_instance_id=0)  # fmt: skip
        readings.append(GpuReading(replace(mig, uuid=f"MIG-{gi}", memory_total_bytes=mib * MIB)))
    return _inventory(*readings, mig=MigConfig(strategy=MigStrategy.MIXED))


def test_the_api_server_takes_the_slice_of_every_real_gpu_and_mig_size() -> None:
    from deviceplugin.dra.slices import slice_problems

    inventory = _real_node()
    devices = build_devices(inventory, DraConfig(), "vgpu.dev")
    assert len(devices) == len(REAL_GPUS) + len(REAL_MIG)
    assert slice_problems(build_slice("node-1", "vgpu.dev", devices, 1)) == []
    step = 256 * MIB
    for device in devices:
        memory = device["capacity"]["memory"]
        total, top = int(memory["value"]), int(memory["requestPolicy"]["validRange"]["max"])
        # The whole device is the capacity; the range stops at the last full step in it.
        assert top % step == 0, device["name"]
        assert total - step < top <= total, device["name"]
    l4 = next(d for d in devices if d["attributes"]["productName"] == {"string": "NVIDIA L4"})
    assert l4["capacity"]["memory"]["value"] == str(23034 * MIB)
    assert l4["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == str(22784 * MIB)


def test_a_compute_step_that_does_not_divide_100_ends_the_range_on_its_grid() -> None:
    (d,) = build_devices(
        _inventory(GpuReading(_gpu(0)), replicas=1),
        DraConfig(compute_min=5, compute_step=10),
        "vgpu.dev",
    )
    compute = d["capacity"]["compute"]["requestPolicy"]
    assert compute == {"default": "95", "validRange": {"min": "5", "max": "95", "step": "10"}}
    from deviceplugin.dra.slices import slice_problems

    assert slice_problems(build_slice("n", "vgpu.dev", [d], 1)) == []


def test_a_policy_no_device_can_carry_is_reported_naming_the_device_and_the_key() -> None:
    from deviceplugin.dra.slices import slice_problems

    devices = build_devices(_real_node(), DraConfig(memory_min_bytes=30 * GIB), "vgpu.dev")
    problems = slice_problems(build_slice("node-1", "vgpu.dev", devices, 1))
    l4 = [p for p in problems if "NVIDIA L4" in p]
    assert l4, problems
    assert "capacity[memory].requestPolicy.validRange.min" in l4[0]
    assert "min is larger than capacity value" in l4[0]
    assert "dra.memory" in l4[0]
    # The H100 and H200 hold 30Gi: nothing is said of them.
    assert not [p for p in problems if "H100" in p or "H200" in p]


def test_a_driver_name_the_runtime_would_refuse_as_a_cdi_kind_is_refused() -> None:
    import pytest

    from deviceplugin.config.load import config_from_bytes
    from deviceplugin.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        config_from_bytes(b"dra: {driverName: 9gpu.example.com}", "t")
    (problem,) = e.value.problems
    assert problem.startswith("dra.driverName")
    assert "starts with a digit" in problem
    assert "9gpu.example.com/claim" in problem
    assert "CDI vendor must start with a letter" in problem
    with pytest.raises(ConfigError) as e:
        config_from_bytes(b"dra: {driverName: " + b"a" * 64 + b"}", "t")
    assert "longer than 63 characters" in e.value.problems[0]
    assert config_from_bytes(b"dra: {driverName: gpu9.example.com}", "t").dra.driver_name == (
        "gpu9.example.com"
    )
