"""The nvml backend's GPU memory partitions against the driver model (tests/support/
nvml_partitions.py) on a directory laid out like the unified hierarchy: detection per GPU and its
reasons, the probe and its clean-up, and limits set, read and cleared with the driver's codes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config import HealthConfig
from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.nvml import NvmlBackend
from deviceplugin.gpu.nvml.partitions import (
    CGROUP2_SUPER_MAGIC,
    CgroupHost,
    dmem_devices,
    filesystem_magic,
    normal_bus_id,
)
from deviceplugin.partitions import (
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimits,
    PartitionMode,
    PollCause,
)
from tests.support.cgroup_tree import Hierarchy, leaf_of
from tests.support.nvml_model import ModelGpu, NvmlModel, model_gpus

GiB = 1 << 30
LEAF = leaf_of("app")
PROBE_ROOT = "/vgpu.slice"
POD_ROOTS = ("/kubepods/burstable", "/kubepods/besteffort")


class Rig:
    def __init__(self, base: Path) -> None:
        self.cgroups = Hierarchy(base)
        self.cgroups.mkdir(PROBE_ROOT)
        self.cgroups.mkdir(LEAF)
        self.cgroups.mkdir("/kubepods/besteffort")
        self.gpus: list[ModelGpu] = model_gpus(2)
        for g in self.gpus:
            g.memory_partitions = "dmem"
        # GPU 0 is accounted by the dmem controller; GPU 1 is not (the driver's misc store).
        self.gpus[1].memory_partitions = "misc"
        (self.cgroups.root / "dmem.capacity").write_text(
            "nvidia/0000:10:00.0/vidmem 85899345920\nnvidia/junk\n\n"
        )
        self.model = NvmlModel(self.gpus, driver_version="615.71.09", cgroup_root=self.cgroups.root)
        self.magic = CGROUP2_SUPER_MAGIC
        self.backends: list[NvmlBackend] = []

    def host(self, **changes: Any) -> CgroupHost:
        options: dict[str, Any] = {
            "mount": self.cgroups.root,
            "probe_root": PROBE_ROOT,
            "pod_roots": POD_ROOTS,
            "fs_magic": lambda _path: self.magic,
        }
        options.update(changes)
        return CgroupHost(**options)

    def backend(self, **host: Any) -> NvmlBackend:
        backend = NvmlBackend(
            HealthConfig(enabled=False),
            nvml=self.model,
            cgroups=self.host(**host),
            limit_timeout_s=0.5,
        )
        self.backends.append(backend)
        return backend

    def modes(self, backend: NvmlBackend) -> dict[str, tuple[PartitionMode, PollCause]]:
        return {u: (s.mode, s.cause) for u, s in backend.memory_partitioning().items()}


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.model.release_all()
        for backend in r.backends:
            backend.close()


def uuid(rig: Rig, index: int) -> str:
    return rig.gpus[index].uuid


# -- detection -----------------------------------------------------------------------------------


def test_dmem_where_dmem_capacity_lists_the_gpu_and_misc_elsewhere(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="deviceplugin.gpu.nvml")
    backend = rig.backend()
    assert rig.modes(backend) == {
        uuid(rig, 0): (PartitionMode.DMEM, PollCause.NONE),
        uuid(rig, 1): (PartitionMode.MISC, PollCause.NONE),
    }
    assert f"gpu memory enforcement index=0 uuid={uuid(rig, 0)} mode=driver-dmem" in caplog.text
    # The probe's cgroups are gone, and the driver holds nothing on them.
    assert list(rig.cgroups.path(PROBE_ROOT).iterdir()) != []  # its own files only
    assert not [p for p in rig.cgroups.path(PROBE_ROOT).iterdir() if p.is_dir()]
    assert rig.model.partitions(0).limits == {}
    assert rig.model.partitions(1).limits == {}
    assert rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)] == 2  # set, then clear
    assert rig.model.calls[("nvmlDeviceGetMemoryLimits_v1", 0)] == 1


def test_a_driver_before_615_is_polled_without_a_call(rig: Rig) -> None:
    rig.model.driver_version = "580.95.05"
    backend = rig.backend()
    for support in backend.memory_partitioning().values():
        assert support.cause == PollCause.DRIVER_TOO_OLD
        assert "580.95.05 predates memory partitions (615)" in support.reason
    assert rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)] == 0


def test_a_binding_without_the_calls_is_polled(rig: Rig) -> None:
    rig.model.hide("nvmlDeviceSetMemoryLimits_v1")
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.FUNCTION_NOT_FOUND
    assert "nvidia-ml-py" in support.reason


def test_a_library_without_the_symbol_fails_the_probe_as_function_not_found(rig: Rig) -> None:
    rig.model.fail("nvmlDeviceSetMemoryLimits_v1", rig.model.NVML_ERROR_FUNCTION_NOT_FOUND)
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.FUNCTION_NOT_FOUND
    assert "NVML_ERROR_FUNCTION_NOT_FOUND" in support.reason


def test_a_hierarchy_that_is_not_cgroup_v2_is_polled(rig: Rig) -> None:
    rig.magic = 0x01021994  # tmpfs: the v1 or hybrid /sys/fs/cgroup
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.NOT_CGROUP_V2
    assert "0x1021994" in support.reason


def test_mig_mode_is_polled(rig: Rig) -> None:
    rig.gpus[0].mig_enabled = True
    backend = rig.backend()
    assert rig.modes(backend)[uuid(rig, 0)] == (PartitionMode.POLL, PollCause.MIG)
    assert rig.modes(backend)[uuid(rig, 1)] == (PartitionMode.MISC, PollCause.NONE)


def test_dmem_with_a_level_lacking_dmem_down_to_the_pods_is_polled_naming_it(rig: Rig) -> None:
    (rig.cgroups.path("/kubepods") / "cgroup.subtree_control").write_text("cpu memory\n")
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.DMEM_GAP
    assert support.dmem_gaps == ("/kubepods",)
    assert "/kubepods" in support.reason
    # misc does not need the dmem chain.
    assert rig.modes(backend)[uuid(rig, 1)] == (PartitionMode.MISC, PollCause.NONE)


def test_no_probe_root_no_enforcement(rig: Rig) -> None:
    backend = rig.backend(probe_root=None)
    assert {s.cause for s in backend.memory_partitioning().values()} == {PollCause.NO_PROBE_ROOT}


def test_a_probe_the_driver_refuses_is_polled_with_its_code(rig: Rig) -> None:
    # dmem: the probe root does not enable dmem for its children, so the probe has no dmem files.
    (rig.cgroups.path(PROBE_ROOT) / "cgroup.subtree_control").write_text("cpu\n")
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.PROBE_FAILED
    assert "NVML_ERROR_NOT_FOUND" in support.reason
    assert "no such cgroup, or it has no dmem files" in support.reason
    assert not [p for p in rig.cgroups.path(PROBE_ROOT).iterdir() if p.is_dir()]


def test_a_daemon_that_is_not_root_is_polled(rig: Rig) -> None:
    rig.model.partition_model.root_user = False
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 1)]
    assert support.cause == PollCause.PROBE_FAILED
    assert "NVML_ERROR_NO_PERMISSION" in support.reason
    assert "needs root" in support.reason


def test_a_readback_that_differs_is_a_failed_probe(rig: Rig) -> None:
    original = rig.model.nvmlDeviceGetMemoryLimits_v1

    def lying_get(handle: object, limits: Any) -> None:
        original(handle, limits)
        limits.hardLimit = 12345

    rig.model.nvmlDeviceGetMemoryLimits_v1 = lying_get  # type: ignore[method-assign]
    backend = rig.backend()
    support = backend.memory_partitioning()[uuid(rig, 0)]
    assert support.cause == PollCause.PROBE_FAILED
    assert "read back soft 0 hard 12345" in support.reason


def test_detection_runs_again_on_request(rig: Rig) -> None:
    backend = rig.backend()
    rig.gpus[0].memory_partitions = None
    backend.redetect_memory_partitioning()
    assert rig.modes(backend)[uuid(rig, 0)] == (PartitionMode.POLL, PollCause.PROBE_FAILED)


# -- limits --------------------------------------------------------------------------------------


def test_set_get_and_clear_on_a_container_with_what_cuda_then_sees(rig: Rig) -> None:
    backend = rig.backend()
    backend.set_memory_limits(uuid(rig, 0), LEAF, GiB, 8 * GiB)
    assert backend.get_memory_limits(uuid(rig, 0), LEAF) == MemoryLimits(GiB, 8 * GiB, 0)
    cuda = rig.model.partitions(0)  # what a process in the cgroup sees
    assert cuda.mem_get_info(LEAF) == (8 * GiB, 8 * GiB)
    assert cuda.charge(LEAF, 6 * GiB)
    assert not cuda.charge(LEAF, 3 * GiB)  # CUDA_ERROR_OUT_OF_MEMORY
    assert backend.get_memory_limits(uuid(rig, 0), LEAF) == MemoryLimits(GiB, 8 * GiB, 6 * GiB)
    pod = LEAF.rsplit("/", 1)[0]
    assert rig.model.partitions(0).limits[pod].soft_bytes == GiB
    assert backend.clear_memory_limits(uuid(rig, 0), LEAF)
    assert backend.get_memory_limits(uuid(rig, 0), LEAF) is None
    assert pod not in rig.model.partitions(0).limits
    assert cuda.mem_get_info(LEAF)[1] == rig.gpus[0].memory_total_bytes


def test_misc_reads_no_limit_as_none(rig: Rig) -> None:
    backend = rig.backend()
    assert backend.get_memory_limits(uuid(rig, 1), LEAF) is None
    backend.set_memory_limits(uuid(rig, 1), LEAF, 0, 2 * GiB)
    assert backend.get_memory_limits(uuid(rig, 1), LEAF) == MemoryLimits(0, 2 * GiB, 0)


def test_driver_refusals_name_the_gpu_the_cgroup_and_the_code(rig: Rig) -> None:
    backend = rig.backend()
    with pytest.raises(MemoryLimitError) as raised:
        backend.set_memory_limits(uuid(rig, 0), "/kubepods/gone", 0, GiB)
    assert raised.value.code == NVML_ERROR_NOT_FOUND
    assert raised.value.code_name == "NVML_ERROR_NOT_FOUND"
    assert uuid(rig, 0) in str(raised.value)
    assert "/kubepods/gone" in str(raised.value)
    rig.model.partition_model.root_user = False
    with pytest.raises(MemoryLimitError) as raised:
        backend.set_memory_limits(uuid(rig, 0), LEAF, 0, GiB)
    assert raised.value.code == NVML_ERROR_NO_PERMISSION
    with pytest.raises(MemoryLimitError, match="no GPU GPU-unknown"):
        backend.set_memory_limits("GPU-unknown", LEAF, 0, GiB)


def test_a_polled_gpu_refuses_before_any_call(rig: Rig) -> None:
    rig.gpus[0].mig_enabled = True
    backend = rig.backend()
    before = rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)]
    with pytest.raises(MemoryLimitError) as raised:
        backend.set_memory_limits(uuid(rig, 0), LEAF, 0, GiB)
    assert raised.value.code == NVML_ERROR_NOT_SUPPORTED
    assert "MIG" in str(raised.value)
    assert rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)] == before


def test_a_hung_call_is_bounded_by_the_limit_timeout(rig: Rig) -> None:
    backend = rig.backend()
    with (
        rig.model.blocked("nvmlDeviceSetMemoryLimits_v1", gpu=0),
        pytest.raises(MemoryLimitError, match=r"did not answer within 0\.5s") as raised,
    ):
        backend.set_memory_limits(uuid(rig, 0), LEAF, 0, GiB)
    assert raised.value.code is None


def test_clear_of_a_hard_limit_alone_lifts_it_in_one_set(rig: Rig) -> None:
    backend = rig.backend()
    backend.set_memory_limits(uuid(rig, 0), LEAF, 0, GiB)
    sets = rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)]
    assert backend.clear_memory_limits(uuid(rig, 0), LEAF)
    assert rig.model.calls[("nvmlDeviceSetMemoryLimits_v1", 0)] == sets + 1
    assert rig.model.partitions(0).limits == {}
    assert rig.model.partitions(0).mem_get_info(LEAF)[1] == rig.gpus[0].memory_total_bytes


# -- the host ------------------------------------------------------------------------------------


def test_bus_ids_compare_in_sysfs_form() -> None:
    assert normal_bus_id("00000000:17:00.0") == "0000:17:00.0"
    assert normal_bus_id("0000:17:00.0") == "0000:17:00.0"
    assert normal_bus_id("00000001:AB:00.0") == "0001:ab:00.0"


def test_dmem_capacity_lists_nvidia_regions_only(tmp_path: Path) -> None:
    (tmp_path / "dmem.capacity").write_text(
        "drm/0000:03:00.0/vram0 8589934592\nnvidia/00000000:17:00.0/vidmem 1\nnvidia/x 2\n"
    )
    assert dmem_devices(tmp_path) == frozenset({"0000:17:00.0"})
    assert dmem_devices(tmp_path / "missing") == frozenset()


def test_filesystem_magic_tells_the_unified_hierarchy(tmp_path: Path) -> None:
    assert filesystem_magic(tmp_path) != CGROUP2_SUPER_MAGIC
    with pytest.raises(OSError, match="No such file"):
        filesystem_magic(tmp_path / "missing")
    unified = next(
        (
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[2:3] == ["cgroup2"]
        ),
        None,
    )
    if unified is not None and os.path.isdir(unified):
        assert filesystem_magic(Path(unified)) == CGROUP2_SUPER_MAGIC
