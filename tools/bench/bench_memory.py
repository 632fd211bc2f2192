"""Daemon resident memory at load, and after an hour's worth of container churn.

    .venv/bin/python tools/bench/bench_memory.py [--churn 3600]

Runs `vgpu-device-plugin serve` as its own process on the fake backend with 8 GPUs x 32
slices, the kubelet simulator in this process, 256 one-slice containers each running two real
GPU processes (512 processes, 64 per GPU) that carry their container's Allocate env, and
scrapes /metrics and /status every second. It reports the daemon's RSS once the load is
steady, then replaces one container at a time (delete the pod, admit a new one, start its
processes, rewrite the state file) `--churn` times, as fast as the daemon keeps up (an hour at
one container a second is 3600), and reports RSS again. Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from deviceplugin.gpu.fake import FakeProcess, FakeState, write_state_file
from deviceplugin.sim.kubelet import KubeletSimulator
from tools.bench.fake_node import fake_gpu

GPUS = 8
SLICES = 32
CONTAINERS = GPUS * SLICES
PROCESSES_PER_CONTAINER = 2
RESOURCE = "nvidia.com/vgpu"
MiB = 1024**2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "gpus.json"
        self.gpus = [fake_gpu(i) for i in range(GPUS)]
        # pod name -> (gpu uuid, processes)
        self.work: dict[str, tuple[str, list[subprocess.Popen[bytes]]]] = {}
        self.write()

    def write(self) -> None:
        per_gpu: dict[str, list[FakeProcess]] = {}
        for uuid, procs in self.work.values():
            per_gpu.setdefault(uuid, []).extend(FakeProcess(p.pid, 512 * MiB, 5) for p in procs)
        gpus = tuple(
            dataclasses.replace(g, processes=tuple(per_gpu.get(g.uuid, ()))) for g in self.gpus
        )
        write_state_file(self.state, FakeState(gpus=gpus))

    def start_work(self, pod: str, envs: dict[str, str], device_id: str) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **envs}
        procs = [
            subprocess.Popen(["sleep", "3600"], env=env) for _ in range(PROCESSES_PER_CONTAINER)
        ]
        self.work[pod] = (device_id.rsplit("::", 1)[0], procs)

    def stop_work(self, pod: str) -> None:
        _, procs = self.work.pop(pod)
        for p in procs:
            p.kill()
            p.wait()

    def close(self) -> None:
        for pod in list(self.work):
            self.stop_work(pod)


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MiB


async def scrape(port: int) -> None:
    def get() -> None:
        for path in ("/metrics", "/status"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                r.read()

    await asyncio.to_thread(get)


async def run(churn: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="vgm", dir="/tmp"))
    node = Node(root)
    config = root / "config.yaml"
    config.write_text(f"version: v1\nslicing: {{replicas: {SLICES}}}\n")
    sim = KubeletSimulator(root / "dp", root / "podres.sock")
    await sim.start()
    port = free_port()
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve", "--config", str(config),
        "--backend", f"fake:{node.state}", "--trust-host-processes",
        "--device-plugin-dir", str(root / "dp"),
        "--pod-resources-socket", str(root / "podres.sock"),
        "--metrics-address", f"127.0.0.1:{port}", "--state-dir", str(root / "state"),
        "--log-level", "error",
    )  # fmt: skip
    results: dict[str, float] = {}
    try:
        await sim.wait_for(lambda: len(sim.healthy_ids(RESOURCE)) == CONTAINERS, timeout_s=30)
        results["idle, 256 slices advertised"] = rss_mib(daemon.pid)
        for i in range(CONTAINERS):
            grant = (await sim.admit_pod(f"p{i}", [("c", 1)])).containers[0]
            node.start_work(f"p{i}", grant.envs, grant.device_ids[0])
        node.write()
        for _ in range(10):  # steady state: polls, attribution caches, scrapes
            await scrape(port)
            await asyncio.sleep(1)
        results["256 containers, 512 GPU processes"] = rss_mib(daemon.pid)
        started = time.monotonic()
        cpu_before = psutil.Process(daemon.pid).cpu_times()
        for n in range(churn):
            victim = f"p{n}" if n < CONTAINERS else f"q{n - CONTAINERS}"
            await sim.delete_pod("default", victim)
            node.stop_work(victim)
            grant = (await sim.admit_pod(f"q{n}", [("c", 1)])).containers[0]
            node.start_work(f"q{n}", grant.envs, grant.device_ids[0])
            node.write()
            if n % 100 == 0:
                await scrape(port)
            await asyncio.sleep(0.005)
        for _ in range(5):
            await scrape(port)
            await asyncio.sleep(1)
        elapsed = time.monotonic() - started
        cpu_after = psutil.Process(daemon.pid).cpu_times()
        results[f"after {churn} container replacements"] = rss_mib(daemon.pid)
        results["churn wall time s"] = elapsed
        results["daemon CPU during churn, % of a core"] = (
            100
            * (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system)
            / elapsed
        )
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(daemon.wait(), 10)
        except TimeoutError:
            daemon.kill()
            await daemon.wait()
        node.close()
        await sim.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--churn", type=int, default=3600)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    results = asyncio.run(run(args.churn))
    print(f"{'measure':<44} {'value':>10}")
    for name, value in results.items():
        unit = "" if name.endswith((" s", "core")) else " MiB"
        print(f"{name:<44} {value:>10.1f}{unit}")
    print(json.dumps({"bench": "memory", **results}))


if __name__ == "__main__":
    main()
