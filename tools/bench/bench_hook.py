"""GPU memory limits before the first instruction: what the runtime hook costs, and the race a
cgroup watcher would have to win instead (docs/design.md §15).

    .venv/bin/python -m tools.bench.bench_hook [--rounds 200]

- `hook round trip`: the static hook (built from deviceplugin/hook/vgpu-hook.c with the
  Dockerfile's flags) run as a runtime runs it, an OCI state on stdin, to its exit: exec, the
  socket, the daemon resolving the container from its /proc/<pid>/cgroup, asking for the grant,
  setting the limit on the fake GPUs (which write their driver file) and recording it. A new
  container each round, on a directory laid out like the hierarchy, beside 32 running ones with
  limits of their own; each goes again after its round.
- `daemon's part`: the same request, minus the hook process: LimitApplier.apply alone.
- `watcher window` (root and a writable cgroup v2 hierarchy): in a tight loop, a cgroup is made
  under a directory an inotify watcher follows, and a process forked into it (it joins the cgroup
  between fork and exec, as runc's init does) executes a tiny static program that stamps the
  monotonic clock first thing. The window is that stamp minus the moment the watcher read the
  cgroup's IN_CREATE event: what a watcher has left to map the cgroup to its container and set
  the limit before the container's first instruction. `lost` counts rounds where the program ran
  before the watcher heard of the cgroup at all. Here nothing sits between the cgroup and the
  exec; a real runtime adds its own steps (namespaces, mounts, hooks) and, under containerd, the
  gap between the CRI's create and start, which this loop does not have.

Prints a table, then one JSON line. Needs gcc with a static C library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from asyncinotify import Inotify, Mask

from deviceplugin.partitions import GpuLimit
from deviceplugin.usage.cgroups import PodContainer
from tests.support.cgroup_tree import Hierarchy, leaf_of
from tests.support.memlimits import LimitRig, compile_hook

# Containers already running on the node, each with a limit on record, while a new one starts.
RUNNING = 32
STAMP_C = r"""
#include <stdio.h>
#include <time.h>
int main(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    printf("%lld\n", (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
    return 0;
}
"""


class OneGrant:
    """Every container holds grant `g`: 8 GiB on the dmem GPU."""

    def limits_for(self, grant_id: str, container: PodContainer) -> dict[str, GpuLimit]:
        return {"GPU-dmem": GpuLimit(0, 8 << 30)}

    def still_holds(self, grant_id: str, container: PodContainer) -> bool:
        return True


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered), p99, ordered[0]


async def hook_rounds(base: Path, hook: Path, rounds: int) -> tuple[list[float], list[float]]:
    cgroups = Hierarchy(base / "h")
    rig = LimitRig(base, hook, cgroup_mount=cgroups.root, proc_root=cgroups.proc)
    rig.source = OneGrant()  # type: ignore[assignment]
    rig.start_components()
    await rig.server.start()
    for n in range(RUNNING):  # the node's other containers, limited and recorded
        cgroups.container(500 + n, leaf_of(f"running-{n}"))
        await rig.applier.apply(500 + n, "g")
    hook_ms: list[float] = []
    daemon_ms: list[float] = []
    try:
        for n in range(2 * rounds):
            pid = 1000 + n
            leaf = leaf_of(f"new-{n}")
            cgroups.container(pid, leaf)
            started = time.perf_counter()
            if n < rounds:
                run = await rig.run_hook(pid, "g")
                assert run.returncode == 0, run.stderr
                hook_ms.append((time.perf_counter() - started) * 1000)
            else:
                await rig.applier.apply(pid, "g")
                daemon_ms.append((time.perf_counter() - started) * 1000)
            # The container goes: its limit cleared and its record entry with it.
            rig.backend.clear_memory_limits("GPU-dmem", leaf)
            cgroups.remove(leaf)
            rig.record.remove(leaf)
    finally:
        await rig.close()
    return hook_ms, daemon_ms


def unified_mount() -> Path | None:
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def watcher_rounds(mount: Path, stamp: Path, rounds: int) -> tuple[list[float], int]:
    parent = mount / f"vgpu-bench-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    heard: dict[str, int] = {}
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    async def watch() -> None:
        with Inotify() as inotify:
            inotify.add_watch(parent, Mask.CREATE | Mask.ONLYDIR)
            ready.set()
            with contextlib.suppress(asyncio.CancelledError):
                async for event in inotify:
                    if event.name is not None:
                        heard[str(event.name)] = time.monotonic_ns()

    thread = threading.Thread(target=loop.run_until_complete, args=(watch(),), daemon=True)
    thread.start()
    ready.wait(5)
    windows_ms: list[float] = []
    lost = 0
    try:
        for n in range(rounds):
            name = f"c{n}"
            leaf = parent / name
            leaf.mkdir()
            procs = str(leaf / "cgroup.procs")

            def join(procs: str = procs) -> None:
                with open(procs, "w") as f:
                    f.write("0")

            done = subprocess.run(
                [str(stamp)], preexec_fn=join, capture_output=True, text=True, check=True
            )
            executed = int(done.stdout.strip())
            deadline = time.monotonic() + 1
            while name not in heard and time.monotonic() < deadline:
                time.sleep(0.0005)
            if name not in heard:
                lost += 1
                continue
            window = (executed - heard[name]) / 1e6
            if window < 0:
                lost += 1
            windows_ms.append(window)
            leaf.rmdir()
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(5)
        for leaf in parent.iterdir():
            if leaf.is_dir():
                leaf.rmdir()
        parent.rmdir()
    return windows_ms, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if shutil.which("gcc") is None:
        raise SystemExit("bench_hook needs gcc")
    results: dict[str, float | int | str] = {}
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="vgb", dir="/tmp") as tmp:
        base = Path(tmp)
        hook = compile_hook(base)
        results["hook_bytes"] = hook.stat().st_size
        hook_ms, daemon_ms = asyncio.run(hook_rounds(base, hook, args.rounds))
        for name, values in (("hook round trip", hook_ms), ("daemon's part", daemon_ms)):
            p50, p99, least = percentiles(values)
            rows.append((name, f"{p50:.2f} ms", f"{p99:.2f} ms", f"{least:.2f} ms"))
            key = name.split()[0].strip("'s")
            results[f"{key}_p50_ms"] = round(p50, 3)
            results[f"{key}_p99_ms"] = round(p99, 3)
        mount = unified_mount()
        if mount is None:
            results["watcher"] = "skipped: needs root and a cgroup v2 hierarchy"
        else:
            stamp = base / "stamp"
            (base / "stamp.c").write_text(STAMP_C)
            subprocess.run(
                ["gcc", "-static", "-O2", "-o", str(stamp), str(base / "stamp.c")], check=True
            )
            windows, lost = watcher_rounds(mount, stamp, args.rounds)
            p50, _, least = percentiles(windows)
            p1 = sorted(windows)[int(len(windows) * 0.01)]
            rows.append(("watcher window", f"{p50:.2f} ms", f"p1 {p1:.2f} ms", f"{least:.2f} ms"))
            results.update(
                watcher_window_p50_ms=round(p50, 3),
                watcher_window_p1_ms=round(p1, 3),
                watcher_window_min_ms=round(least, 3),
                watcher_lost=lost,
                watcher_rounds=args.rounds,
            )
    print(f"{'measure':<20} {'p50':>12} {'p99':>12} {'min':>12}")
    for name, p50_text, p99_text, least_text in rows:
        print(f"{name:<20} {p50_text:>12} {p99_text:>12} {least_text:>12}")
    if "watcher_lost" in results:
        print(f"watcher lost the race {results['watcher_lost']} of {args.rounds} rounds")
    print(json.dumps({"bench": "hook", "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
