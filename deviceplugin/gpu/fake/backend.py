"""FakeBackend: serves the GPUs of a state file, with utilisation modelled from the real run
state of the listed processes (see `sampler`).

The file is re-read whenever it changes (inode, size or mtime). A malformed or missing file is
logged once per distinct problem, and the last good state stays in force.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from deviceplugin.errors import BackendError, StateFileError
from deviceplugin.gpu.cgrouptree import DirectoryTree
from deviceplugin.gpu.fake.charging import ProcessCharges
from deviceplugin.gpu.fake.memlimits import FakeMemoryLimits, stores
from deviceplugin.gpu.fake.partitionstate import FakePartitions, default_path
from deviceplugin.gpu.fake.sampler import (
    _MANY_PROCESSES,
    _NOT_RUNNING_STATES,
    _SAMPLER_CPU_BUDGET,
    _SAMPLER_CPU_BUDGET_MANY,
    _STAT_READ_BYTES,
    _instant_utilisation,
    proc_stat_state,
)
from deviceplugin.gpu.fake.state import FakeGpu
from deviceplugin.gpu.fake.statefile import _decode_state, read_bounded, read_state_file
from deviceplugin.gpu.samples import SampleReuse
from deviceplugin.model import GpuReading, NodeReading, ProcessSample
from deviceplugin.partitions import MemoryLimits, PartitionSupport

logger = logging.getLogger(__name__)

_CLOSE_JOIN_TIMEOUT_S = 5.0


_Signature = tuple[int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# The backend


class FakeBackend:
    """A GpuBackend serving the GPUs of a state file, with utilisation modelled from the real run
    state of the listed processes. Starts a daemon sampler thread; `close` stops it.

    Memory limits (docs/design.md §15) are set on cgroups under `cgroup_root` (a directory laid
    out like the unified hierarchy, or the hierarchy itself) and kept in `partitions_path`
    (default: `<path>.memory-limits.json`); `wall_clock` stamps when each was set."""

    def __init__(
        self,
        path: Path,
        *,
        sample_interval_s: float = 0.02,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        partitions_path: Path | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be positive, got {sample_interval_s}")
        self._path = Path(path)
        self._sample_interval_s = sample_interval_s
        self._proc_root = str(proc_root)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set when there are processes to sample again (or on close): an idle sampler waits on it.
        self._wake = threading.Event()
        self._closed = False
        self._sampler_error: BaseException | None = None

        try:
            st = os.stat(self._path)
        except FileNotFoundError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: state file {self._path} does not exist; "
                'create it with a JSON object like {"gpus": [{"uuid": "GPU-...", "index": 0, '
                '"name": "...", "memory_total_bytes": ..., "minor": 0}]} '
                "or point --backend fake:PATH at an existing file"
            ) from e
        except OSError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: state file {self._path} cannot be read: "
                f"{e.strerror or e}; check the path and its permissions"
            ) from e
        try:
            self._state = read_state_file(self._path)
        except StateFileError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: {e}; fix the file and start again"
            ) from e

        self._partitions = FakePartitions(
            partitions_path or default_path(self._path),
            DirectoryTree(cgroup_root, dmem="always"),
            wall_clock,
        )
        self._partitions.sync(stores(self._state))
        self._limits = FakeMemoryLimits(self._partitions, lambda: self._state)
        # A process gets only what its cgroup's hard limits leave (charging).
        self._charges = ProcessCharges(self._partitions, Path(proc_root))
        self._signature: _Signature | None = _signature(st)
        self._problem: str | None = None
        # Utilisation: the latest instantaneous value per (gpu uuid, pid), and its integral
        # (percent x seconds) since the window began at the previous poll.
        now = clock()
        self._window_start = now
        self._integrated_until = now
        self._current: dict[tuple[str, int], float] = {}
        self._integrated: dict[tuple[str, int], float] = {}
        # Since when `_current` holds (a sampling round that finds the same utilisation keeps
        # it), and per GPU UUID the last poll's (FakeGpu, utilisation dict, reading): a GPU
        # whose state and utilisation are those of the last poll reads the same again.
        self._current_since = now
        self._last_read: dict[str, tuple[FakeGpu, dict[tuple[str, int], float], GpuReading]] = {}
        # Health transitions, counted where polls see them (the file may flip and flip back
        # between two polls unseen, as a real GPU's health can between two reads).
        self._healthy_before: dict[str, bool] = {}
        self._unhealthy_transitions: dict[str, int] = {}
        self._samples = SampleReuse()
        self._generation = 0
        self._plan: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
        self._sampled_pids: frozenset[int] = frozenset()
        self._set_plan()

        # The first sampling round runs here, so that the first poll's window is fully measured
        # and a /proc that cannot be read stops the start rather than the first poll.
        try:
            self._sample_round()
        except Exception as e:
            raise BackendError(
                f"cannot start the fake GPU backend: reading the processes' run state under "
                f"{self._proc_root} failed: {e!r}"
            ) from e
        self._window_start = self._integrated_until

        self._thread = threading.Thread(
            target=self._run_sampler, name=f"fake-gpu-sampler:{self._path.name}", daemon=True
        )
        self._thread.start()
        logger.info(
            "fake GPU backend started path=%s gpus=%d sample_interval_s=%s",
            self._path,
            len(self._state.gpus),
            sample_interval_s,
        )

    @property
    def name(self) -> str:
        return f"fake:{self._path}"

    def poll(self) -> NodeReading:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self.name}: poll after close")
            if self._sampler_error is not None:
                error = self._sampler_error
                raise BackendError(
                    f"{self.name}: the process sampler failed ({error!r}); "
                    "utilisation can no longer be measured, see the traceback logged earlier"
                ) from error
            self._refresh()
            now = self._clock()
            self._advance(now)
            window_s = now - self._window_start
            if self._current_since <= self._window_start or window_s <= 0:
                average = self._current  # the same all along: its average, exactly
            else:
                average = {key: total / window_s for key, total in self._integrated.items()}
            self._integrated = {}
            self._window_start = now
            state = self._state

        readings: list[GpuReading] = []
        for gpu in sorted(state.gpus, key=lambda g: g.index):
            gpu = self._charges.apply(gpu)  # noqa: PLW2901 (what the driver let them allocate)
            if not gpu.healthy and self._healthy_before.get(gpu.uuid, True):
                self._unhealthy_transitions[gpu.uuid] = (
                    self._unhealthy_transitions.get(gpu.uuid, 0) + 1
                )
            self._healthy_before[gpu.uuid] = gpu.healthy
            if gpu.mig_enabled and gpu.mig_block:
                readings.extend(self._mig_readings(gpu))
                continue
            last = self._last_read.get(gpu.uuid)
            transitions = self._unhealthy_transitions.get(gpu.uuid, 0)
            if (
                last is not None
                and last[0] is gpu
                and last[1] is average
                and last[2].unhealthy_transitions == transitions
            ):
                readings.append(last[2])  # nothing about it changed since the last poll
                for sample in last[2].processes:
                    self._samples.keep((gpu.uuid, sample.pid), sample)
                continue
            # One plain loop over the processes: hundreds of them on a full node, every poll.
            samples: list[ProcessSample] = []
            memory_used_bytes = 0
            sm_util_percent = 0.0
            for p in gpu.processes:
                key = (gpu.uuid, p.pid)
                util = average.get(key, 0.0)
                samples.append(self._samples.sample(key, p.pid, p.used_memory_bytes, util))
                memory_used_bytes += p.used_memory_bytes
                sm_util_percent += util
            reading = GpuReading(
                info=gpu.info,
                healthy=gpu.healthy,
                health_reason=gpu.health_reason,
                memory_used_bytes=memory_used_bytes,
                sm_util_percent=min(100.0, sm_util_percent),
                processes=tuple(samples),
                unhealthy_transitions=transitions,
            )
            self._last_read[gpu.uuid] = (gpu, average, reading)
            readings.append(reading)
        self._samples.next_poll()
        return NodeReading(timestamp_s=now, gpus=tuple(readings))

    def _mig_readings(self, gpu: FakeGpu) -> list[GpuReading]:
        """A GPU in MIG mode, as NVML reports it: the GPU with the memory its MIG devices use,
        and no utilisation, then each MIG device with its own memory and processes and no
        utilisation either (NVML samples none per MIG device)."""
        transitions = self._unhealthy_transitions.get(gpu.uuid, 0)
        readings = [
            GpuReading(
                info=gpu.info,
                healthy=gpu.healthy,
                health_reason=gpu.health_reason,
                memory_used_bytes=sum(
                    p.used_memory_bytes for d in gpu.mig_devices for p in d.processes
                ),
                sm_util_percent=None,
                unhealthy_transitions=transitions,
            )
        ]
        for device in sorted(gpu.mig_devices, key=lambda d: d.uuid):
            readings.append(
                GpuReading(
                    info=gpu.mig_info(device),
                    healthy=gpu.healthy,
                    health_reason=gpu.health_reason,
                    memory_used_bytes=sum(p.used_memory_bytes for p in device.processes),
                    sm_util_percent=None,
                    processes=tuple(
                        self._samples.sample((device.uuid, p.pid), p.pid, p.used_memory_bytes, None)
                        for p in device.processes
                    ),
                )
            )
        return readings

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=_CLOSE_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning(
                "fake GPU sampler did not stop path=%s timeout_s=%s",
                self._path,
                _CLOSE_JOIN_TIMEOUT_S,
            )
        else:
            logger.info("fake GPU backend closed path=%s", self._path)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Nothing to report between polls: the state file is read at each poll."""

    # -- memory partitions (docs/design.md §15): any thread, the state file as last read ------

    def _limit_calls(self) -> FakeMemoryLimits:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self.name}: used after close")
            self._refresh()
        return self._limits

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        return self._limit_calls().memory_partitioning()

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None:
        self._limit_calls().set_memory_limits(gpu_uuid, cgroup, soft_bytes, hard_bytes)

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        return self._limit_calls().get_memory_limits(gpu_uuid, cgroup)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        return self._limit_calls().clear_memory_limits(gpu_uuid, cgroup)

    @property
    def partitions(self) -> FakePartitions:
        """The fake driver's partitions (for tests and the demo)."""
        return self._partitions

    def __enter__(self) -> FakeBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- state file (callers hold the lock) ------------------------------------------------

    def _refresh(self) -> None:
        """Re-read the state file if it changed; keep the last good state if it is bad."""
        try:
            st = os.stat(self._path)
            if _signature(st) == self._signature:
                return
            st, content = read_bounded(self._path)
            signature = _signature(st)
        except StateFileError as e:
            self._signature = None
            self._reject(str(e))
            return
        except FileNotFoundError:
            self._signature = None
            self._reject("the file does not exist")
            return
        except OSError as e:
            self._signature = None
            self._reject(f"the file cannot be read: {e.strerror or e}")
            return
        self._signature = signature
        try:
            state = _decode_state(content)
        except StateFileError as e:
            self._reject(str(e))
            return
        recovered = self._problem is not None
        self._problem = None
        if recovered:
            logger.info("state file accepted again path=%s gpus=%d", self._path, len(state.gpus))
        elif state != self._state:
            logger.info("state file reloaded path=%s gpus=%d", self._path, len(state.gpus))
        if state != self._state:
            self._advance(self._clock())
            self._state = state
            self._set_plan()
            self._partitions.sync(stores(state))

    def _reject(self, problem: str) -> None:
        if problem != self._problem:
            logger.error(
                "state file rejected path=%s error=%s; keeping the last good state",
                self._path,
                problem,
            )
        self._problem = problem

    def _set_plan(self) -> None:
        self._plan = tuple(
            (
                gpu.uuid,
                # A GPU in MIG mode reports no utilisation: nothing of it to sample.
                ()
                if gpu.mig_block and gpu.mig_enabled
                else tuple((p.pid, float(p.sm_demand_percent)) for p in gpu.processes),
            )
            for gpu in self._state.gpus
        )
        self._sampled_pids = frozenset(
            pid for _, processes in self._plan for pid, demand in processes if demand > 0
        )
        self._generation += 1
        if self._sampled_pids:
            self._wake.set()
        # Processes that left the file stop accruing; new ones start at the next sampling round.
        keys = {(uuid, pid) for uuid, processes in self._plan for pid, _ in processes}
        self._current = {k: v for k, v in self._current.items() if k in keys}
        self._current_since = self._clock()

    # -- utilisation ------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Credit the current instantaneous utilisation up to `now` (caller holds the lock)."""
        elapsed = now - self._integrated_until
        if elapsed <= 0:
            return
        for key, util in self._current.items():
            self._integrated[key] = self._integrated.get(key, 0.0) + util * elapsed
        self._integrated_until = now

    def _is_running(self, pid: int) -> bool:
        # os.open/os.read rather than open(): half the CPU time for a file of one short line,
        # read for every sampled process many times a second.
        try:
            fd = os.open(f"{self._proc_root}/{pid}/stat", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):
            return False
        try:
            content = os.read(fd, _STAT_READ_BYTES)
        except ProcessLookupError:
            return False  # exited between the open and the read
        finally:
            os.close(fd)
        return proc_stat_state(content) not in _NOT_RUNNING_STATES

    def _sample_round(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._refresh()
            generation = self._generation
            plan = self._plan
            pids = self._sampled_pids
        running = {pid: self._is_running(pid) for pid in pids}
        now = self._clock()
        utils = _instant_utilisation(plan, running)
        with self._lock:
            if generation != self._generation:
                return  # the state changed meanwhile; the next round samples the new one
            self._advance(now)
            if utils != self._current:
                self._current = utils
                self._current_since = now

    def _run_sampler(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    idle = not self._sampled_pids
                if idle:
                    # Nothing to sample: no timer until a poll finds processes in the file.
                    self._wake.wait()
                    self._wake.clear()
                    continue
                started_cpu_s = time.thread_time()
                started_s = time.perf_counter()
                self._sample_round()
                cost_s = time.thread_time() - started_cpu_s
                took_s = time.perf_counter() - started_s
                with self._lock:
                    many = len(self._sampled_pids) > _MANY_PROCESSES
                budget = _SAMPLER_CPU_BUDGET_MANY if many else _SAMPLER_CPU_BUDGET
                period_s = max(self._sample_interval_s, cost_s / budget)
                self._stop.wait(max(0.0, period_s - took_s))
        except Exception as e:
            logger.exception("fake GPU sampler failed path=%s; polls will fail", self._path)
            with self._lock:
                self._sampler_error = e
