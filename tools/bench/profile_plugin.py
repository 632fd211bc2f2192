"""GetPreferredAllocation and Allocate at 8 GPUs x 32 slices, in-process, with cProfile.

    .venv/bin/python tools/bench/profile_plugin.py [--rounds 15] [--calls 200] [--profile]

Calls the plugin's servicer directly (no gRPC, no kubelet), as the kubelet's device manager
calls it for a pod of 8 slices: GetPreferredAllocation with all 256 IDs but a few available,
then Allocate of 8 IDs. This is the project's own cost per admission, which bench_plugin.py
measures end to end against a minimal plugin. The figure per method is the best round's mean
(rounds absorb a busy machine); `--profile` adds cProfile's top functions by own time.
The daemon's `allocated ...` log line is written (to /dev/null) as at the default log level.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import pstats
import time
from collections.abc import Awaitable, Callable
from typing import Any

from deviceplugin.config import Config, SliceRule, SlicingConfig
from deviceplugin.kubelet.proto import dp
from deviceplugin.model import GpuInfo, GpuReading, NodeReading
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.slicing import build_inventory
from deviceplugin.state import AllocationBook, Published

GPUS = 8
SLICES = 32
POD_SLICES = 8


class _Context:
    """The little of grpc.aio.ServicerContext the servicer uses on success."""

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def make_service() -> tuple[DevicePluginService, list[str]]:
    config = Config(slicing=SlicingConfig(default=SliceRule(replicas=SLICES)))
    gpus = tuple(
        GpuReading(
            GpuInfo(
                uuid=f"GPU-00000000-0000-4000-8000-{i:012d}",
                index=i,
                name="NVIDIA H200",
                memory_total_bytes=141 * 1024**3,
                minor=i,
                numa_node=i // 4,
            )
        )
        for i in range(GPUS)
    )
    inventory = build_inventory(NodeReading(0.0, gpus), config.slicing)
    ids = [s.device_id for s in inventory.slices]
    return DevicePluginService(config, Published(inventory), AllocationBook()), ids


async def best_mean_us(call: Callable[[], Awaitable[object]], rounds: int, calls: int) -> float:
    for _ in range(calls):  # warm up
        await call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            await call()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


async def main_async(rounds: int, calls: int, profile: bool) -> dict[str, float]:
    service, ids = make_service()
    context: Any = _Context()
    preferred = dp.PreferredAllocationRequest(
        container_requests=[
            dp.ContainerPreferredAllocationRequest(
                available_deviceIDs=ids[5:], allocation_size=POD_SLICES
            )
        ]
    )
    allocate = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=ids[5 : 5 + POD_SLICES])]
    )

    async def both() -> None:
        await service.GetPreferredAllocation(preferred, context)
        await service.Allocate(allocate, context)

    results = {
        "GetPreferredAllocation_us": await best_mean_us(
            lambda: service.GetPreferredAllocation(preferred, context), rounds, calls
        ),
        "Allocate_us": await best_mean_us(
            lambda: service.Allocate(allocate, context), rounds, calls
        ),
    }
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(rounds * calls):
            await both()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = parser.parse_args()
    handler = logging.StreamHandler(open("/dev/null", "w"))  # noqa: SIM115 (lives until exit)
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    results = asyncio.run(main_async(args.rounds, args.calls, args.profile))
    print(f"node: {GPUS} GPUs x {SLICES} slices; a pod of {POD_SLICES} slices")
    print(f"{'call':<26} {'us per call':>12}")
    for name, value in results.items():
        print(f"{name.removesuffix('_us'):<26} {value:>12.1f}")
    print(
        json.dumps({"bench": "profile_plugin", "gpus": GPUS, "slices_per_gpu": SLICES, **results})
    )


if __name__ == "__main__":
    main()
