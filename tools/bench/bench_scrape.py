"""Exporter benchmark: the cost of one scrape of a busy node.

    .venv/bin/python tools/bench/bench_scrape.py [--iterations 300] [--containers 256] [--gpus 8]

Node: 8 GPUs, 256 containers spread over them (2 processes each, every fifth throttled, with
enforcement counts), 2 unattributed processes per GPU. Goal G12: `/metrics` within 50 ms for
about 2.5k series, served from the latest snapshot with no NVML call.
- `render()`: DaemonMetrics.render(), the exposition built from the snapshot (what a scrape costs
  the daemon's CPU, without HTTP).
- `GET /metrics`: a real HTTP request to HttpServer on 127.0.0.1 over a kept-alive connection, as
  Prometheus makes it (client in the same process).
- `GET /status`: the JSON document of the same snapshot, as `vgpu-device-plugin status` fetches it.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.model import (
    ContainerUsage,
    DaemonHealth,
    EnforcementCount,
    GpuInfo,
    GpuReading,
    GpuUsage,
    NodeSnapshot,
    ProcessSample,
)
from deviceplugin.usage.httpserver import HttpServer
from deviceplugin.usage.metrics import DaemonMetrics

GiB = 1024**3


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def busy_snapshot(gpus: int, containers: int) -> NodeSnapshot:
    per_gpu = max(containers // gpus, 1)
    memory_total = 141 * GiB
    limit = memory_total // per_gpu
    usages = []
    for i in range(containers):
        g = i % gpus
        duty = 0.5 if i % 5 == 0 else None
        usages.append(
            ContainerUsage(
                allocation_id=f"{i:016x}",
                gpu_uuid=f"GPU-00000000-0000-4000-8000-{g:012d}",
                gpu_index=g,
                slices=1,
                memory_used_bytes=limit // 2,
                memory_limit_bytes=limit,
                sm_utilization_ratio=0.9 / per_gpu,
                compute_share_ratio=1 / per_gpu,
                processes=(
                    ProcessSample(10_000 + 2 * i, limit // 4, 10.0),
                    ProcessSample(10_001 + 2 * i, limit // 4, 5.0),
                ),
                namespace=f"team-{i % 16}",
                pod=f"inference-{i:04d}-7f9c6d5b4-x2k9z",
                container="server",
                duty_cycle_ratio=duty,
                throttled_seconds_total=12.5 if duty is not None else 0.0,
            )
        )
    gpu_usages = tuple(
        GpuUsage(
            GpuReading(
                GpuInfo(
                    uuid=f"GPU-00000000-0000-4000-8000-{g:012d}",
                    index=g,
                    name="NVIDIA H200",
                    memory_total_bytes=memory_total,
                    minor=g,
                    numa_node=g // 4,
                    pci_bus_id=f"00000000:{g + 0x10:02x}:00.0",
                ),
                memory_used_bytes=memory_total // 2,
                sm_util_percent=90.0,
            ),
            sm_utilization_ratio=0.9,
            slices_total=per_gpu,
            slices_allocated=per_gpu,
            unattributed=(ProcessSample(900 + g, GiB, 1.0), ProcessSample(950 + g, None)),
        )
        for g in range(gpus)
    )
    enforcement = tuple(
        EnforcementCount(c.allocation_id, c.gpu_uuid, kind, action, 3, c.namespace, c.pod, "server")
        for c in usages
        if c.duty_cycle_ratio is not None
        for kind, action in (("compute", "throttle"), ("memory", "kill"))
    )
    return NodeSnapshot(
        taken_at_s=time.time(),
        node_name="bench-node",
        gpus=gpu_usages,
        containers=tuple(usages),
        health=DaemonHealth(
            registered=True, registrations_total=1, last_poll_success_s=time.time()
        ),
        enforcement=enforcement,
    )


def timed(fn: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(min(20, iterations)):  # warm-up
        fn()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--containers", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()

    snapshot = busy_snapshot(args.gpus, args.containers)
    metrics = DaemonMetrics("bench-node", lambda: snapshot, version="bench")
    for _ in range(100):
        metrics.observe_poll(0.004)
        metrics.observe_allocate(0.002)
    payload, _ = metrics.render()
    series = sum(len(f.samples) for f in text_string_to_metric_families(payload.decode()))

    server = HttpServer("127.0.0.1:0", metrics, lambda: snapshot, lambda: (True, "ok"))
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status_size = 0

    def get(path: str) -> bytes:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status}")
        return body

    try:
        render_s = timed(metrics.render, args.iterations)
        http_s = timed(lambda: get("/metrics"), args.iterations)
        status_s = timed(lambda: get("/status"), args.iterations)
        status_size = len(get("/status"))
    finally:
        conn.close()
        server.stop()

    rows = [("render()", render_s), ("GET /metrics", http_s), ("GET /status", status_s)]
    results: dict[str, object] = {
        "gpus": args.gpus,
        "containers": args.containers,
        "series": series,
        "metrics_payload_bytes": len(payload),
        "status_payload_bytes": status_size,
        "iterations": args.iterations,
    }
    print(
        f"{args.containers} containers on {args.gpus} GPUs: {series} series, "
        f"/metrics {len(payload) / 1024:.0f} KiB, /status {status_size / 1024:.0f} KiB"
    )
    print(f"{'what':<14} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, samples in rows:
        p50, p99 = percentile(samples, 50) * 1e3, percentile(samples, 99) * 1e3
        mean = statistics.fmean(samples) * 1e3
        print(f"{name:<14} {p50:>8.2f} {p99:>8.2f} {mean:>8.2f}")
        key = name.replace("()", "").replace("GET /", "get_").replace(" ", "_")
        results[f"{key}_p50_ms"] = round(p50, 3)
        results[f"{key}_p99_ms"] = round(p99, 3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
