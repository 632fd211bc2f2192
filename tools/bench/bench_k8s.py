"""Device-plugin benchmark on a real kubelet v1.36.2: vgpu against the minimal Python plugin.

    VGPU_E2E_K8S_BUNDLE=/path/to/k8s-bundle .venv/bin/python -m tools.bench.bench_k8s \
        [--rounds 15] [--starts 5] [--runtime fakecri|containerd] [--sizes 8,256] \
        [--before DIR]

The node is tests/e2e/harness.py's (its own network namespace, loopback only; root needed),
its kubelet updating the Node's status every 100 ms. Both plugins run as processes inside the
node's namespaces, the way a DaemonSet pod would: `vgpu-device-plugin serve` on 8 fake GPUs
(1 or 32 slices each: 8 or 256 devices) and tools/bench/minimal_plugin.py with as many devices.
For each size:

- `start -> kubelet`: from spawning the plugin to the kubelet's pod-resources
  GetAllocatableResources listing all its devices (the device manager's own view);
  `start -> Node`: until the Node object's allocatable says so. The plugins take turns; each is
  stopped, and the kubelet has marked its devices unhealthy, before the next start.
- `admission`: a pod asking for 8 devices, from create to Running, the two plugins registered
  side by side and taking turns (the first rounds warm up); each pod is deleted before the next.
  The ratio is of the medians.
- vgpu's start-up, split by its own log: interpreter and imports (spawn to its first log line),
  then to registered, then to the first device list sent.
- `--before DIR`: also start vgpu from another checkout's source tree (DIR holds its
  `deviceplugin/`, e.g. `git worktree add DIR <commit>`), in turn with the other two, for a
  before/after comparison measured in the same minutes.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import grpc

from deviceplugin.gpu.fake import FakeState
from deviceplugin.kubelet.proto import podres, podres_grpc
from tests.e2e.harness import (
    BUNDLE_ENV,
    Cluster,
    Daemon,
    pod_manifest,
    resolve_bundle,
    wait_until,
)
from tools.bench.fake_node import fake_gpu

RESOURCE = "nvidia.com/vgpu"
MINIMAL = "example.com/minimal"
GPUS = 8
POD_DEVICES = 8
WARMUP = 3
MINIMAL_PLUGIN = Path(__file__).with_name("minimal_plugin.py")


def node_gpus() -> FakeState:
    return FakeState(gpus=tuple(fake_gpu(i) for i in range(GPUS)))


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class Node:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.channel = grpc.insecure_channel(f"unix://{cluster.paths.pod_resources_socket}")
        self.lister = podres_grpc.PodResourcesListerStub(self.channel)

    def kubelet_count(self, resource: str) -> int:
        answer = self.lister.GetAllocatableResources(podres.AllocatableResourcesRequest())
        return sum(len(d.device_ids) for d in answer.devices if d.resource_name == resource)

    def node_count(self, resource: str) -> int:
        return self.cluster.allocatable(resource) or 0

    def start_vgpu(self, slices: int, tree: Path | None = None) -> Daemon:
        return self.cluster.start_daemon(
            config=f"slicing: {{replicas: {slices}}}\n",
            gpus=node_gpus(),
            args=["--log-level", "info"],
            env={"PYTHONPATH": str(tree)} if tree is not None else None,
        )

    def start_minimal(self, devices: int) -> subprocess.Popen[bytes]:
        return self.cluster.in_namespaces(
            [sys.executable, str(MINIMAL_PLUGIN), "--dir", "/var/lib/kubelet/device-plugins",
             "--resource", MINIMAL, "--devices", str(devices)],
            log=self.cluster.paths.log_dir / "minimal.log",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)},
        )  # fmt: skip


REPO = Path(__file__).resolve().parents[2]


def _until(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    # pod-resources allows 100 requests a second (burst 10), shared with vgpu's own: 50 here.
    wait_until(lambda: check() or None, timeout_s=timeout_s, interval_s=0.02, what=what)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _log_times(log: str, spawned_wall: float) -> dict[str, float]:
    """Seconds from spawn to vgpu's first log line, to `registered`, to the first device list."""
    marks = {"first log line": "", "registered": "registered with the kubelet",
             "device list sent": "sending device list"}  # fmt: skip
    found: dict[str, float] = {}
    for line in log.splitlines():
        stamp = line.split(" ", 1)[0]
        try:
            wall = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        for name, text in marks.items():
            if name not in found and text in line:
                found[name] = wall - spawned_wall
    return found


def _counts(count: Callable[[str], int], resource: str, want: int) -> Callable[[], bool]:
    return lambda: count(resource) == want


def bench_starts(
    node: Node, slices: int, starts: int, before: Path | None = None
) -> dict[str, dict[str, float]]:
    """Each plugin started `starts` times, in turn (the order rotating each round): "vgpu",
    "minimal" and, with `before`, "vgpu before" (vgpu from that source tree)."""
    devices = GPUS * slices
    labels = ["vgpu", "minimal", *(["vgpu before"] if before is not None else [])]
    resources = {"vgpu": RESOURCE, "minimal": MINIMAL, "vgpu before": RESOURCE}
    times: dict[str, dict[str, list[float]]] = {k: {"kubelet": [], "node": []} for k in labels}
    phases: dict[str, dict[str, list[float]]] = {}
    for i in range(starts):
        shift = i % len(labels)
        for label in labels[shift:] + labels[:shift]:
            resource = resources[label]
            spawned_wall = time.time()
            t0 = time.perf_counter()
            daemon = None
            if label == "minimal":
                proc = node.start_minimal(devices)
            else:
                daemon = node.start_vgpu(slices, before if label == "vgpu before" else None)
                proc = daemon.proc
            _until(_counts(node.kubelet_count, resource, devices), "kubelet has the devices")
            times[label]["kubelet"].append(time.perf_counter() - t0)
            _until(_counts(node.node_count, resource, devices), "Node allocatable")
            times[label]["node"].append(time.perf_counter() - t0)
            if daemon is not None:
                for name, value in _log_times(daemon.log(), spawned_wall).items():
                    phases.setdefault(label, {}).setdefault(name, []).append(value)
            _stop(proc)
            _until(_counts(node.kubelet_count, resource, 0), "devices gone", 30)
            _until(_counts(node.node_count, resource, 0), "Node allocatable 0", 30)
    result: dict[str, dict[str, float]] = {}
    for label in labels:
        result[f"start -> kubelet, {devices} devices, {label}"] = {
            "p50_ms": statistics.median(times[label]["kubelet"]) * 1000
        }
        result[f"start -> Node, {devices} devices, {label}"] = {
            "p50_ms": statistics.median(times[label]["node"]) * 1000
        }
    for label, by_name in phases.items():
        for name, values in by_name.items():
            result[f"{label} start, {devices} devices: spawn -> {name}"] = {
                "p50_ms": statistics.median(values) * 1000
            }
    for label in labels:
        if label == "minimal":
            continue
        for where in ("kubelet", "Node"):
            ours = statistics.median(times[label][where.lower()])
            theirs = statistics.median(times["minimal"][where.lower()])
            result[f"start -> {where}, {devices} devices, {label} / minimal"] = {
                "ratio": ours / theirs
            }
    return result


def bench_admission(node: Node, slices: int, rounds: int) -> dict[str, dict[str, float]]:
    devices = GPUS * slices
    cluster = node.cluster
    daemon = node.start_vgpu(slices)
    minimal = node.start_minimal(devices)
    try:
        _until(lambda: node.node_count(RESOURCE) == devices, "vgpu allocatable")
        _until(lambda: node.node_count(MINIMAL) == devices, "minimal allocatable")
        times: dict[str, list[float]] = {RESOURCE: [], MINIMAL: []}
        for i in range(WARMUP + rounds):
            order = (RESOURCE, MINIMAL) if i % 2 == 0 else (MINIMAL, RESOURCE)
            for resource in order:
                name = f"adm-{i}-{resource.split('/')[0].replace('.', '-')}"
                manifest = pod_manifest(name, {resource: POD_DEVICES})
                t0 = time.perf_counter()
                cluster.create_pod(manifest)
                cluster.wait_running(name)
                if i >= WARMUP:
                    times[resource].append((time.perf_counter() - t0) * 1000)
                cluster.delete_pod(name)
    finally:
        daemon.stop()
        _stop(minimal)
        _until(lambda: node.kubelet_count(RESOURCE) == 0, "vgpu gone", 30)
        _until(lambda: node.kubelet_count(MINIMAL) == 0, "minimal gone", 30)
    ours, theirs = (statistics.median(times[r]) for r in (RESOURCE, MINIMAL))
    return {
        f"admission, {devices} devices, vgpu": {
            "p50_ms": ours,
            "p90_ms": percentile(times[RESOURCE], 90),
        },
        f"admission, {devices} devices, minimal": {
            "p50_ms": theirs,
            "p90_ms": percentile(times[MINIMAL], 90),
        },
        f"admission, {devices} devices, vgpu / minimal": {
            "ratio": ours / theirs,
            "extra_ms": ours - theirs,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=os.environ.get(BUNDLE_ENV))
    parser.add_argument("--runtime", choices=("fakecri", "containerd"), default="fakecri")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--sizes", default="8,256", help="device counts, multiples of 8")
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        metavar="DIR",
        help="also time the start of vgpu from this source tree (another checkout's root)",
    )
    args = parser.parse_args()
    if not args.bundle:
        parser.error(f"name the Kubernetes bundle: --bundle PATH or {BUNDLE_ENV}")
    if args.before is not None and not (args.before / "deviceplugin" / "__main__.py").is_file():
        parser.error(f"--before {args.before}: no deviceplugin/__main__.py there")
    if args.before is not None:
        args.before = args.before.absolute()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[str, float]] = {}
    with Cluster.start(
        resolve_bundle(args.bundle), args.runtime, {"nodeStatusUpdateFrequency": "100ms"}
    ) as cluster:
        node = Node(cluster)
        try:
            for size in sizes:
                results.update(bench_starts(node, size // GPUS, args.starts, args.before))
                results.update(bench_admission(node, size // GPUS, args.rounds))
        finally:
            node.channel.close()
    width = max(len(k) for k in results)
    for name, values in results.items():
        shown = "  ".join(
            f"{k}={v:.3f}" if k == "ratio" else f"{k}={v:.1f}" for k, v in values.items()
        )
        print(f"{name:<{width}}  {shown}")
    print(json.dumps({"runtime": args.runtime, "results": results}, sort_keys=True))


if __name__ == "__main__":
    main()
