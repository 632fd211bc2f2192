"""`vgpu-device-plugin demo`: the whole system on fake GPUs with the built-in kubelet simulator.

It runs in a temporary directory on any machine: writes a fake GPU state file (two GPUs of
different models), starts the kubelet simulator and the daemon, schedules example pods and shows
what a user wants to see: the slices, which pod got which slice on which GPU, and the env each
container got. Then it restarts the kubelet, as a node upgrade would, and shows the plugin
re-registering with every allocation intact. It runs until Ctrl-C or --duration, then stops
everything it started and removes its directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.config import (
    Config,
    EnforcementConfig,
    GpuMatch,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.gpu.fake import FakeBackend, FakeGpu, FakeState, write_state_file
from deviceplugin.kubelet_sim import KubeletSimulator, PodGrant
from deviceplugin.model import GpuInfo, Inventory
from deviceplugin.slicing import format_bytes

GiB = 1024**3
MiB = 1024**2

DEMO_GPUS = (
    FakeGpu(
        uuid="GPU-3f8a1c2e-5b7d-4e9f-a1b2-c3d4e5f60001",
        index=0,
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GiB,
        minor=0,
        numa_node=0,
    ),
    FakeGpu(
        uuid="GPU-9b2e4d6f-8a1c-4b3d-9e5f-a7b8c9d00002",
        index=1,
        name="NVIDIA L4",
        memory_total_bytes=23034 * MiB,
        minor=1,
        numa_node=1,
    ),
)

# Slices follow memory on the big GPU and count on the small one: per-GPU rules are one of the
# things a single node-wide replica count cannot express.
DEMO_CONFIG = Config(
    slicing=SlicingConfig(
        default=SliceRule(replicas=4),
        overrides=(
            SliceOverride(GpuMatch(model="*A100*"), SliceRule(memory_per_slice_bytes=10 * GiB)),
        ),
    ),
    enforcement=EnforcementConfig(poll_interval_s=0.2),
)

DEMO_PODS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("llm-finetune", (("trainer", 4),)),
    ("inference", (("server", 2), ("metrics-sidecar", 1))),
    ("notebook", (("jupyter", 1),)),
)


def example_gpus() -> list[GpuInfo]:
    """The demo's GPUs, also used by check-config when no backend is named."""
    return [
        GpuInfo(g.uuid, g.index, g.name, g.memory_total_bytes, g.minor, g.numa_node)
        for g in DEMO_GPUS
    ]


def _short(uuid: str) -> str:
    return uuid[:12] + "…"


def render_slices(inventory: Inventory, held_by: dict[str, str]) -> list[str]:
    lines = []
    for plan in inventory.plans:
        gpu = plan.gpu
        head = (
            f"GPU {gpu.index}  {gpu.name}  {format_bytes(gpu.memory_total_bytes)}  "
            f"NUMA {gpu.numa_node}  {gpu.uuid}"
        )
        lines.append(head)
        if not plan.sliced:
            lines.append(f"  not sliced: {plan.excluded_reason}")
            continue
        lines.append(
            f"  {plan.replicas} slices x {format_bytes(plan.memory_per_slice_bytes)} memory, "
            f"{plan.compute_share_ratio * 100:.4g}% compute each"
        )
        cells = []
        for s in inventory.slices:
            if s.id.gpu_uuid == gpu.uuid:
                owner = held_by.get(s.device_id, "free")
                cells.append(f"::{s.id.n} {owner}")
        for i in range(0, len(cells), 2):
            lines.append("    " + "".join(f"{c:<36}" for c in cells[i : i + 2]).rstrip())
    return lines


def render_pods(pods: Sequence[PodGrant], inventory: Inventory) -> list[str]:
    lines = [f"{'POD/CONTAINER':<30} {'SLICES':>6}  {'GPU':<5} {'MEMORY':>8} {'COMPUTE':>8}"]
    for pod in pods:
        for c in pod.containers:
            slices = [inventory.by_id[d] for d in c.device_ids if d in inventory.by_id]
            gpus = sorted({s.gpu_index for s in slices})
            memory = sum(s.memory_limit_bytes for s in slices)
            compute = f"{sum(s.compute_share_ratio for s in slices) * 100:.4g}%"
            lines.append(
                f"{pod.name + '/' + c.name:<30} {len(c.device_ids):>6}  "
                f"{','.join(map(str, gpus)):<5} {format_bytes(memory):>8} {compute:>8}"
            )
    return lines


async def _demo(duration_s: float | None, out: TextIO, workdir: Path) -> int:
    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=out)
        out.flush()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    plugin_dir = workdir / "device-plugins"
    podres_socket = workdir / "pod-resources" / "kubelet.sock"
    state_file = workdir / "gpus.json"
    podres_socket.parent.mkdir(parents=True)
    write_state_file(state_file, FakeState(gpus=DEMO_GPUS))
    resource = DEMO_CONFIG.resource_name

    sim = KubeletSimulator(plugin_dir, podres_socket)
    await sim.start()
    settings = DaemonSettings(
        config=DEMO_CONFIG,
        backend=f"fake:{state_file}",
        device_plugin_dir=plugin_dir,
        pod_resources_socket=podres_socket,
        state_dir=workdir / "state",
        node_name="demo-node",
    )
    backend = FakeBackend(state_file)
    daemon = Daemon(settings, backend)
    started = time.monotonic()
    run = asyncio.create_task(daemon.run(stop), name="daemon")
    try:
        expected = sum(p.replicas for p in daemon.inventory.value.plans) or None
        await sim.wait_for(
            lambda: (
                sim.is_registered(resource)
                and len(sim.healthy_ids(resource))
                == (expected or len(daemon.inventory.value.slices))
            ),
            timeout_s=10,
        )
        inventory = daemon.inventory.value
        say(
            f"vgpu demo: {len(inventory.plans)} fake GPUs and a built-in kubelet in {workdir}",
            f"state file (edit it to change the GPUs while the demo runs): {state_file}",
            "",
            f"kubelet: plugin registered and {len(sim.healthy_ids(resource))} {resource} slices "
            f"advertised {(time.monotonic() - started) * 1000:.0f} ms after start",
            "",
        )
        for name, containers in DEMO_PODS:
            await sim.admit_pod(name, containers, resource_name=resource)
        pods = sim.pods()
        held_by = {
            d: f"{p.name}/{c.name}" for p in pods for c in p.containers for d in c.device_ids
        }
        say(*render_slices(inventory, held_by), "")
        say(*render_pods(pods, inventory), "")
        first = pods[0].containers[0]
        say(f"what {pods[0].name}/{first.name} got from Allocate:")
        say(*(f"  {k}={v}" for k, v in sorted(first.envs.items())), "")

        say("restarting the kubelet (it deletes every plugin socket and re-creates kubelet.sock)…")
        before = len(sim.registrations)
        restarted = time.monotonic()
        await sim.restart()
        await sim.wait_for(lambda: len(sim.registrations) > before and sim.is_registered(resource))
        rereg_ms = (time.monotonic() - restarted) * 1000
        intact = sum(len(c.device_ids) for p in sim.pods() for c in p.containers)
        say(
            f"kubelet: plugin re-registered {rereg_ms:.0f} ms after the restart; "
            f"{intact} allocated slices intact, {len(sim.healthy_ids(resource))} healthy",
            "",
        )
        say(
            "running; press Ctrl-C to stop"
            if duration_s is None
            else f"running for {duration_s:g} s; Ctrl-C stops earlier"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration_s)
        say("stopping")
        return 0
    finally:
        stop.set()
        await run
        backend.close()
        await sim.stop()


def run_demo(duration_s: float | None, out: TextIO) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="vgpu-demo-", dir="/tmp"))
    try:
        return asyncio.run(_demo(duration_s, out, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
