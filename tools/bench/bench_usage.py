"""Usage benchmark: per-tick CPU time of process attribution and of the snapshot build.

    .venv/bin/python tools/bench/bench_usage.py [--iterations 200] [--no-real]

Node: 8 GPUs x 32 slices, 256 allocations of one slice each, 64 GPU processes per GPU (512 in
all, two per allocation), polled every 0.5 s with a 5 s utilisation window.
- `resolver cold (fake /proc)`: AllocationResolver.resolve over the 512 PIDs with an empty cache,
  on a fake /proc tree in a temporary directory: per allocation a container's first process with
  VGPU_ALLOCATION_ID, and two GPU processes under it, one with the variable and one started with
  a minimal environment without it (found through its parent).
- `resolver warm (fake /proc)`: the same call again, every PID served from the cache after a
  start-time check (a read of its stat file).
- `builder`: SnapshotBuilder.build alone, for a reading of the 512 processes whose figures
  change at every poll.
- `builder, poll unchanged`: the same, for polls whose samples are those of the poll before
  (most polls on a node whose processes hold still): the attribution is handed out again.
- `tick: warm + builder`: what the daemon spends per poll on both, the cache hitting.
- `... (real /proc)`: the same on 512 real sleeping processes spawned for the purpose, each with
  its allocation's variable (`--no-real` leaves these rows out). Procfs generates a file's
  content on every read; the warm path there checks the stat file's inode instead of reading it.
Figures are CPU time of this process (user + system), p50 and p99 over the iterations. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from deviceplugin.allocation import slice_grants
from deviceplugin.model import (
    AllocationRecord,
    DaemonHealth,
    GpuInfo,
    GpuPlan,
    GpuReading,
    Inventory,
    NodeReading,
    ProcessSample,
    Slice,
    SliceId,
    allocation_id,
)
from deviceplugin.usage.attribution import SnapshotBuilder, Tag
from deviceplugin.usage.procs import ENV_NAME, AllocationResolver

GPUS = 8
SLICES_PER_GPU = 32
PROCESSES_PER_GPU = 64
ALLOCATIONS = GPUS * SLICES_PER_GPU
GPU_MEMORY = 80 << 30
POLL_S = 0.5
WINDOW_S = 5.0
FIRST_GPU_PID = 100_000
FIRST_INIT_PID = 300_000
# A plausible container environment around the one variable the resolver looks for.
NOISE_ENV = {f"SOME_SETTING_{i}": "x" * 40 for i in range(30)} | {
    "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/bin:/usr/bin:/bin",
    "HOME": "/root",
    "NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000",
}


# What a launcher that clears the environment typically leaves.
MINIMAL_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root"}


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def gpu_uuid(g: int) -> str:
    return f"GPU-{g:08x}-0000-0000-0000-000000000000"


def make_inventory() -> Inventory:
    plans: list[GpuPlan] = []
    slices: list[Slice] = []
    memory = GPU_MEMORY // SLICES_PER_GPU
    for g in range(GPUS):
        info = GpuInfo(gpu_uuid(g), g, "NVIDIA A100-SXM4-80GB", GPU_MEMORY, minor=g)
        plans.append(GpuPlan(info, SLICES_PER_GPU, memory, 1 / SLICES_PER_GPU))
        slices.extend(
            Slice(SliceId(info.uuid, n), g, None, memory, 1 / SLICES_PER_GPU, True)
            for n in range(SLICES_PER_GPU)
        )
    return Inventory.of(plans, slices)


def make_allocations(inventory: Inventory) -> list[AllocationRecord]:
    """One allocation per slice of `inventory`, granted that slice as Allocate grants it."""
    records: list[AllocationRecord] = []
    for g in range(GPUS):
        for n in range(SLICES_PER_GPU):
            slice_id = str(SliceId(gpu_uuid(g), n))
            records.append(
                AllocationRecord(
                    allocation_id([slice_id]),
                    (slice_id,),
                    0.0,
                    namespace=f"team-{g}",
                    pod=f"job-{n}",
                    container="main",
                    grants=slice_grants([inventory.by_id[slice_id]]),
                )
            )
    return records


def gpu_pid(g: int, i: int) -> int:
    return FIRST_GPU_PID + g * PROCESSES_PER_GPU + i


def owner_of(g: int, i: int) -> int:
    """The index of the allocation (= slice) that GPU process i of GPU g belongs to."""
    return g * SLICES_PER_GPU + i // 2


def make_reading(tick: int, pid_of: Callable[[int, int], int] = gpu_pid) -> NodeReading:
    """The reading of one poll; `pid_of(g, i)` is the PID of GPU process i of GPU g."""
    gpus: list[GpuReading] = []
    for g in range(GPUS):
        processes = tuple(
            ProcessSample(pid_of(g, i), (1 + i % 5) << 30, float((i * 7 + tick) % 4))
            for i in range(PROCESSES_PER_GPU)
        )
        info = GpuInfo(gpu_uuid(g), g, "NVIDIA A100-SXM4-80GB", GPU_MEMORY, minor=g)
        gpus.append(
            GpuReading(info, memory_used_bytes=0, sm_util_percent=60.0, processes=processes)
        )
    return NodeReading(tick * POLL_S, tuple(gpus))


def write_process(root: Path, pid: int, ppid: int, env: dict[str, str]) -> None:
    directory = root / str(pid)
    directory.mkdir()
    (directory / "stat").write_text(
        f"{pid} (python3) S {ppid} {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 {pid} 0 0\n"
    )
    (directory / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))


def make_proc_tree(root: Path, records: Sequence[AllocationRecord]) -> None:
    """A container init per allocation with the variable; of its two GPU processes the first has
    it too and the second was started with a minimal environment without it."""
    for k, record in enumerate(records):
        write_process(root, FIRST_INIT_PID + k, 1, NOISE_ENV | {ENV_NAME: record.allocation_id})
    for g in range(GPUS):
        for i in range(PROCESSES_PER_GPU):
            k = owner_of(g, i)
            env = NOISE_ENV | {ENV_NAME: records[k].allocation_id} if i % 2 == 0 else MINIMAL_ENV
            write_process(root, gpu_pid(g, i), FIRST_INIT_PID + k, env)


def cpu_ms(fn: Callable[[], object]) -> float:
    t0 = time.process_time_ns()
    fn()
    return (time.process_time_ns() - t0) / 1e6


def summary(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples), 4),
        "p99_ms": round(percentile(samples, 99), 4),
    }


def measure_ticks(
    resolver: AllocationResolver,
    inventory: Inventory,
    records: Sequence[AllocationRecord],
    iterations: int,
    pid_of: Callable[[int, int], int],
) -> tuple[list[float], list[float]]:
    """CPU ms per build alone (the PID mapping given), and per whole tick (resolve + build), each
    on its own builder polled every POLL_S."""
    health = DaemonHealth(registered=True)
    readings = [make_reading(tick, pid_of) for tick in range(iterations + 1)]
    pids = [p.pid for gpu in readings[0].gpus for p in gpu.processes]
    pid_allocation = resolver.resolve(pids)
    build_ms: list[float] = []
    tick_ms: list[float] = []
    for resolve_too, samples in ((False, build_ms), (True, tick_ms)):
        builder = SnapshotBuilder("bench-node", WINDOW_S)
        previous: float | None = None
        for reading in readings:
            t0 = time.process_time_ns()
            mapping = pid_allocation
            if resolve_too:
                mapping = resolver.resolve([p.pid for g in reading.gpus for p in g.processes])
            _, unknown = builder.build(
                reading,
                inventory,
                records,
                mapping,
                now_s=reading.timestamp_s,
                wall_s=reading.timestamp_s,
                health=health,
                previous_reading_s=previous,
            )
            samples.append((time.process_time_ns() - t0) / 1e6)
            assert not unknown
            previous = reading.timestamp_s
        del samples[0]  # the first build has no window yet
    snapshot, _ = builder.build(
        readings[0], inventory, records, pid_allocation, now_s=1e9, wall_s=0.0,
        health=health, previous_reading_s=None,
    )  # fmt: skip
    assert len(snapshot.containers) == ALLOCATIONS
    assert all(not g.unattributed for g in snapshot.gpus)
    return build_ms, tick_ms


def measure_steady_builds(
    inventory: Inventory,
    records: Sequence[AllocationRecord],
    pid_allocation: Mapping[int, Tag],
    iterations: int,
) -> list[float]:
    """CPU ms per build of polls whose samples are those of the poll before (the backend hands
    out the same ProcessSample objects for processes whose figures did not change)."""
    health = DaemonHealth(registered=True)
    first = make_reading(0)
    builder = SnapshotBuilder("bench-node", WINDOW_S)
    samples: list[float] = []
    previous: float | None = None
    for tick in range(iterations + 1):
        now_s = tick * POLL_S
        reading = dataclasses.replace(first, timestamp_s=now_s)
        t0 = time.process_time_ns()
        builder.build(
            reading, inventory, records, pid_allocation, now_s=now_s, wall_s=now_s,
            health=health, previous_reading_s=previous,
        )  # fmt: skip
        samples.append((time.process_time_ns() - t0) / 1e6)
        previous = now_s
    del samples[:2]  # the first builds decide the attribution
    return samples


def hit_rate(resolver: AllocationResolver, run: Callable[[], object]) -> float:
    hits, misses = resolver.hits, resolver.misses
    run()
    new_hits, new_misses = resolver.hits - hits, resolver.misses - misses
    return round(new_hits / max(new_hits + new_misses, 1), 4)


def bench_fake(root: Path, iterations: int) -> dict[str, dict[str, float]]:
    inventory = make_inventory()
    records = make_allocations(inventory)
    make_proc_tree(root, records)
    pids = [gpu_pid(g, i) for g in range(GPUS) for i in range(PROCESSES_PER_GPU)]

    cold = [cpu_ms(lambda: AllocationResolver(root).resolve(pids)) for _ in range(iterations)]
    resolver = AllocationResolver(root)
    assert all(v is not None for v in resolver.resolve(pids).values())
    warm: list[float] = []
    rate = hit_rate(
        resolver,
        lambda: warm.extend(cpu_ms(lambda: resolver.resolve(pids)) for _ in range(iterations)),
    )
    build_ms, tick_ms = measure_ticks(resolver, inventory, records, iterations, gpu_pid)
    steady_ms = measure_steady_builds(inventory, records, resolver.resolve(pids), iterations)
    return {
        "resolver cold (fake /proc)": summary(cold),
        "resolver warm (fake /proc)": summary(warm) | {"hit_rate": rate},
        "builder": summary(build_ms),
        "builder, poll unchanged": summary(steady_ms),
        "tick: warm + builder (fake /proc)": summary(tick_ms),
    }


def bench_real(iterations: int) -> dict[str, dict[str, float]]:
    """The same node with real processes: one sleeping child per GPU process, each started with
    its allocation's VGPU_ALLOCATION_ID (the real /proc gives no way to clear a child's
    environment after the fact, so here every process has the variable itself)."""
    inventory = make_inventory()
    records = make_allocations(inventory)
    children: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    env = NOISE_ENV | {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    try:
        for g in range(GPUS):
            for i in range(PROCESSES_PER_GPU):
                children[g, i] = subprocess.Popen(
                    ["sleep", "600"],
                    env=env | {ENV_NAME: records[owner_of(g, i)].allocation_id},
                    start_new_session=True,
                )
        pids = [child.pid for child in children.values()]
        # A child's new environment shows in /proc a moment after Popen returns.
        deadline = time.monotonic() + 30
        while not all(Path(f"/proc/{pid}/environ").read_bytes() for pid in pids):
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.01)

        def pid_of(g: int, i: int) -> int:
            return children[g, i].pid

        cold = [cpu_ms(lambda: AllocationResolver().resolve(pids)) for _ in range(iterations)]
        resolver = AllocationResolver()
        assert all(v is not None for v in resolver.resolve(pids).values())
        warm: list[float] = []
        rate = hit_rate(
            resolver,
            lambda: warm.extend(cpu_ms(lambda: resolver.resolve(pids)) for _ in range(iterations)),
        )
        _, tick_ms = measure_ticks(resolver, inventory, records, iterations, pid_of)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
        for child in children.values():
            child.wait(timeout=10)
    return {
        "resolver cold (real /proc)": summary(cold),
        "resolver warm (real /proc)": summary(warm) | {"hit_rate": rate},
        "tick: warm + builder (real /proc)": summary(tick_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument(
        "--no-real", action="store_true", help="leave out the rows on real processes"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vgu", dir="/tmp"))
    try:
        results = bench_fake(root, args.iterations)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not args.no_real:
        results |= bench_real(args.iterations)
    print(
        f"node: {GPUS} GPUs x {PROCESSES_PER_GPU} processes, {ALLOCATIONS} allocations; "
        f"CPU time per call, {args.iterations} calls per row"
    )
    print(f"{'measure':<40} {'p50 ms':>8} {'p99 ms':>8}")
    for name, figures in results.items():
        print(f"{name:<40} {figures['p50_ms']:>8.3f} {figures['p99_ms']:>8.3f}")
    print(
        json.dumps(
            {
                "bench": "usage",
                "gpus": GPUS,
                "processes_per_gpu": PROCESSES_PER_GPU,
                "allocations": ALLOCATIONS,
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
