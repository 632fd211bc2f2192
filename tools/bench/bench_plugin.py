"""Device-plugin benchmark: Allocate round trip, and daemon start to the full device list.

    .venv/bin/python -m tools.bench.bench_plugin [--iterations 200] [--starts 5]

Node: 8 fake GPUs x 32 slices (256 devices), the kubelet simulator on the same machine.
- `allocate rpc`: one Allocate call on the plugin's socket, as the kubelet makes it (client and
  server both Python, one process); what a pod's admission waits for from the plugin.
- `admission`: the simulator's whole admission of a one-container pod: GetPreferredAllocation,
  Allocate, and its checkpoint write, as the kubelet's device manager does them.
- `kubelet restart -> registered`: from the simulator's restart (sockets deleted, kubelet.sock
  re-created) until the plugin is registered again with its full list; pods admitted in between
  would be rejected, so this is the window that matters.
- `start -> full list`: from spawning `vgpu-device-plugin serve` (a new Python process) to the
  simulator holding all 256 healthy devices; `in-process` leaves out interpreter start-up.
- `vs minimal plugin`: the simulator's admission of a pod asking for 8 devices, on a node of 8
  devices (8 GPUs x 1 slice) and of 256 (8 GPUs x 32 slices), alternating between vgpu and
  tools/bench/minimal_plugin.py's `MinimalPlugin` (the least a Python plugin can do)
  registered on the same simulator, so both meet the same machine load. The ratio is of the
  medians; `extra` is vgpu's own cost.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.config import Config, EnforcementConfig, SliceRule, SlicingConfig
from deviceplugin.gpu.fake import FakeBackend, FakeState, write_state_file
from deviceplugin.kubelet.proto import DEVICE_PLUGIN_VERSION, KUBELET_SOCKET, dp, dp_grpc
from deviceplugin.plugin.lifecycle import endpoint_name
from deviceplugin.sim.kubelet import KubeletSimulator
from tools.bench.fake_node import fake_gpu
from tools.bench.minimal_plugin import MinimalPlugin

GPUS = 8
SLICES = 32
RESOURCE = "nvidia.com/vgpu"
SIZES = (1, 8, 64)
MINIMAL = "example.com/minimal"
POD_DEVICES = 8
CONFIG = Config(
    slicing=SlicingConfig(default=SliceRule(replicas=SLICES)),
    enforcement=EnforcementConfig(poll_interval_s=0.1),
)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def write_node(root: Path) -> Path:
    state = root / "gpus.json"
    gpus = tuple(fake_gpu(i) for i in range(GPUS))
    write_state_file(state, FakeState(gpus=gpus))
    return state


async def bench_allocate(root: Path, iterations: int) -> dict[str, dict[str, float]]:
    state = write_node(root)
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    backend = FakeBackend(state)
    settings = DaemonSettings(
        config=CONFIG,
        backend=f"fake:{state}",
        device_plugin_dir=root / "dp",
        pod_resources_socket=root / "podres.sock",
        metrics_address="127.0.0.1:0",
    )
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    results: dict[str, dict[str, float]] = {}
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == GPUS * SLICES, timeout_s=20)
        ids = sorted(sim.healthy_ids(RESOURCE))
        socket = root / "dp" / endpoint_name(RESOURCE)
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            for size in SIZES:
                request = dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=ids[:size])]
                )
                for _ in range(20):
                    await stub.Allocate(request)
                times = []
                for _ in range(iterations):
                    t0 = time.perf_counter()
                    await stub.Allocate(request)
                    times.append((time.perf_counter() - t0) * 1000)
                results[f"allocate rpc, {size} slices"] = {
                    "p50_ms": percentile(times, 50),
                    "p99_ms": percentile(times, 99),
                }
        for size in SIZES:
            times = []
            for i in range(iterations):
                t0 = time.perf_counter()
                await sim.admit_pod(f"p{i}", [("c", size)])
                times.append((time.perf_counter() - t0) * 1000)
                await sim.delete_pod("default", f"p{i}")
            results[f"admission, {size} slices"] = {
                "p50_ms": percentile(times, 50),
                "p99_ms": percentile(times, 99),
            }
        restarts = [await time_kubelet_restart(sim) for _ in range(10)]
        results["kubelet restart -> registered"] = {
            "median_ms": statistics.median(restarts),
            "max_ms": max(restarts),
        }
    finally:
        stop.set()
        await task
        backend.close()
        await sim.stop()
    return results


async def start_minimal_plugin(
    plugin_dir: Path, resource_name: str, device_ids: list[str]
) -> grpc.aio.Server:
    """Serve the minimal plugin in `plugin_dir` and register it; the caller stops the server."""
    endpoint = "minimal-" + resource_name.replace("/", "-") + ".sock"
    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(MinimalPlugin(device_ids), server)
    server.add_insecure_port(f"unix://{plugin_dir / endpoint}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{plugin_dir / KUBELET_SOCKET}") as channel:
        await dp_grpc.RegistrationStub(channel).Register(
            dp.RegisterRequest(
                version=DEVICE_PLUGIN_VERSION,
                endpoint=endpoint,
                resource_name=resource_name,
                options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
            )
        )
    return server


async def bench_versus_minimal(
    root: Path, slices_per_gpu: int, iterations: int
) -> dict[str, dict[str, float]]:
    """Admission of 8-device pods through the simulator: vgpu and the minimal plugin, taking
    turns on one simulator."""
    state = write_node(root)
    devices = GPUS * slices_per_gpu
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    backend = FakeBackend(state)
    config = Config(
        slicing=SlicingConfig(default=SliceRule(replicas=slices_per_gpu)),
        enforcement=EnforcementConfig(poll_interval_s=0.1),
    )
    settings = DaemonSettings(
        config=config,
        backend=f"fake:{state}",
        device_plugin_dir=root / "dp",
        pod_resources_socket=root / "podres.sock",
        metrics_address="127.0.0.1:0",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(Daemon(settings, backend).run(stop))
    minimal = None
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == devices, timeout_s=20)
        minimal = await start_minimal_plugin(
            root / "dp", MINIMAL, sorted(sim.healthy_ids(RESOURCE))
        )
        await sim.wait_for(lambda: len(sim.healthy_ids(MINIMAL)) == devices, timeout_s=20)
        times: dict[str, list[float]] = {RESOURCE: [], MINIMAL: []}
        for i in range(20 + iterations):
            for resource in (RESOURCE, MINIMAL):
                name = f"p{i}-{resource.split('/')[0]}"
                t0 = time.perf_counter()
                await sim.admit_pod(name, [("c", POD_DEVICES)], resource_name=resource)
                if i >= 20:  # the first ones warm up
                    times[resource].append((time.perf_counter() - t0) * 1000)
                await sim.delete_pod("default", name)
    finally:
        stop.set()
        await task
        if minimal is not None:
            await minimal.stop(None)
        backend.close()
        await sim.stop()
    ours, theirs = (statistics.median(times[r]) for r in (RESOURCE, MINIMAL))
    label = f"vs minimal plugin, {devices} devices"
    return {
        f"admission, {devices} devices, vgpu": {
            "p50_ms": ours,
            "p99_ms": percentile(times[RESOURCE], 99),
        },
        f"admission, {devices} devices, minimal": {
            "p50_ms": theirs,
            "p99_ms": percentile(times[MINIMAL], 99),
        },
        label: {"ratio": ours / theirs, "extra_ms": ours - theirs},
    }


async def time_kubelet_restart(sim: KubeletSimulator) -> float:
    before = len(sim.registrations)
    t0 = time.perf_counter()
    await sim.restart()
    await sim.wait_for(
        lambda: len(sim.registrations) > before and len(sim.healthy_ids(RESOURCE)) == GPUS * SLICES,
        timeout_s=10,
    )
    return (time.perf_counter() - t0) * 1000


async def time_to_full_list_subprocess(root: Path) -> float:
    state = write_node(root)
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    config = root / "config.yaml"
    config.write_text(f"version: v1\nslicing: {{replicas: {SLICES}}}\n")
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve",
        "--config", str(config), "--backend", f"fake:{state}",
        "--device-plugin-dir", str(root / "dp"),
        "--pod-resources-socket", str(root / "podres.sock"),
        "--log-level", "error", "--metrics-address", "127.0.0.1:0",
    )  # fmt: skip
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == GPUS * SLICES, timeout_s=30)
        return (time.perf_counter() - t0) * 1000
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        await sim.stop()


async def time_to_full_list_in_process(root: Path) -> float:
    state = write_node(root)
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    backend = FakeBackend(state)
    settings = DaemonSettings(
        config=CONFIG,
        backend=f"fake:{state}",
        device_plugin_dir=root / "dp",
        pod_resources_socket=root / "podres.sock",
        metrics_address="127.0.0.1:0",
    )
    task = asyncio.create_task(Daemon(settings, backend).run(stop))
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == GPUS * SLICES, timeout_s=30)
        return (time.perf_counter() - t0) * 1000
    finally:
        stop.set()
        await task
        backend.close()
        await sim.stop()


def fresh_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="vgb", dir="/tmp"))


async def main_async(iterations: int, starts: int) -> dict[str, dict[str, float]]:
    results = await bench_allocate(fresh_dir(), iterations)
    for slices_per_gpu in (1, SLICES):
        results.update(await bench_versus_minimal(fresh_dir(), slices_per_gpu, iterations))
    sub = [await time_to_full_list_subprocess(fresh_dir()) for _ in range(starts)]
    inproc = [await time_to_full_list_in_process(fresh_dir()) for _ in range(starts)]
    results["start -> full list (new process)"] = {
        "median_ms": statistics.median(sub),
        "max_ms": max(sub),
    }
    results["start -> full list (in-process)"] = {
        "median_ms": statistics.median(inproc),
        "max_ms": max(inproc),
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    results = asyncio.run(main_async(args.iterations, args.starts))
    print(f"node: {GPUS} GPUs x {SLICES} slices; {args.iterations} calls per row")
    print(f"{'measure':<40} {'p50/median ms':>14} {'p99/max ms':>11}")
    for name, figures in results.items():
        first, second = list(figures.values())
        if "ratio" in figures:
            print(f"{name:<40} {'x' + format(first, '.2f'):>14} {'+' + format(second, '.2f'):>11}")
        else:
            print(f"{name:<40} {first:>14.2f} {second:>11.2f}")
    print(json.dumps({"bench": "plugin", "gpus": GPUS, "slices_per_gpu": SLICES, **results}))


if __name__ == "__main__":
    main()
