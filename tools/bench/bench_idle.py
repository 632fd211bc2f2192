"""The daemon's CPU use when nothing happens, and while it tracks a full node.

    .venv/bin/python tools/bench/bench_idle.py [--seconds 30]
        [--scenario idle|tracking|busy|floor|all] [--poll-interval 500ms] [--no-restart]

Runs `vgpu-device-plugin serve` as its own process on the fake backend, the kubelet simulator in
this process, and measures the daemon process's CPU time (all its threads: event loop, poll
worker, the fake backend's sampler, HTTP) with psutil over `--seconds`, once it is registered
and steady:

- `idle`: one fake GPU, no GPU process, nothing allocated, registered, nothing scraped: the
  daemon polls every `idlePollInterval`. What a node without GPU work pays for the daemon.
- `tracking`: 8 fake GPUs x 32 slices, 256 one-slice containers each running two real GPU
  processes (512 processes, 64 per GPU) that carry their container's Allocate env, at the default
  poll interval (500 ms), nothing scraped. The processes run outside pod cgroups, so the daemon
  runs with `--trust-host-processes` (as the demo does) for their claims to stand. Every poll
  reads the 8 GPUs, checks the 512 processes' claims and builds the snapshot for the enforcer.
  Measured once the node has been steady for SETTLE_S (30 s): the policy's smoothed figures
  have settled, and a poll whose figures are those of the poll before is not worked through
  again (most polls on a node whose processes hold their memory and their share of time).
- `busy`: `tracking`, but every CHURN_S (0.25 s) another process on each GPU is stopped and
  the one stopped before resumed: the fake GPU shares its time among the others, so every
  process's and every container's figures change at every poll, and every poll is worked
  through in full.
- `floor`: not vgpu, a Python program that only wakes its event loop every 500 ms and awaits a
  no-op handed to a worker thread: what Python and the kernel charge for the poll loop's shape
  alone, on this machine, which `idle` cannot go below.

Each scenario reports the process's CPU (all threads, psutil), and per thread (each thread's
schedstat, in nanoseconds): the event loop (the main thread), the poll worker (`vgpu-poll`,
`vgpu-stale`), the fake backend's sampler, and every other thread (gRPC's, HTTP, duty cycle).
The sampler models utilisation from the processes' run state; on a real node NVML's sampling runs
in the driver instead, so `daemon_cpu_percent_of_a_core` is every thread but the sampler: what
vgpu itself costs. The daemon runs with each Python thread's OS name set to its Python name, to
tell the threads apart.

Also measures, for each scenario, how many times a second the daemon's event loop is woken up
(the voluntary context switches of its main thread, as Linux counts them in /proc/PID/status).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from deviceplugin.gpu.fake import FakeProcess, FakeState, write_state_file
from deviceplugin.sim.kubelet import KubeletSimulator
from tools.bench.fake_node import fake_gpu

RESOURCE = "nvidia.com/vgpu"
MiB = 1024**2
TRACKED_GPUS = 8
TRACKED_SLICES = 32
PROCESSES_PER_CONTAINER = 2
# `tracking` measures once the policy's smoothed figures have settled on the steady load.
SETTLE_S = 30.0
# `busy`: how often a different process per GPU is stopped.
CHURN_S = 0.25


# Runs `python -m deviceplugin` with every Python thread's OS name set to its Python name
# (cut to the 15 characters Linux keeps), so that the threads' CPU time can be told apart in
# /proc/PID/task/TID/comm. Python 3.11 does not name OS threads; nothing else changes.
NAMED_THREADS_MAIN = """
import ctypes, runpy, sys, threading
prctl = ctypes.CDLL(None, use_errno=True).prctl
run = threading.Thread.run
def named_run(self):
    prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    run(self)
threading.Thread.run = named_run
sys.argv[0] = "vgpu-device-plugin"
runpy.run_module("deviceplugin", run_name="__main__", alter_sys=True)
"""

# Thread roles, by OS name. The fake backend's sampler stands for what the GPU driver does on a
# real node (NVML's sampling); everything else is the daemon's own.
SAMPLER_PREFIX = "fake-gpu-sample"
POLL_THREADS = ("vgpu-poll", "vgpu-stale")


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def wakeups(proc: psutil.Process) -> int:
    return int(proc.num_ctx_switches().voluntary)


def thread_role(pid: int, tid: int) -> str:
    if tid == pid:
        return "event_loop"
    try:
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "other"  # exited meanwhile
    if name.startswith(SAMPLER_PREFIX):
        return "fake_sampler"
    if name in POLL_THREADS:
        return "poll_worker"
    return "other"


def thread_cpu_s(pid: int, tid: int, ticks_s: float) -> float:
    """The thread's CPU time: from its schedstat (nanoseconds) where the kernel has it, since
    user and system times come in clock ticks (10 ms), too coarse for an idle daemon."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return ticks_s


def cpu_by_role(proc: psutil.Process) -> dict[str, float]:
    """CPU seconds so far per thread role (threads alive now; see thread_role)."""
    roles: dict[str, float] = {}
    for thread in proc.threads():
        role = thread_role(proc.pid, thread.id)
        ticks_s = thread.user_time + thread.system_time
        roles[role] = roles.get(role, 0.0) + thread_cpu_s(proc.pid, thread.id, ticks_s)
    return roles


async def measure(pid: int, seconds: float) -> dict[str, float]:
    proc = psutil.Process(pid)
    roles_before = cpu_by_role(proc)
    cpu_before, ctx_before, started = cpu_s(proc), wakeups(proc), time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - started
    cpu_after, roles_after = cpu_s(proc), cpu_by_role(proc)
    total = 100 * (cpu_after - cpu_before) / elapsed
    by_role = {
        role: 100 * (roles_after.get(role, 0.0) - roles_before.get(role, 0.0)) / elapsed
        for role in ("event_loop", "poll_worker", "other", "fake_sampler")
    }
    return {
        "cpu_percent_of_a_core": total,
        "daemon_cpu_percent_of_a_core": sum(v for k, v in by_role.items() if k != "fake_sampler"),
        **{f"{role}_cpu_percent_of_a_core": value for role, value in by_role.items()},
        "wakeups_per_s": (wakeups(proc) - ctx_before) / elapsed,
    }


# The least an asyncio daemon polling in a worker thread every 500 ms can cost: a timer on the
# event loop, a no-op handed to the worker and awaited, nothing else. What `idle` pays beyond this
# is vgpu's own work; this is Python's and the kernel's.
FLOOR_MAIN = """
import asyncio, concurrent.futures, ctypes, queue, threading
calls = queue.SimpleQueue()
def work():
    ctypes.CDLL(None).prctl(15, b"vgpu-poll", 0, 0, 0)  # PR_SET_NAME, as NAMED_THREADS_MAIN
    while True:
        future, call = calls.get()
        future.set_result(call())
threading.Thread(target=work, name="vgpu-poll", daemon=True).start()
async def main():
    while True:
        await asyncio.sleep(0.5)
        future = concurrent.futures.Future()
        calls.put((future, lambda: None))
        await asyncio.wrap_future(future)
asyncio.run(main())
"""


async def run_floor(seconds: float) -> dict[str, float]:
    floor = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOOR_MAIN)
    try:
        await asyncio.sleep(2)
        return await measure(floor.pid, seconds)
    finally:
        floor.kill()
        await floor.wait()


async def run(scenario: str, seconds: float, poll_interval: str = "500ms") -> dict[str, float]:
    if scenario == "floor":
        return await run_floor(seconds)
    root = Path(tempfile.mkdtemp(prefix="vgi", dir="/tmp"))
    tracking = scenario in {"tracking", "busy"}
    gpus = [fake_gpu(i) for i in range(TRACKED_GPUS if tracking else 1)]
    state = root / "gpus.json"
    write_state_file(state, FakeState(gpus=tuple(gpus)))
    config = root / "config.yaml"
    config.write_text(
        f"version: v1\nslicing: {{replicas: {TRACKED_SLICES if tracking else 4}}}\n"
        f"enforcement: {{pollInterval: {poll_interval}}}\n"
    )
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-c", NAMED_THREADS_MAIN, "serve", "--config", str(config),
        "--backend", f"fake:{state}", "--device-plugin-dir", str(root / "dp"),
        "--pod-resources-socket", str(root / "podres.sock"),
        "--metrics-address", "127.0.0.1:0", "--state-dir", str(root / "state"),
        "--log-level", "error",
        # The workloads run outside pod cgroups: without this every claim would be refused
        # (counted as misattributed) and no container would hold a process.
        "--trust-host-processes",
    )  # fmt: skip
    work: list[subprocess.Popen[bytes]] = []
    try:
        slices = len(gpus) * (TRACKED_SLICES if tracking else 4)
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == slices, timeout_s=30)
        if tracking:
            per_gpu: dict[str, list[FakeProcess]] = {}
            for i in range(slices):
                grant = (await sim.admit_pod(f"p{i}", [("c", 1)])).containers[0]
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **grant.envs}
                uuid = grant.device_ids[0].rsplit("::", 1)[0]
                for _ in range(PROCESSES_PER_CONTAINER):
                    proc = subprocess.Popen(["sleep", "3600"], env=env)  # noqa: ASYNC220
                    work.append(proc)
                    per_gpu.setdefault(uuid, []).append(FakeProcess(proc.pid, 512 * MiB, 5))
            write_state_file(
                state,
                FakeState(
                    gpus=tuple(
                        dataclasses.replace(g, processes=tuple(per_gpu.get(g.uuid, ())))
                        for g in gpus
                    )
                ),
            )
        churn: asyncio.Task[None] | None = None
        if scenario == "busy":
            churn = asyncio.create_task(rotate_stops(per_gpu))
        # Steady: attribution caches and pod-resources names; for `tracking`, the policy's
        # smoothed figures too (its averages take about 20 s to settle on new figures).
        await asyncio.sleep(SETTLE_S if scenario == "tracking" else 5)
        try:
            results = await measure(daemon.pid, seconds)
        finally:
            if churn is not None:
                churn.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await churn
        if daemon.returncode is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode}")
        return results
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(daemon.wait(), 10)
        except TimeoutError:
            daemon.kill()
            await daemon.wait()
        for proc in work:
            proc.send_signal(signal.SIGCONT)  # a stopped process dies only once resumed
            proc.kill()
            proc.wait()
        await sim.stop()


async def rotate_stops(per_gpu: Mapping[str, Sequence[FakeProcess]]) -> None:
    """Every CHURN_S, on every GPU, resume the process stopped last and stop the next one: the
    fake GPU then shares its time among other processes, so every process's utilisation (and
    every container's) changes at every poll. Resumes what it stopped when cancelled."""
    stopped: list[int] = []
    try:
        for turn in itertools.count():
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            stopped = [ps[turn % len(ps)].pid for ps in per_gpu.values() if ps]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(CHURN_S)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


async def restart_to_registered_ms(repeats: int) -> float:
    """Median time from a kubelet restart to the daemon registered again with its full list."""
    root = Path(tempfile.mkdtemp(prefix="vgr", dir="/tmp"))
    state = root / "gpus.json"
    write_state_file(state, FakeState(gpus=(fake_gpu(0),)))
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve",
        "--backend", f"fake:{state}", "--device-plugin-dir", str(root / "dp"),
        "--pod-resources-socket", str(root / "podres.sock"),
        "--metrics-address", "127.0.0.1:0", "--state-dir", str(root / "state"),
        "--log-level", "error",
    )  # fmt: skip
    times: list[float] = []
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == 4, timeout_s=30)
        for _ in range(repeats):
            before = len(sim.registrations)
            started = time.perf_counter()
            await sim.restart()
            await sim.wait_for(
                lambda before=before: (
                    len(sim.registrations) > before  # type: ignore[misc]
                    and len(sim.healthy_ids(RESOURCE)) == 4
                ),
                timeout_s=10,
            )
            times.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.2)
    finally:
        daemon.send_signal(signal.SIGTERM)
        await asyncio.wait_for(daemon.wait(), 10)
        await sim.stop()
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--scenario", choices=["idle", "tracking", "busy", "floor", "all"], default="all"
    )
    # What a node pays per poll interval: memory the GPU's driver holds to its limits needs no
    # fast poll (docs/enforcement.md), so a slower one shows what polling for memory costs.
    parser.add_argument("--poll-interval", default="500ms", help="enforcement.pollInterval")
    parser.add_argument(
        "--no-restart", action="store_true", help="skip the kubelet-restart measure"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    scenarios = ["idle", "tracking", "busy", "floor"] if args.scenario == "all" else [args.scenario]
    results: dict[str, float] = {}
    for scenario in scenarios:
        measured = asyncio.run(run(scenario, args.seconds, args.poll_interval))
        for key, value in measured.items():
            results[f"{scenario}_{key}"] = value
    if not args.no_restart:
        results["kubelet_restart_to_registered_ms_p50"] = asyncio.run(restart_to_registered_ms(9))
    print(f"{'measure':<44} {'value':>10}")
    for name, value in results.items():
        print(f"{name:<44} {value:>10.2f}")
    print(
        json.dumps(
            {
                "bench": "idle",
                "seconds": args.seconds,
                "poll_interval": args.poll_interval,
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
