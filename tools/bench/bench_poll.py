"""Poll benchmark: the cost of one full poll of a GPU backend at 8 GPUs x 64 processes.

    .venv/bin/python -m tools.bench.bench_poll [--polls 200] [--seconds 5]

(run from the repository root; it imports the driver model from tests/support).

- `nvml full`: NvmlBackend against the driver model (tests/support/nvml_model.py) with the
  process-list interval at 0, so that every poll reads everything on all 8 GPUs: memory,
  utilisation, the compute and graphics process lists (64 processes each) and one new
  per-process utilisation sample per process. The model is Python, so its own cost is inside
  these figures: they bound the daemon's Python work from above; the driver's own time (N2: about
  4.5 ms per process list on one laptop GPU) comes on top on real hardware.
- `nvml model`: the driver model alone, making the same calls as one full poll on one thread;
  `nvml full` less this is the backend's own work.
- `nvml paced`: the defaults (process lists at most every 0.5 s), polled every 500 ms.
- `fake full` / `fake paced`: FakeBackend on a state file of 8 GPUs x 64 processes. The processes
  are real: this process and 63 spawned `sleep` children, reused on every GPU, killed at the end.
  Its sampler thread reads their run state every 20 ms.

Columns: time per poll, back to back (p50, p99) and its CPU time (all threads); for the paced runs,
the CPU share of one core at the default poll interval: process CPU time over wall time while
polling every 500 ms for `--seconds`, the backend's threads included (NVML workers and event
watcher, or the fake's sampler). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from deviceplugin.config import HealthConfig
from deviceplugin.gpu.backend import GpuBackend
from deviceplugin.gpu.fake import FakeBackend, FakeGpu, FakeProcess, FakeState, write_state_file
from deviceplugin.gpu.nvml import NvmlBackend
from tests.support.nvml_model import GiB, NvmlModel, model_gpus

GPUS = 8
PROCESSES = 64
POLL_INTERVAL_S = 0.5


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class SampleFeed:
    """New per-process utilisation samples before each poll, as the driver's ring buffer holds
    them: the last round only, with increasing timestamps."""

    def __init__(self, model: NvmlModel) -> None:
        self.model = model
        self.stamp_us = 1_000_000

    def __call__(self) -> None:
        self.stamp_us += 100_000
        for index, gpu in enumerate(self.model.gpus):
            gpu.samples = [(p.pid, self.stamp_us, (p.pid + index) % 100, 10) for p in gpu.processes]


def measure(
    backend: GpuBackend, before: Callable[[], None], polls: int, seconds: float, paced: bool
) -> dict[str, float]:
    """Back to back polls (or paced at the default interval), their wall and CPU time."""
    walls: list[float] = []
    cpu_start = time.process_time()
    wall_start = time.perf_counter()
    if paced:
        deadline = wall_start + seconds
        next_at = wall_start
        while time.perf_counter() < deadline:
            before()
            started = time.perf_counter()
            backend.poll()
            walls.append(time.perf_counter() - started)
            next_at += POLL_INTERVAL_S
            time.sleep(max(0.0, next_at - time.perf_counter()))
    else:
        for _ in range(polls):
            before()
            started = time.perf_counter()
            backend.poll()
            walls.append(time.perf_counter() - started)
    cpu_s = time.process_time() - cpu_start
    wall_s = time.perf_counter() - wall_start
    return {
        "polls": len(walls),
        "p50_ms": statistics.median(walls) * 1000,
        "p99_ms": percentile(walls, 99) * 1000,
        "cpu_per_poll_ms": cpu_s / len(walls) * 1000,
        "cpu_share": cpu_s / wall_s,
    }


def model_alone(polls: int) -> dict[str, float]:
    """The driver model's share of a full poll: the same calls, made directly."""
    model = NvmlModel(model_gpus(GPUS, processes=PROCESSES, first_pid=10_000))
    model.nvmlInit()
    feed = SampleFeed(model)
    walls: list[float] = []
    cpu_start = time.process_time()
    for _ in range(polls):
        feed()
        started = time.perf_counter()
        for handle in model.handles:
            model.nvmlDeviceGetMemoryInfo(handle)
            model.nvmlDeviceGetUtilizationRates(handle)
            model.nvmlDeviceGetComputeRunningProcesses_v3(handle)
            model.nvmlDeviceGetGraphicsRunningProcesses_v3(handle)
            model.nvmlDeviceGetProcessUtilization(handle, feed.stamp_us - 1)
        walls.append(time.perf_counter() - started)
    cpu_s = time.process_time() - cpu_start
    return {
        "polls": len(walls),
        "p50_ms": statistics.median(walls) * 1000,
        "p99_ms": percentile(walls, 99) * 1000,
        "cpu_per_poll_ms": cpu_s / len(walls) * 1000,
    }


@contextlib.contextmanager
def nvml_backend(process_list_interval_s: float) -> Iterator[tuple[GpuBackend, SampleFeed]]:
    model = NvmlModel(model_gpus(GPUS, processes=PROCESSES, first_pid=10_000))
    feed = SampleFeed(model)
    backend = NvmlBackend(
        HealthConfig(),
        nvml=model,
        process_list_interval_s=process_list_interval_s,
        call_timeout_s=1.0,
    )
    try:
        backend.poll()
        yield backend, feed
    finally:
        backend.close()


@contextlib.contextmanager
def sleepers(count: int) -> Iterator[list[int]]:
    """This process's pid and `count` spawned `sleep` children's, killed at the end."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            children.append(subprocess.Popen(["sleep", "3600"]))
        yield [os.getpid(), *(c.pid for c in children)]
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


@contextlib.contextmanager
def fake_backend(pids: list[int]) -> Iterator[GpuBackend]:
    with tempfile.TemporaryDirectory(prefix="vgbench") as root:
        path = Path(root) / "gpus.json"
        gpus = tuple(
            FakeGpu(
                uuid=f"GPU-{index:08x}-0000-4000-8000-000000000000",
                index=index,
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=80 * GiB,
                minor=index,
                numa_node=index // 4,
                processes=tuple(
                    FakeProcess(pid=pid, used_memory_bytes=GiB // 4, sm_demand_percent=2.0)
                    for pid in pids
                ),
            )
            for index in range(GPUS)
        )
        write_state_file(path, FakeState(gpus=gpus))
        backend = FakeBackend(path)
        try:
            backend.poll()
            yield backend
        finally:
            backend.close()


def run(polls: int, seconds: float) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with nvml_backend(0.0) as (backend, feed):
        results["nvml full"] = measure(backend, feed, polls, seconds, paced=False)
    results["nvml model"] = model_alone(polls)
    with nvml_backend(0.5) as (backend, feed):
        results["nvml paced"] = measure(backend, feed, polls, seconds, paced=True)
    with sleepers(PROCESSES - 1) as pids, fake_backend(pids) as fake:
        results["fake full"] = measure(fake, lambda: None, polls, seconds, paced=False)
        results["fake paced"] = measure(fake, lambda: None, polls, seconds, paced=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=200, help="back-to-back polls per backend")
    parser.add_argument("--seconds", type=float, default=5.0, help="paced run length")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    results = run(args.polls, args.seconds)

    print(f"poll cost at {GPUS} GPUs x {PROCESSES} processes (cpu share: one core, 500 ms polls)")
    print(
        f"{'backend':<12} {'polls':>6} {'p50 ms':>8} {'p99 ms':>8} {'cpu/poll ms':>12} "
        f"{'cpu share':>10}"
    )
    for name, r in results.items():
        paced = name.endswith("paced")
        cpu_per_poll = "-" if paced else f"{r['cpu_per_poll_ms']:.2f}"
        share = f"{r['cpu_share'] * 100:.2f}%" if paced else "-"
        print(
            f"{name:<12} {r['polls']:>6.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{cpu_per_poll:>12} {share:>10}"
        )
    print(
        json.dumps(
            {
                "bench": "poll",
                "gpus": GPUS,
                "processes_per_gpu": PROCESSES,
                "python": sys.version.split()[0],
                "results": {
                    name.replace(" ", "_"): {k: round(v, 4) for k, v in r.items()}
                    for name, r in results.items()
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
