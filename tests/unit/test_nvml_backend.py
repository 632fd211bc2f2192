"""The nvml backend against the driver model (tests/support/nvml_model.py): inventory, processes,
utilisation samples, every NVML error path, hung calls, Xid events, recovery, and shutdown."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config import Config, HealthConfig, RecoveryPolicy
from deviceplugin.errors import BackendError
from deviceplugin.gpu.nvml import (
    XID_MEANINGS,
    NvmlBackend,
    numa_node_from_sysfs,
    open_nvml_backend,
    xid_meaning,
)
from deviceplugin.model import GpuReading, NodeReading, ProcessSample
from tests.support.nvml_model import (
    GiB,
    ModelProcess,
    NvmlModel,
    model_gpus,
    nvml_error,
)

CALL_TIMEOUT_S = 0.3
NVML_LOGGER = "deviceplugin.gpu.nvml"
V3 = "nvmlDeviceGetComputeRunningProcesses_v3"
V2 = "nvmlDeviceGetComputeRunningProcesses_v2"
V1 = "nvmlDeviceGetComputeRunningProcesses"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Rig:
    """A driver model, a clock, and the backends made on them (closed at the end)."""

    def __init__(self, tmp_path: Path) -> None:
        self.model = NvmlModel(model_gpus(2))
        self.clock = FakeClock()
        self.sysfs = tmp_path / "sys"
        self.backends: list[NvmlBackend] = []

    def backend(self, health: HealthConfig | None = None, **options: Any) -> NvmlBackend:
        options.setdefault("call_timeout_s", CALL_TIMEOUT_S)
        options.setdefault("event_wait_timeout_s", 0.02)
        options.setdefault("sysfs_root", self.sysfs)
        options.setdefault("clock", self.clock)
        backend = NvmlBackend(health or HealthConfig(), nvml=self.model, **options)
        self.backends.append(backend)
        return backend

    def numa(self, bus_id: str, content: str) -> None:
        directory = self.sysfs / "bus" / "pci" / "devices" / bus_id
        directory.mkdir(parents=True)
        (directory / "numa_node").write_text(content)


@pytest.fixture
def rig(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Rig]:
    caplog.set_level(logging.DEBUG, logger=NVML_LOGGER)
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.model.release_all()
        for backend in r.backends:
            backend.close()


def eventually(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def gpu_of(reading: NodeReading, index: int) -> GpuReading:
    return next(g for g in reading.gpus if g.info.index == index)


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# --- inventory --------------------------------------------------------------------------------


def test_inventory_reads_every_fact_and_numa_from_sysfs(rig: Rig) -> None:
    rig.model = NvmlModel(model_gpus(3), driver_version="550.54.15", cuda_version=12040)
    gpus = rig.model.gpus
    gpus[1].mig_enabled = True
    gpus[1].name = "NVIDIA A100-SXM4-80GB"
    gpus[2].pci_bus_id = "00000001:AB:00.0"
    rig.numa("0000:10:00.0", "1\n")
    rig.numa("0000:11:00.0", "-1\n")  # the kernel knows no affinity; GPU 2 has no sysfs entry

    backend = rig.backend()
    infos = [g.info for g in backend.poll().gpus]

    assert [i.index for i in infos] == [0, 1, 2]
    assert infos[0].uuid == gpus[0].uuid
    assert infos[0].name == "NVIDIA H100 80GB HBM3"
    assert infos[0].memory_total_bytes == 80 * GiB
    assert [i.minor for i in infos] == [0, 1, 2]
    assert [i.pci_bus_id for i in infos] == [
        "00000000:10:00.0",
        "00000000:11:00.0",
        "00000001:AB:00.0",
    ]
    assert [i.numa_node for i in infos] == [1, None, None]
    assert [i.mig_enabled for i in infos] == [False, True, False]
    assert infos[1].name == "NVIDIA A100-SXM4-80GB"
    assert backend.name == "nvml"
    assert (backend.driver_version, backend.cuda_version) == ("550.54.15", "12.4")


def test_strings_from_older_bindings_are_decoded(rig: Rig) -> None:
    rig.model = NvmlModel(model_gpus(1), bytes_strings=True)

    backend = rig.backend()
    info = backend.poll().gpus[0].info

    assert (info.uuid, info.name) == (rig.model.gpus[0].uuid, rig.model.gpus[0].name)
    assert backend.driver_version == rig.model.driver_version


@pytest.mark.parametrize(
    ("bus_id", "written_as", "content", "expected"),
    [
        ("00000000:17:00.0", "0000:17:00.0", "0\n", 0),
        ("00000000:AB:00.0", "0000:ab:00.0", "3", 3),
        ("0000:3b:00.0", "0000:3b:00.0", "1\n", 1),
        ("00000000:17:00.0", "0000:17:00.0", "-1\n", None),
        ("00000000:17:00.0", "0000:17:00.0", "garbage", None),
        ("00000000:17:00.0", "0000:99:00.0", "1", None),
        ("00010000:01:00.0", "10000:01:00.0", "1", 1),
    ],
    ids=[
        "domain-8-digits",
        "upper-case",
        "domain-4-digits",
        "minus-one",
        "garbage",
        "missing",
        "domain-above-ffff",
    ],
)
def test_numa_node_from_sysfs(
    tmp_path: Path, bus_id: str, written_as: str, content: str, expected: int | None
) -> None:
    directory = tmp_path / "bus" / "pci" / "devices" / written_as
    directory.mkdir(parents=True)
    (directory / "numa_node").write_text(content)

    assert numa_node_from_sysfs(tmp_path, bus_id) == expected


def test_optional_inventory_facts_that_are_not_supported(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode"):
        rig.model.fail(name, rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=1)

    reading = rig.backend().poll()

    info = gpu_of(reading, 1).info
    assert (info.minor, info.pci_bus_id, info.numa_node, info.mig_enabled) == (1, None, None, False)
    assert gpu_of(reading, 1).healthy
    assert gpu_of(reading, 0).info.pci_bus_id == "00000000:10:00.0"
    turned_off = messages(caplog, "gpu measurement turned off index=1")
    assert len(turned_off) == 3
    assert len(messages(caplog, "minor number unknown index=1")) == 1


def test_a_gpu_whose_identity_cannot_be_read_is_left_out(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.fail("nvmlDeviceGetUUID", rig.model.NVML_ERROR_GPU_IS_LOST, gpu=1)

    backend = rig.backend()
    reading = backend.poll()

    assert [g.info.index for g in reading.gpus] == [0]
    assert [s.index for s in backend.health_stats] == [0]
    (line,) = messages(caplog, "gpu left out")
    assert "index=1" in line
    assert "NVML_ERROR_GPU_IS_LOST" in line


def test_an_unexpected_error_during_inventory_leaves_the_gpu_out(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.fail("nvmlDeviceGetName", RuntimeError("binding bug"), gpu=0)

    reading = rig.backend().poll()

    assert [g.info.index for g in reading.gpus] == [1]
    assert messages(caplog, "nvml worker job failed index=0")


def test_a_gpu_whose_inventory_hangs_joins_when_it_answers(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = rig.model.block("nvmlDeviceGetName", gpu=1)
    started = time.monotonic()
    backend = rig.backend(HealthConfig(hang_timeout_s=0.2))

    assert time.monotonic() - started < 2.0
    assert [g.info.index for g in backend.poll().gpus] == [0]
    assert messages(caplog, "gpu inventory still running index=1 call=nvmlDeviceGetName")
    rig.model.unblock(blocker)
    eventually(lambda: len(backend.poll().gpus) == 2)


def test_versions_that_cannot_be_read_are_none(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.model.fail("nvmlSystemGetDriverVersion", rig.model.NVML_ERROR_UNKNOWN)
    rig.model.fail("nvmlSystemGetCudaDriverVersion_v2", rig.model.NVML_ERROR_FUNCTION_NOT_FOUND)

    backend = rig.backend()

    assert (backend.driver_version, backend.cuda_version) == (None, None)
    assert messages(caplog, "NVIDIA driver version unknown")
    assert messages(caplog, "CUDA driver version unknown")


# --- start-up errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 was not found"),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "kernel driver is not loaded"),
        ("NVML_ERROR_NO_PERMISSION", "no permission"),
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "different versions"),
        ("NVML_ERROR_UNKNOWN", "NVML could not start"),
    ],
)
def test_nvml_that_cannot_start_is_a_one_line_backend_error_with_the_hint(
    rig: Rig, code: str, words: str
) -> None:
    rig.model.fail("nvmlInit", getattr(rig.model, code))

    with pytest.raises(BackendError) as raised:
        rig.backend()

    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("cannot start the nvml backend: ")
    assert words in message
    assert code in message
    assert "--backend fake:PATH" in message
    assert rig.model.init_count == 0


def test_a_device_count_failure_is_a_backend_error_and_shuts_nvml_down(rig: Rig) -> None:
    rig.model.fail("nvmlDeviceGetCount", rig.model.NVML_ERROR_UNKNOWN)

    with pytest.raises(BackendError, match="nvmlDeviceGetCount failed with NVML_ERROR_UNKNOWN"):
        rig.backend()

    assert (rig.model.init_count, rig.model.shutdown_count) == (1, 1)
    assert rig.model.event_sets == []


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU driver is present")
def test_open_nvml_backend_without_a_driver_says_what_to_do() -> None:
    with pytest.raises(BackendError, match="--backend fake:PATH"):
        open_nvml_backend(Config())


def test_no_gpus_is_logged(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.model = NvmlModel([])

    assert rig.backend().poll().gpus == ()
    assert messages(caplog, "NVML reports no GPUs")


# --- usage and processes ----------------------------------------------------------------------


def test_memory_utilisation_and_processes(rig: Rig) -> None:
    gpu0 = rig.model.gpus[0]
    gpu0.memory_used_bytes = 5 * GiB
    gpu0.gpu_util_percent = 70
    gpu0.processes = [ModelProcess(101, 2 * GiB), ModelProcess(102, 3 * GiB)]

    reading = rig.backend().poll()

    g = gpu_of(reading, 0)
    assert g.healthy
    assert g.memory_used_bytes == 5 * GiB
    assert g.sm_util_percent == 70.0
    assert g.processes == (ProcessSample(101, 2 * GiB, None), ProcessSample(102, 3 * GiB, None))
    assert gpu_of(reading, 1).processes == ()
    assert reading.timestamp_s == rig.clock.now


def test_memory_that_is_not_reported_is_still_listed(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, None), ModelProcess(102, GiB)]

    g = gpu_of(rig.backend().poll(), 0)

    assert g.processes == (ProcessSample(101, None), ProcessSample(102, GiB))


def test_compute_and_graphics_processes_are_merged_and_listed_once(rig: Rig) -> None:
    rig.model.gpus[0].processes = [
        ModelProcess(101, GiB),
        ModelProcess(102, 2 * GiB, compute=False, graphics=True),
        ModelProcess(103, 3 * GiB, compute=True, graphics=True),
    ]

    g = gpu_of(rig.backend().poll(), 0)

    assert g.processes == (
        ProcessSample(101, GiB),
        ProcessSample(103, 3 * GiB),
        ProcessSample(102, 2 * GiB),
    )


def test_merging_keeps_the_reported_memory_of_a_pid_in_both_lists(rig: Rig) -> None:
    # The graphics call says 2 GiB, the compute call cannot tell: 2 GiB. The reverse too.
    rig.model.hide(V3)
    rig.model.gpus[0].processes = [
        ModelProcess(101, None, compute=True, graphics=False),
        ModelProcess(101, 2 * GiB, compute=False, graphics=True),
        ModelProcess(102, GiB, compute=True, graphics=False),
        ModelProcess(102, None, compute=False, graphics=True),
        ModelProcess(103, GiB, compute=True, graphics=False),
        ModelProcess(103, 2 * GiB, compute=False, graphics=True),
    ]

    g = gpu_of(rig.backend().poll(), 0)

    assert {p.pid: p.used_memory_bytes for p in g.processes} == {
        101: 2 * GiB,
        102: GiB,
        103: 2 * GiB,
    }


def test_implausible_process_memory_and_pids_are_dropped(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, 81 * GiB), ModelProcess(0, GiB)]

    g = gpu_of(rig.backend().poll(), 0)

    assert g.processes == (ProcessSample(101, None),)


@pytest.mark.parametrize(
    ("not_offered", "hidden", "expected_call"),
    [
        ((), (), V3),
        ((V3,), (), V2),
        ((V3, V2), (), V1),
        ((), (V3,), V2),
        ((), (V3, V2), V1),
    ],
    ids=["v3", "v3-not-in-driver", "only-plain-in-driver", "v3-not-in-binding", "only-plain"],
)
def test_process_lists_use_the_newest_call_the_driver_offers(
    rig: Rig, not_offered: tuple[str, ...], hidden: tuple[str, ...], expected_call: str
) -> None:
    for name in not_offered:
        rig.model.fail(name, rig.model.NVML_ERROR_FUNCTION_NOT_FOUND)
    for name in hidden:
        rig.model.hide(name)
    rig.model.gpus[0].processes = [ModelProcess(101, None), ModelProcess(102, GiB)]
    backend = rig.backend()

    for _ in range(3):
        g = gpu_of(backend.poll(), 0)
        rig.clock.advance(1.0)

    # The plain call reports unknown memory as NVML_VALUE_NOT_AVAILABLE: still None here.
    assert g.processes == (ProcessSample(101, None), ProcessSample(102, GiB))
    calls = rig.model.calls
    assert calls[(expected_call, 0)] == 3
    for name in not_offered:
        assert calls[(name, 0)] == 1  # tried once, then never again
    assert g.healthy


def test_no_process_call_at_all_turns_the_list_off_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.hide(V3)
    rig.model.fail(V2, rig.model.NVML_ERROR_FUNCTION_NOT_FOUND)
    rig.model.fail(V1, rig.model.NVMLLibraryMismatchError("mismatch"))
    rig.model.gpus[0].processes = [ModelProcess(101, GiB, graphics=True)]
    backend = rig.backend()

    for _ in range(3):
        g = gpu_of(backend.poll(), 0)
        rig.clock.advance(1.0)

    assert g.healthy
    assert g.processes == (ProcessSample(101, GiB),)  # from the graphics list
    lines = messages(caplog, "measurement='compute processes'")
    assert len(lines) == 2  # once per GPU
    assert "index=0" in lines[0] or "index=0" in lines[1]
    assert all("the driver offers none of" in line for line in lines)


def test_a_process_list_that_is_not_supported_is_turned_off(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    graphics = "nvmlDeviceGetGraphicsRunningProcesses_v3"
    rig.model.fail(graphics, rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.model.gpus[0].processes = [ModelProcess(101, GiB), ModelProcess(102, GiB, graphics=True)]
    backend = rig.backend()

    for _ in range(3):
        g = gpu_of(backend.poll(), 0)
        rig.clock.advance(1.0)

    assert g.healthy
    assert [p.pid for p in g.processes] == [101, 102]
    assert rig.model.calls[(graphics, 0)] == 1
    (line,) = messages(caplog, "measurement='graphics processes'")
    assert "NVML_ERROR_NOT_SUPPORTED" in line


def test_process_lists_are_fetched_at_most_once_per_interval(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    backend = rig.backend(process_list_interval_s=0.5)

    for _ in range(5):
        backend.poll()
    rig.model.gpus[0].processes.append(ModelProcess(102, GiB))
    cached = gpu_of(backend.poll(), 0)
    rig.clock.advance(0.5)
    fresh = gpu_of(backend.poll(), 0)

    assert [p.pid for p in cached.processes] == [101]
    assert [p.pid for p in fresh.processes] == [101, 102]
    assert rig.model.calls[(V3, 0)] == 2
    assert rig.model.calls[("nvmlDeviceGetGraphicsRunningProcesses_v3", 0)] == 2
    assert rig.model.calls[("nvmlDeviceGetMemoryInfo", 0)] == 1 + 7  # inventory, then each poll


def test_a_process_list_that_grew_between_calls_is_retried_next_poll(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    backend = rig.backend()
    backend.poll()
    rig.model.gpus[0].processes.append(ModelProcess(102, GiB))
    rig.model.fail(V3, rig.model.NVML_ERROR_INSUFFICIENT_SIZE, gpu=0, times=1)
    rig.clock.advance(1.0)

    kept = gpu_of(backend.poll(), 0)
    fresh = gpu_of(backend.poll(), 0)

    assert kept.healthy
    assert [p.pid for p in kept.processes] == [101]
    assert [p.pid for p in fresh.processes] == [101, 102]


# --- per-process utilisation samples ----------------------------------------------------------


@pytest.mark.parametrize("driver_filters", [True, False], ids=["driver-filters", "driver-repeats"])
def test_each_utilisation_sample_is_counted_once(rig: Rig, driver_filters: bool) -> None:
    rig.model.filter_samples = driver_filters
    rig.model.gpus[0].processes = [ModelProcess(101, GiB), ModelProcess(102, GiB)]
    rig.model.add_samples(0, [(101, 10, 20, 0), (101, 20, 40, 0), (102, 20, 90, 0)])
    backend = rig.backend()

    first = gpu_of(backend.poll(), 0)
    rig.model.add_samples(0, [(101, 30, 80, 0)])
    second = gpu_of(backend.poll(), 0)

    # Two sample periods (10 and 20): 102 had no sample in the first, so it averages 90 / 2.
    assert {p.pid: p.sm_util_percent for p in first.processes} == {101: 30.0, 102: 45.0}
    # One new period, in which only 101 ran: 102 used nothing.
    assert {p.pid: p.sm_util_percent for p in second.processes} == {101: 80.0, 102: 0.0}
    assert second.healthy


def test_a_stopped_process_counts_as_idle_in_the_periods_it_sat_out(rig: Rig) -> None:
    # A throttled process runs in one period of four; the driver samples only that one.
    rig.model.gpus[0].processes = [ModelProcess(101, GiB), ModelProcess(102, GiB)]
    rig.model.add_samples(
        0,
        [
            (101, 10, 100, 0),
            (102, 10, 0, 0),
            (102, 20, 100, 0),
            (102, 30, 100, 0),
            (102, 40, 100, 0),
        ],
    )

    g = gpu_of(rig.backend().poll(), 0)

    assert {p.pid: p.sm_util_percent for p in g.processes} == {101: 25.0, 102: 75.0}


def test_a_poll_between_two_sample_periods_repeats_the_last_figures(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    rig.model.add_samples(0, [(101, 10, 60, 0)])
    backend = rig.backend()
    measured = gpu_of(backend.poll(), 0)
    rig.clock.advance(0.5)  # the driver's period is longer than the poll: nothing new yet
    between = gpu_of(backend.poll(), 0)
    rig.clock.advance(2.0)  # and long after the last sample: the process is idle
    later = gpu_of(backend.poll(), 0)

    assert [p.sm_util_percent for p in measured.processes] == [60.0]
    assert [p.sm_util_percent for p in between.processes] == [60.0]
    assert [p.sm_util_percent for p in later.processes] == [0.0]


def test_samples_of_processes_not_in_the_list_are_left_out_and_values_clamped(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    rig.model.add_samples(0, [(101, 10, 250, 0), (999, 10, 50, 0)])

    g = gpu_of(rig.backend().poll(), 0)

    assert g.processes == (ProcessSample(101, GiB, 100.0),)


def test_no_samples_at_all_is_not_an_error(rig: Rig) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    # pynvml raises NVMLError(NVML_SUCCESS) when the driver has no samples to size.
    rig.model.fail("nvmlDeviceGetProcessUtilization", rig.model.NVML_SUCCESS, gpu=1)

    reading = rig.backend().poll()

    assert gpu_of(reading, 0).processes == (ProcessSample(101, GiB, None),)
    assert all(g.healthy for g in reading.gpus)


# --- NVML errors while polling ----------------------------------------------------------------


def test_not_supported_turns_a_measurement_off_for_that_gpu_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.gpus[0].processes = [ModelProcess(101, GiB)]
    rig.model.gpus[1].processes = [ModelProcess(201, GiB)]
    rig.model.add_samples(1, [(201, 10, 50, 0)])
    rig.model.add_samples(0, [(101, 10, 50, 0)])
    backend = rig.backend()
    rig.model.fail("nvmlDeviceGetProcessUtilization", rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.model.fail("nvmlDeviceGetUtilizationRates", rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.model.fail("nvmlDeviceGetMemoryInfo", rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=0)

    for _ in range(3):
        reading = backend.poll()

    g0, g1 = gpu_of(reading, 0), gpu_of(reading, 1)
    assert g0.healthy
    assert (g0.memory_used_bytes, g0.sm_util_percent) == (None, None)
    assert g0.processes == (ProcessSample(101, GiB, None),)
    assert g1.memory_used_bytes == 0
    calls = rig.model.calls
    assert calls[("nvmlDeviceGetProcessUtilization", 0)] == 1
    assert calls[("nvmlDeviceGetUtilizationRates", 0)] == 1
    assert calls[("nvmlDeviceGetProcessUtilization", 1)] == 3
    turned_off = messages(caplog, "gpu measurement turned off index=0")
    assert len(turned_off) == 3
    assert any(
        "'process utilisation'" in line and "NVML_ERROR_NOT_SUPPORTED" in line
        for line in turned_off
    )
    assert not messages(caplog, "gpu measurement turned off index=1")


@pytest.mark.parametrize(
    "code",
    [
        "NVML_ERROR_GPU_IS_LOST",
        "NVML_ERROR_UNKNOWN",
        "NVML_ERROR_UNINITIALIZED",
        "NVML_ERROR_RESET_REQUIRED",
    ],
)
@pytest.mark.parametrize("call", ["nvmlDeviceGetMemoryInfo", V3, "nvmlDeviceGetProcessUtilization"])
def test_a_lost_gpu_or_an_unknown_error_marks_only_that_gpu_unhealthy(
    rig: Rig, caplog: pytest.LogCaptureFixture, code: str, call: str
) -> None:
    rig.model.gpus[1].memory_used_bytes = 3 * GiB
    rig.model.gpus[1].processes = [ModelProcess(201, GiB)]
    backend = rig.backend()
    before = gpu_of(backend.poll(), 1)
    rig.model.fail(call, getattr(rig.model, code), gpu=1)
    rig.model.gpus[1].memory_used_bytes = 4 * GiB
    rig.clock.advance(1.0)

    reading = backend.poll()

    g0, g1 = gpu_of(reading, 0), gpu_of(reading, 1)
    assert g0.healthy
    assert not g1.healthy
    assert g1.health_reason.startswith(f"{call} failed with {code}")
    # The last good reading is reported with the GPU out of service.
    assert (g1.memory_used_bytes, g1.processes) == (before.memory_used_bytes, before.processes)
    (line,) = messages(caplog, "gpu marked unhealthy index=1")
    assert code in line
    assert "recovery=manual" in line
    stats = backend.health_stats[1]
    assert (stats.healthy, stats.unhealthy_transitions, stats.nvml_errors) == (False, 1, 1)


def test_an_unexpected_exception_while_reading_marks_the_gpu_unhealthy(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    backend = rig.backend()
    rig.model.fail("nvmlDeviceGetUtilizationRates", RuntimeError("binding bug"), gpu=0)

    g = gpu_of(backend.poll(), 0)

    assert not g.healthy
    assert "unexpected error while reading the GPU: RuntimeError('binding bug')" in g.health_reason
    assert messages(caplog, "gpu read failed unexpectedly index=0")


# --- hung calls -------------------------------------------------------------------------------


def test_a_hung_call_on_one_gpu_never_stalls_the_others(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.gpus[1].memory_used_bytes = GiB
    backend = rig.backend(HealthConfig(hang_timeout_s=10.0))
    backend.poll()
    blocker = rig.model.block("nvmlDeviceGetMemoryInfo", gpu=1)
    rig.model.gpus[0].memory_used_bytes = 2 * GiB
    rig.model.gpus[1].memory_used_bytes = 3 * GiB

    started = time.monotonic()
    first = backend.poll()
    first_s = time.monotonic() - started
    assert blocker.entered.is_set()
    rig.model.gpus[0].memory_used_bytes = 4 * GiB
    started = time.monotonic()
    second = backend.poll()
    second_s = time.monotonic() - started

    # The first poll waits about one call timeout for the hung GPU; the next does not wait.
    assert CALL_TIMEOUT_S * 0.9 <= first_s < CALL_TIMEOUT_S + 0.5
    assert second_s < CALL_TIMEOUT_S * 0.8
    assert gpu_of(first, 0).memory_used_bytes == 2 * GiB
    assert gpu_of(second, 0).memory_used_bytes == 4 * GiB
    # Before the hang threshold the hung GPU keeps its last reading and stays in service.
    assert gpu_of(second, 1).healthy
    assert gpu_of(second, 1).memory_used_bytes == GiB

    rig.clock.advance(10.0)
    started = time.monotonic()
    hung = backend.poll()
    assert time.monotonic() - started < CALL_TIMEOUT_S * 0.8
    g1 = gpu_of(hung, 1)
    assert not g1.healthy
    assert g1.health_reason == "NVML call nvmlDeviceGetMemoryInfo has not returned for 10.0s (hung)"
    assert g1.memory_used_bytes == GiB
    assert gpu_of(hung, 0).healthy
    rig.clock.advance(5.0)
    backend.poll()
    assert len(messages(caplog, "nvml call hung index=1 uuid=")) == 1
    assert backend.health_stats[1].hangs == 1

    # The call returns; with manual recovery the GPU stays out of service.
    rig.model.unblock(blocker)
    eventually(lambda: gpu_of(backend.poll(), 1).memory_used_bytes == 3 * GiB)
    rig.clock.advance(3600.0)
    assert not gpu_of(backend.poll(), 1).healthy


def test_a_hung_gpu_is_unhealthy_within_the_hang_timeout_in_real_time(rig: Rig) -> None:
    backend = rig.backend(HealthConfig(hang_timeout_s=0.3), clock=time.monotonic)
    backend.poll()
    rig.model.block("nvmlDeviceGetUtilizationRates", gpu=0)

    started = time.monotonic()
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy, timeout_s=3.0)

    assert time.monotonic() - started < 0.3 + 2 * CALL_TIMEOUT_S
    assert gpu_of(backend.poll(), 1).healthy


# --- events -----------------------------------------------------------------------------------


def test_a_critical_xid_marks_the_gpu_unhealthy_with_its_meaning(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    backend = rig.backend()
    wakes: list[None] = []
    backend.set_wake(lambda: wakes.append(None))
    assert rig.model.registered_events(0) == (
        rig.model.nvmlEventTypeXidCriticalError | rig.model.nvmlEventTypeDoubleBitEccError
    )

    rig.model.emit_xid(1, 79)
    eventually(lambda: not gpu_of(backend.poll(), 1).healthy)
    rig.model.emit_xid(1, 79)
    eventually(lambda: backend.health_stats[1].critical_xids == 2)
    # The poll loop is woken once, when the GPU turns unhealthy.
    assert len(wakes) == 1

    g1 = gpu_of(backend.poll(), 1)
    assert g1.health_reason == "Xid 79 (GPU has fallen off the bus)"
    assert gpu_of(backend.poll(), 0).healthy
    critical = messages(caplog, "critical Xid index=1")
    assert len(critical) == 2
    assert "xid=79 meaning='GPU has fallen off the bus'" in critical[0]
    (transition,) = messages(caplog, "gpu marked unhealthy index=1")
    assert "Xid 79 (GPU has fallen off the bus)" in transition
    stats = backend.health_stats[1]
    assert stats.xids == {79: 2}
    assert (stats.unhealthy_transitions, stats.ignored_xids) == (1, 0)
    # The reading carries the counters, for the exporter.
    assert (g1.unhealthy_transitions, g1.xid_errors) == (1, ((79, 2),))
    assert (
        gpu_of(backend.poll(), 0).unhealthy_transitions,
        gpu_of(backend.poll(), 0).xid_errors,
    ) == (0, ())


def test_an_application_xid_is_ignored(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    backend = rig.backend()

    wakes: list[None] = []
    backend.set_wake(lambda: wakes.append(None))
    for xid in (13, 31, 43, 45, 68, 109):
        rig.model.emit_xid(0, xid)
    eventually(lambda: backend.health_stats[0].ignored_xids == 6)
    assert wakes == []

    assert gpu_of(backend.poll(), 0).healthy
    lines = messages(caplog, "Xid ignored index=0")
    assert len(lines) == 6
    assert "xid=13 meaning='Graphics Engine Exception'" in lines[0]
    assert backend.health_stats[0].unhealthy_transitions == 0


@pytest.mark.parametrize(
    ("health", "xid", "critical"),
    [
        (HealthConfig(additional_ignored_xids=(79,)), 79, False),
        (HealthConfig(critical_xids=(13,)), 13, True),
        (HealthConfig(ignored_xids=()), 13, True),
        (HealthConfig(ignored_xids=(94,)), 94, False),
        (HealthConfig(ignored_xids=(94,)), 31, True),
    ],
    ids=["additional-ignored", "critical-wins", "no-ignores", "replaced-list", "replaced-drops"],
)
def test_the_ignored_xids_are_configurable(
    rig: Rig, health: HealthConfig, xid: int, critical: bool
) -> None:
    backend = rig.backend(health)

    rig.model.emit_xid(0, xid)
    eventually(lambda: sum(backend.health_stats[0].xids.values()) == 1)

    assert gpu_of(backend.poll(), 0).healthy is not critical


def test_a_double_bit_ecc_event_counts_as_xid_48(rig: Rig) -> None:
    backend = rig.backend()

    rig.model.emit(0, rig.model.nvmlEventTypeDoubleBitEccError)
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy)

    assert gpu_of(backend.poll(), 0).health_reason == "Xid 48 (Double Bit ECC Error)"
    # The driver sends the same fault as Xid 48 too: counted once.
    rig.model.emit_xid(0, 48)
    eventually(lambda: backend.health_stats[0].xids == {48: 1})
    assert gpu_of(backend.poll(), 0).xid_errors == ((48, 1),)


def test_mps_clients_are_listed_as_the_gpu_processes(rig: Rig) -> None:
    # Under MPS the compute list shows the MPS server; the clients, the containers' processes,
    # are in the MPS list.
    rig.model.gpus[0].processes = [ModelProcess(50, GiB), ModelProcess(101, 2 * GiB, mps=True)]

    g = gpu_of(rig.backend().poll(), 0)

    assert g.processes == (ProcessSample(50, GiB), ProcessSample(101, 2 * GiB))


def test_other_event_types_are_ignored(rig: Rig) -> None:
    rig.model.gpus[0].supported_events |= rig.model.nvmlEventTypePState
    backend = rig.backend()
    event_set = rig.model.event_sets[0]
    event_set.masks[0] |= rig.model.nvmlEventTypePState

    rig.model.emit(0, rig.model.nvmlEventTypePState)
    rig.model.emit_xid(0, 13)
    eventually(lambda: backend.health_stats[0].ignored_xids == 1)

    assert gpu_of(backend.poll(), 0).healthy
    assert backend.health_stats[0].xids == {13: 1}


def test_a_gpu_without_event_support_is_health_checked_by_polling(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.gpus[1].supported_events = 0
    backend = rig.backend()

    assert rig.model.registered_events(1) == 0
    assert messages(caplog, "gpu reports no Xid or ECC events index=1")
    rig.model.fail("nvmlDeviceGetMemoryInfo", rig.model.NVML_ERROR_GPU_IS_LOST, gpu=1)
    assert not gpu_of(backend.poll(), 1).healthy


def test_event_registration_errors(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.model.fail("nvmlDeviceRegisterEvents", rig.model.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.model.fail("nvmlDeviceRegisterEvents", rig.model.NVML_ERROR_GPU_IS_LOST, gpu=1)

    reading = rig.backend().poll()

    assert gpu_of(reading, 0).healthy
    assert messages(caplog, "gpu measurement turned off index=0")
    assert not gpu_of(reading, 1).healthy
    assert gpu_of(reading, 1).health_reason.startswith(
        "nvmlDeviceRegisterEvents failed with NVML_ERROR_GPU_IS_LOST"
    )


def test_disabled_health_checking_creates_no_event_set(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    backend = rig.backend(HealthConfig(enabled=False))

    assert rig.model.event_sets == []
    assert not [t for t in threading.enumerate() if t.name == "nvml-events"]
    assert messages(caplog, "health_checks=off")
    # A GPU that cannot be read is still taken out of service.
    rig.model.fail("nvmlDeviceGetMemoryInfo", rig.model.NVML_ERROR_GPU_IS_LOST, gpu=0)
    assert not gpu_of(backend.poll(), 0).healthy


def test_an_event_set_that_cannot_be_created_turns_xid_checks_off(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.model.fail("nvmlEventSetCreate", rig.model.NVML_ERROR_NOT_SUPPORTED)

    backend = rig.backend()

    assert messages(caplog, "Xid health checks unavailable")
    assert messages(caplog, "health_checks=off")
    assert all(g.healthy for g in backend.poll().gpus)


def test_failed_event_waits_are_counted_and_retried(
    rig: Rig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("deviceplugin.gpu.nvml.health.EVENT_RETRY_S", 0.01)
    rig.model.fail("nvmlEventSetWait_v2", rig.model.NVML_ERROR_UNKNOWN, times=2)
    rig.model.fail("nvmlEventSetWait_v2", RuntimeError("binding bug"), times=1)
    backend = rig.backend()

    eventually(lambda: backend.event_wait_errors == 3)
    rig.model.emit_xid(0, 79)
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy)

    (line,) = messages(caplog, "waiting for NVML events failed")
    assert "NVML_ERROR_UNKNOWN" in line
    assert messages(caplog, "NVML event handling failed")


def test_the_unversioned_event_wait_is_used_when_v2_is_missing(rig: Rig) -> None:
    rig.model.hide("nvmlEventSetWait_v2")
    backend = rig.backend()

    rig.model.emit_xid(0, 79)
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy)

    assert rig.model.calls[("nvmlEventSetWait", None)] > 0


def test_events_from_another_handle_are_matched_by_uuid(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    class OtherHandle:
        pass

    backend = rig.backend()
    twin = type(rig.model.handles[1])(1)  # the same GPU, another handle object

    rig.model.emit(1, rig.model.nvmlEventTypeXidCriticalError, 79, device=twin)
    eventually(lambda: not gpu_of(backend.poll(), 1).healthy)
    rig.model.emit(0, rig.model.nvmlEventTypeXidCriticalError, 79, device=OtherHandle())
    eventually(lambda: bool(messages(caplog, "NVML event for a device of unknown UUID")))
    rig.model.gpus.append(model_gpus(3)[2])
    rig.model.handles.append(type(twin)(2))
    rig.model.emit(0, rig.model.nvmlEventTypeXidCriticalError, 79, device=rig.model.handles[2])
    eventually(lambda: bool(messages(caplog, "NVML event for a GPU this daemon does not serve")))

    assert gpu_of(backend.poll(), 0).healthy


# --- recovery ---------------------------------------------------------------------------------


def test_manual_recovery_keeps_a_gpu_out_of_service(rig: Rig) -> None:
    backend = rig.backend(HealthConfig(recovery=RecoveryPolicy.MANUAL))
    rig.model.emit_xid(0, 79)
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy)

    for _ in range(3):
        rig.clock.advance(3600.0)
        assert not gpu_of(backend.poll(), 0).healthy
    assert backend.health_stats[0].recoveries == 0


def test_auto_recovery_after_a_quiet_delay(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    backend = rig.backend(HealthConfig(recovery=RecoveryPolicy.AUTO, recovery_delay_s=60.0))
    rig.model.emit_xid(0, 79)
    eventually(lambda: not gpu_of(backend.poll(), 0).healthy)
    # Logged right after the GPU is marked, on the event thread: waited for, not raced.
    eventually(lambda: bool(messages(caplog, "recovery=auto; it returns once it has answered")))

    rig.clock.advance(59.0)
    assert not gpu_of(backend.poll(), 0).healthy
    # A new critical Xid restarts the wait.
    rig.model.emit_xid(0, 94)
    eventually(lambda: backend.health_stats[0].critical_xids == 2)
    rig.clock.advance(2.0)
    assert not gpu_of(backend.poll(), 0).healthy
    rig.clock.advance(60.0)
    g = gpu_of(backend.poll(), 0)

    assert g.healthy
    assert g.health_reason == ""
    (line,) = messages(caplog, "gpu returned to service index=0")
    assert "Xid 79" in line
    stats = backend.health_stats[0]
    assert (stats.unhealthy_transitions, stats.recoveries) == (1, 1)


def test_auto_recovery_needs_a_correct_answer(rig: Rig) -> None:
    backend = rig.backend(HealthConfig(recovery=RecoveryPolicy.AUTO, recovery_delay_s=10.0))
    backend.poll()
    rig.model.fail("nvmlDeviceGetMemoryInfo", rig.model.NVML_ERROR_GPU_IS_LOST, gpu=1)
    assert not gpu_of(backend.poll(), 1).healthy

    for _ in range(3):
        rig.clock.advance(20.0)
        assert not gpu_of(backend.poll(), 1).healthy  # still failing: no way back
    rig.model.heal()
    rig.clock.advance(1.0)
    assert not gpu_of(backend.poll(), 1).healthy  # answering, but not for 10 s yet
    rig.clock.advance(10.0)
    assert gpu_of(backend.poll(), 1).healthy
    assert backend.health_stats[1].recoveries == 1


def test_auto_recovery_waits_for_a_hung_call_to_return(rig: Rig) -> None:
    backend = rig.backend(
        HealthConfig(recovery=RecoveryPolicy.AUTO, recovery_delay_s=5.0, hang_timeout_s=1.0)
    )
    backend.poll()
    blocker = rig.model.block("nvmlDeviceGetMemoryInfo", gpu=0)
    backend.poll()
    rig.clock.advance(2.0)
    assert not gpu_of(backend.poll(), 0).healthy
    rig.clock.advance(10.0)
    assert not gpu_of(backend.poll(), 0).healthy  # still hung

    rig.model.unblock(blocker)
    eventually(
        lambda: (
            gpu_of(backend.poll(), 0).healthy is False
            and rig.model.calls[("nvmlDeviceGetMemoryInfo", 0)] >= 4
        )
    )
    rig.clock.advance(6.0)
    eventually(lambda: gpu_of(backend.poll(), 0).healthy)


# --- close ------------------------------------------------------------------------------------


def test_close_shuts_nvml_down_once_and_stops_its_threads(rig: Rig) -> None:
    backend = rig.backend()
    backend.poll()
    names = {t.name for t in threading.enumerate()}
    assert {"nvml-gpu0", "nvml-gpu1", "nvml-events"} <= names

    with backend:
        pass
    backend.close()

    assert (rig.model.init_count, rig.model.shutdown_count) == (1, 1)
    assert rig.model.event_sets[0].freed
    assert not {"nvml-gpu0", "nvml-gpu1", "nvml-events"} & {t.name for t in threading.enumerate()}
    with pytest.raises(BackendError, match="poll after close"):
        backend.poll()


def test_close_with_a_call_still_hung_leaves_nvml_initialised(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    backend = rig.backend()
    backend.poll()
    rig.model.block("nvmlDeviceGetMemoryInfo", gpu=1)
    backend.poll()
    rig.model.block("nvmlEventSetWait_v2").entered.wait(timeout=2.0)

    started = time.monotonic()
    backend.close()

    assert time.monotonic() - started < 3.0
    assert rig.model.shutdown_count == 0
    (line,) = messages(caplog, "closed without nvmlShutdown")
    assert "nvmlEventSetWait, nvmlDeviceGetMemoryInfo on GPU 1" in line
    assert not rig.model.event_sets[0].freed  # the watcher still holds it


def test_an_unexpected_error_at_start_releases_nvml(rig: Rig) -> None:
    rig.model.fail("nvmlEventSetCreate", RuntimeError("binding bug"))

    with pytest.raises(RuntimeError, match="binding bug"):
        rig.backend()

    assert (rig.model.init_count, rig.model.shutdown_count) == (1, 1)
    eventually(lambda: not {"nvml-gpu0", "nvml-gpu1"} & {t.name for t in threading.enumerate()})


def test_close_logs_nvml_errors(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    backend = rig.backend()
    rig.model.fail("nvmlEventSetFree", rig.model.NVML_ERROR_UNKNOWN)
    rig.model.fail("nvmlShutdown", rig.model.NVML_ERROR_UNKNOWN)

    backend.close()

    assert messages(caplog, "nvmlEventSetFree failed error=NVML_ERROR_UNKNOWN")
    assert messages(caplog, "nvmlShutdown failed error=NVML_ERROR_UNKNOWN")


def test_constructor_arguments_are_checked(rig: Rig) -> None:
    with pytest.raises(ValueError, match="call_timeout_s"):
        rig.backend(call_timeout_s=0)
    with pytest.raises(ValueError, match="event_wait_timeout_s"):
        rig.backend(event_wait_timeout_s=0)


# --- the Xid table ----------------------------------------------------------------------------


def test_xid_meanings() -> None:
    for xid in (13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 74, 79, 92, 94, 95, 109, 119, 120):
        assert XID_MEANINGS[xid]
    assert xid_meaning(79) == "GPU has fallen off the bus"
    assert xid_meaning(12345) == "see NVIDIA's Xid catalog"


def test_the_model_raises_pynvml_errors() -> None:
    error = nvml_error(NvmlModel().NVML_ERROR_GPU_IS_LOST)
    assert type(error).__name__ == "NVMLError_GpuIsLost"
    assert isinstance(error, NvmlModel().NVMLError)
