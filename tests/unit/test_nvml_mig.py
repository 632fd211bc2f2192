"""The nvml backend on GPUs in MIG mode, against the driver model: MIG device handles, UUIDs,
instance IDs, profile names, memory and processes per MIG device, no utilisation per MIG device,
a re-partitioning at run time, and Xid events that name a GPU instance."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.config import HealthConfig
from deviceplugin.gpu.nvml import NvmlBackend
from deviceplugin.model import GpuReading, NodeReading, mig_profile_name
from tests.support.nvml_model import (
    GiB,
    ModelMigDevice,
    ModelProcess,
    NvmlModel,
    model_gpus,
)
from tests.unit.test_nvml_backend import CALL_TIMEOUT_S, NVML_LOGGER, FakeClock, eventually


@pytest.mark.parametrize(
    ("gpu_slices", "compute_slices", "memory_mib", "name"),
    [
        (1, 1, 4864, "1g.5gb"),  # A100-40GB
        (1, 1, 9728, "1g.10gb"),  # A100-80GB, H100-80GB
        (2, 2, 19968, "2g.20gb"),
        (3, 3, 40192, "3g.40gb"),
        (7, 7, 81408, "7g.80gb"),
        (1, 1, 16384, "1g.16gb"),
        (3, 1, 40192, "1c.3g.40gb"),  # a compute instance smaller than its GPU instance
        (1, 0, 9728, "1g.10gb"),  # a driver that leaves the compute count at 0
    ],
)
def test_profile_names_as_nvidia_tools_write_them(
    gpu_slices: int, compute_slices: int, memory_mib: int, name: str
) -> None:
    assert mig_profile_name(gpu_slices, compute_slices, memory_mib) == name


def small(gi: int, *processes: ModelProcess) -> ModelMigDevice:
    return ModelMigDevice(
        uuid=f"MIG-{gi:08x}-0000-4000-8000-000000000000",
        gpu_instance_id=gi,
        processes=list(processes),
    )


def big(gi: int) -> ModelMigDevice:
    return ModelMigDevice(
        uuid=f"MIG-{gi:08x}-0000-4000-8000-00000000ffff",
        gpu_instance_id=gi,
        gpu_slices=3,
        compute_slices=3,
        memory_size_mb=40192,
        name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
    )


@pytest.fixture
def model() -> NvmlModel:
    gpus = model_gpus(2)
    gpus[1].mig_enabled = True
    gpus[1].memory_used_bytes = 3 * GiB
    gpus[1].mig_devices = [
        big(1),
        None,  # an empty slot, as NVML leaves them
        small(9, ModelProcess(4242, 2 * GiB)),
        small(10),
    ]
    # A process the GPU itself lists in MIG mode must not be counted twice.
    gpus[1].processes = [ModelProcess(4242, 2 * GiB)]
    return NvmlModel(gpus)


@pytest.fixture
def backend(
    model: NvmlModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[NvmlBackend]:
    caplog.set_level(logging.DEBUG, logger=NVML_LOGGER)
    b = NvmlBackend(
        HealthConfig(),
        nvml=model,
        call_timeout_s=CALL_TIMEOUT_S,
        event_wait_timeout_s=0.02,
        sysfs_root=tmp_path,
        clock=FakeClock(),
    )
    try:
        yield b
    finally:
        model.release_all()
        b.close()


def mig_readings(reading: NodeReading) -> list[GpuReading]:
    return [g for g in reading.gpus if g.info.is_mig_device]


def test_a_mig_devices_index_is_its_slot_under_its_parent_empty_slots_counted(
    backend: NvmlBackend,
) -> None:
    # What NVIDIA's plugin writes as <GPU index>:<MIG index> for deviceIDStrategy: index.
    devices = {g.info.uuid: g.info for g in mig_readings(backend.poll())}

    assert {u: (d.index, d.mig_index) for u, d in devices.items()} == {
        big(1).uuid: (1, 0),
        small(9).uuid: (1, 2),  # slot 1 is empty
        small(10).uuid: (1, 3),
    }


def test_mig_devices_are_read_with_their_ids_profile_memory_and_processes(
    model: NvmlModel, backend: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    reading = backend.poll()
    parent = next(g for g in reading.gpus if g.info.index == 1 and not g.info.is_mig_device)
    assert parent.info.mig_enabled
    assert parent.memory_used_bytes == 3 * GiB
    assert parent.processes == ()  # processes are read per MIG device
    assert parent.sm_util_percent is None  # NVML has no utilisation in MIG mode

    devices = {g.info.uuid: g for g in mig_readings(reading)}
    assert set(devices) == {d.uuid for d in model.gpus[1].mig_devices if d is not None}
    three = devices[big(1).uuid]
    assert three.info.mig_profile == "3g.40gb"
    assert three.info.memory_total_bytes == 40192 << 20
    assert (three.info.gpu_instance_id, three.info.compute_instance_id) == (1, 0)
    assert three.info.parent_uuid == model.gpus[1].uuid
    assert three.info.index == 1
    assert three.info.name == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"

    busy = devices[small(9).uuid]
    assert busy.info.mig_profile == "1g.10gb"
    assert [(p.pid, p.used_memory_bytes, p.sm_util_percent) for p in busy.processes] == [
        (4242, 2 * GiB, None)
    ]
    assert busy.sm_util_percent is None
    assert all(g.healthy for g in reading.gpus)
    # The GPU without MIG keeps its utilisation.
    assert next(g for g in reading.gpus if g.info.index == 0).sm_util_percent == 0.0
    # Utilisation was never asked of a MIG device, and the GPU in MIG mode was not sampled.
    assert model.calls[("nvmlDeviceGetProcessUtilization", 1)] == 0
    assert "NVML has no utilisation per MIG device" in caplog.text


def test_a_re_partitioning_is_seen_at_the_next_poll(model: NvmlModel, backend: NvmlBackend) -> None:
    before = {g.info.uuid for g in mig_readings(backend.poll())}
    model.gpus[1].mig_devices = [None, None, small(9), small(10), small(11), small(12)]

    after = {g.info.uuid: g.info.mig_profile for g in mig_readings(backend.poll())}

    assert big(1).uuid in before
    assert after == {small(n).uuid: "1g.10gb" for n in (9, 10, 11, 12)}
    assert all(g.healthy for g in backend.poll().gpus)


def test_an_xid_naming_a_gpu_instance_takes_only_that_mig_device_out(
    model: NvmlModel, backend: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    wakes: list[None] = []
    backend.set_wake(lambda: wakes.append(None))
    model.emit_xid(1, 79, gpu_instance_id=9)
    eventually(lambda: not all(g.healthy for g in backend.poll().gpus))
    # The poll loop was told at once, not left to find it at its next (maybe idle) poll.
    assert len(wakes) == 1

    reading = backend.poll()
    health = {g.info.uuid: g.healthy for g in reading.gpus}
    assert health[small(9).uuid] is False
    assert health[small(10).uuid] is True
    assert health[big(1).uuid] is True
    assert health[model.gpus[1].uuid] is True
    faulty = next(g for g in reading.gpus if g.info.uuid == small(9).uuid)
    assert faulty.health_reason == "Xid 79 (GPU has fallen off the bus) in GPU instance 9"
    assert "critical Xid on a MIG device index=1" in caplog.text
    assert backend.health_stats[1].xids == {79: 1}


def test_an_xid_naming_no_instance_takes_the_gpu_and_all_its_mig_devices_out(
    model: NvmlModel, backend: NvmlBackend
) -> None:
    model.emit_xid(1, 79)
    eventually(lambda: not all(g.healthy for g in backend.poll().gpus))

    reading = backend.poll()
    assert [g.healthy for g in reading.gpus if g.info.index == 1] == [False] * 4
    assert next(g for g in reading.gpus if g.info.index == 0).healthy


def test_a_mig_device_that_fails_to_answer_marks_its_gpu_unhealthy(
    model: NvmlModel, backend: NvmlBackend
) -> None:
    model.fail("nvmlDeviceGetGpuInstanceId", model.NVML_ERROR_UNKNOWN, gpu=1)

    reading = backend.poll()

    parent = next(g for g in reading.gpus if g.info.index == 1)
    assert not parent.healthy
    assert "reading a MIG device failed with NVML_ERROR_UNKNOWN" in parent.health_reason
    assert next(g for g in reading.gpus if g.info.index == 0).healthy


def test_a_mig_device_destroyed_while_it_is_read_is_skipped(
    model: NvmlModel, backend: NvmlBackend
) -> None:
    backend.poll()
    model.fail("nvmlDeviceGetUUID", model.NVML_ERROR_NOT_FOUND, gpu=1, times=1)

    reading = backend.poll()

    assert all(g.healthy for g in reading.gpus)
    assert len(mig_readings(reading)) == 2  # one of the three read NOT_FOUND: gone
