"""`vgpu-device-plugin demo`: the whole system on fake GPUs with the built-in kubelet simulator.

It runs in a temporary directory on any machine: writes a fake GPU state file (two GPUs of
different models, and a third in MIG mode, partitioned into MIG devices that are advertised as
their own resources, `nvidia.com/mig-<profile>`), starts the kubelet simulator and the daemon,
schedules example pods and shows what a user wants to see: the slices, which pod got which slice
on which GPU, and the env each container got. Then it restarts the kubelet, as a node upgrade
would, and shows the plugin re-registering with every allocation intact. Then the containers do
GPU work (real processes carrying their Allocate env, listed in the state file), and it shows the
live per-container usage, as `vgpu-device-plugin status` and the metrics endpoint do, while the
enforcer throttles the noisy neighbour and kills a container's process that went over its memory
limit, and a JAX-style container sizes its up-front memory reservation from the hint Allocate
gave it. It runs until Ctrl-C or --duration, then stops everything it started and removes its
directory.

The story is printed once. Then, on a terminal, the status view stays at the bottom and is
redrawn in place while events (enforcement actions, exits) scroll above it; into a pipe or a file,
only the events are written as they happen, and the view once more at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.config import (
    Config,
    EnforcementConfig,
    GpuMatch,
    MigConfig,
    MigStrategy,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.gpu.fake import (
    FakeBackend,
    FakeGpu,
    FakeMigDevice,
    FakeProcess,
    FakeState,
    write_state_file,
)
from deviceplugin.model import GpuInfo, Inventory, NodeSnapshot
from deviceplugin.sim.kubelet import KubeletSimulator, PodGrant
from deviceplugin.slicing import format_bytes
from deviceplugin.usage.statusview import render_status, snapshot_to_json

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
    # In MIG mode (as mig-parted leaves it): one 3g.40gb and two 1g.10gb instances.
    FakeGpu(
        uuid="GPU-c4d5e6f7-1a2b-4c3d-8e9f-b0c1d2e30003",
        index=2,
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * GiB,
        minor=2,
        numa_node=1,
        mig_enabled=True,
        mig_block=True,
        mig_devices=(
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0301", 2, 0, "3g.40gb", 40 * GiB),
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0302", 9, 0, "1g.10gb", 10 * GiB),
            FakeMigDevice("MIG-5a6b7c8d-9e0f-5a1b-8c2d-3e4f5a6b0303", 10, 0, "1g.10gb", 10 * GiB),
        ),
    ),
)
MIG_SMALL = "nvidia.com/mig-1g.10gb"

# Slices follow memory on the big GPU and count on the small one: per-GPU rules are one of the
# things a single node-wide replica count cannot express. MIG devices are advertised per profile
# (the mixed strategy); each 1g.10gb instance is time-sliced in two.
DEMO_CONFIG = Config(
    slicing=SlicingConfig(
        default=SliceRule(replicas=4),
        overrides=(
            SliceOverride(GpuMatch(model="*A100*"), SliceRule(memory_per_slice_bytes=10 * GiB)),
            SliceOverride(GpuMatch(profile="1g.10gb"), SliceRule(replicas=2)),
        ),
    ),
    enforcement=EnforcementConfig(poll_interval_s=0.2),
    mig=MigConfig(strategy=MigStrategy.MIXED),
)

DEMO_PODS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("llm-finetune", (("trainer", 4),)),
    ("inference", (("server", 2), ("metrics-sidecar", 1))),
    ("notebook", (("jupyter", 1),)),
    ("jax-train", (("jax", 1),)),
)
# Pods asking for a MIG slice, as they would with NVIDIA's plugin: nvidia.com/mig-1g.10gb: 1.
DEMO_MIG_PODS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("embeddings", (("encoder", 1),)),
)

# The GPU work each container does: (memory in use, SM demand in percent). The sidecar holds a
# slice but never touches the GPU; it still has its series, from the moment it was allocated.
DEMO_WORKLOADS: dict[tuple[str, str], tuple[int, float]] = {
    ("llm-finetune", "trainer"): (30 * GiB, 100.0),
    ("inference", "server"): (12 * GiB, 100.0),  # the noisy neighbour: 25% share, wants it all
    ("notebook", "jupyter"): (6 * GiB, 20.0),
}
# JAX-style containers: they reserve a fraction of the GPU's memory at start, as JAX does. The
# fraction comes from XLA_PYTHON_CLIENT_MEM_FRACTION, which Allocate sets from the slice; without
# it JAX takes 75% of the GPU, far over a slice, and the enforcer would kill it. (SM demand in %.)
SIZED_BY_HINTS: dict[tuple[str, str], float] = {("jax-train", "jax"): 20.0}
JAX_DEFAULT_FRACTION = 0.75
ENV_XLA_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def jax_preallocation(envs: Mapping[str, str], gpu_memory_bytes: int) -> int:
    """What a JAX process reserves at start on a GPU of `gpu_memory_bytes`, given its env."""
    fraction = float(envs.get(ENV_XLA_MEM_FRACTION, JAX_DEFAULT_FRACTION))
    return int(fraction * gpu_memory_bytes)


# Work on the MIG slice: its memory is measured and enforced, its utilisation is not (NVML has
# none per MIG device).
DEMO_MIG_WORKLOADS: dict[tuple[str, str], tuple[int, float]] = {
    ("embeddings", "encoder"): (3 * GiB, 60.0),
}


# A second into the live view the notebook grows past its 10Gi: killed after the grace period.
GROW_AFTER_S = 1.0
GROWN = (("default", "notebook", "jupyter"), 14 * GiB)
# A process on the node that no pod asked slices for: counted as unattributed, never touched.
HOST_PROCESS = (2 * GiB, 30.0)
STATUS_EVERY_S = 5.0
REDRAW_EVERY_S = 1.0  # on a terminal, where the view is redrawn in place
# How long an exit waits for the enforcer's account of a kill, so that the kill comes first.
KILL_REPORT_WAIT_S = 2.0
# Terminal control: to the start of the line N lines up, and clear to the end of the screen.
CURSOR_UP = "\x1b[{}F"
CLEAR_BELOW = "\x1b[J"


class LiveView:
    """The live part of the demo's output. On a terminal the status view sits at the bottom and
    is redrawn in place, with event lines scrolling above it; elsewhere events are written as
    they come and the view only when asked to (`final`), so a log holds no screen codes."""

    def __init__(self, out: TextIO, *, terminal: bool) -> None:
        self._out = out
        self.terminal = terminal
        self._view: list[str] = []
        self._drawn = 0  # lines of the view now on the screen

    def _erase(self) -> None:
        if self._drawn:
            self._out.write(CURSOR_UP.format(self._drawn) + CLEAR_BELOW)
            self._drawn = 0

    def event(self, *lines: str) -> None:
        """Lines that stay: above the view on a terminal."""
        view = self._view if self.terminal else []
        self._erase()
        for line in lines:
            print(line, file=self._out)
        self._draw(view)

    def update(self, view: list[str]) -> None:
        """A new status view: redrawn in place on a terminal, kept for `final` elsewhere."""
        self._view = view
        if self.terminal:
            self._erase()
            self._draw(view)

    def final(self) -> None:
        """Leave the last view on the screen (on a terminal it already is)."""
        if not self.terminal and self._view:
            for line in self._view:
                print(line, file=self._out)
            self._out.flush()
        self._drawn = 0

    def _draw(self, view: list[str]) -> None:
        for line in view:
            print(line, file=self._out)
        self._drawn = len(view)
        self._out.flush()


class DemoWorkloads:
    """Real processes standing in for the containers' GPU processes: each carries its
    container's Allocate env, as a container's processes do, and is listed in the state file
    for as long as it lives, as the driver lists a GPU process."""

    def __init__(self, state_file: Path) -> None:
        self._state_file = state_file
        # pid -> (process, GPU UUID, what it does, whose it is)
        self._work: dict[int, tuple[subprocess.Popen[bytes], str, FakeProcess, str]] = {}

    def start(self, pods: Sequence[PodGrant]) -> list[str]:
        """Start every container's work; a line for each that sized itself from its hints."""
        said: list[str] = []
        for pod in pods:
            for c in pod.containers:
                if not c.device_ids:
                    continue
                uuid = c.device_ids[0].rsplit("::", 1)[0]
                owner = f"{pod.namespace}/{pod.name}/{c.name}"
                work = DEMO_WORKLOADS.get((pod.name, c.name)) or DEMO_MIG_WORKLOADS.get(
                    (pod.name, c.name)
                )
                demand = SIZED_BY_HINTS.get((pod.name, c.name))
                if demand is not None:
                    gpu = next(g for g in DEMO_GPUS if g.uuid == uuid)
                    memory = jax_preallocation(c.envs, gpu.memory_total_bytes)
                    work = (memory, demand)
                    limit = int(c.envs.get("VGPU_MEMORY_LIMIT_MIB_0", "0")) * MiB
                    unhinted = jax_preallocation({}, gpu.memory_total_bytes)
                    said += [
                        f"{owner} is JAX-style: at start it reserves {ENV_XLA_MEM_FRACTION}="
                        f"{c.envs.get(ENV_XLA_MEM_FRACTION, '(unset)')}",
                        f"  of the {gpu.name}'s {format_bytes(gpu.memory_total_bytes)} "
                        f"({format_bytes(memory)}), within its {format_bytes(limit)} limit; "
                        "without the hint JAX would",
                        f"  take {JAX_DEFAULT_FRACTION:.0%} ({format_bytes(unhinted)}) and be "
                        "killed after the grace period",
                    ]
                if work is not None:
                    self._add(uuid, dict(c.envs), *work, owner=owner)
        self._add(DEMO_GPUS[1].uuid, {}, *HOST_PROCESS, owner="host")
        self.write()
        return said

    def _add(
        self, gpu_uuid: str, envs: dict[str, str], memory: int, demand: float, *, owner: str
    ) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **envs}
        # Dies with the demo, even when the demo is SIGKILLed (and even while stopped).
        proc = subprocess.Popen(["sleep", "86400"], env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self._work[proc.pid] = (proc, gpu_uuid, FakeProcess(proc.pid, memory, demand), owner)

    def grow(self, owner: str, memory: int) -> int:
        """Make `owner`'s process use `memory`; returns its pid."""
        for pid, (proc, uuid, work, who) in self._work.items():
            if who == owner:
                self._work[pid] = (
                    proc,
                    uuid,
                    dataclasses.replace(work, used_memory_bytes=memory),
                    who,
                )
                self.write()
                return pid
        raise KeyError(owner)

    def reap(self) -> list[tuple[int, str, int]]:
        """Forget processes that have exited (the driver stops listing them); (pid, owner,
        return code: -9 when killed)."""
        gone = [
            (pid, w[3], code) for pid, w in self._work.items() if (code := w[0].poll()) is not None
        ]
        for pid, _, _ in gone:
            del self._work[pid]
        if gone:
            self.write()
        return gone

    def write(self) -> None:
        per_gpu: dict[str, list[FakeProcess]] = {}
        for _, uuid, work, _ in self._work.values():
            per_gpu.setdefault(uuid, []).append(work)
        gpus = tuple(
            dataclasses.replace(
                g,
                processes=tuple(per_gpu.get(g.uuid, ())),
                mig_devices=tuple(
                    dataclasses.replace(d, processes=tuple(per_gpu.get(d.uuid, ())))
                    for d in g.mig_devices
                ),
            )
            for g in DEMO_GPUS
        )
        write_state_file(self._state_file, FakeState(gpus=gpus))

    def stop(self) -> None:
        for proc, *_ in self._work.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._work.clear()


def describe_actions(before: NodeSnapshot | None, after: NodeSnapshot | None) -> list[str]:
    """A line for each enforcement action counted between two snapshots."""
    if after is None:
        return []
    seen = {
        (e.allocation_id, e.gpu_uuid, e.kind, e.action): e.count
        for e in (before.enforcement if before else ())
    }
    usage = {(c.allocation_id, c.gpu_uuid): c for c in after.containers}
    lines = []
    for e in after.enforcement:
        key = (e.allocation_id, e.gpu_uuid, e.kind, e.action)
        if e.count <= seen.get(key, 0):
            continue
        who = f"{e.namespace}/{e.pod}/{e.container}" if e.pod else e.allocation_id
        c = usage.get((e.allocation_id, e.gpu_uuid))
        if e.kind == "memory" and e.action == "kill":
            lines.append(
                f"enforcer: killed the largest GPU process of {who}: over its memory limit "
                f"for longer than the grace period"
                + (f" ({format_bytes(c.memory_limit_bytes)} limit)" if c else "")
            )
        elif e.kind == "compute" and e.action == "throttle":
            share = f"{c.compute_share_ratio * 100:.4g}%" if c else "its share"
            used = f"{c.sm_utilization_ratio * 100:.0f}%" if c else "more"
            lines.append(
                f"enforcer: throttling {who}: it used {used} of the GPU against a {share} share "
                "while others wanted more (SIGSTOP/SIGCONT duty cycle)"
            )
        else:
            lines.append(f"enforcer: {e.kind} {e.action} on {who}")
    return lines


def example_gpus() -> list[GpuInfo]:
    """The demo's GPUs, also used by check-config when no backend is named."""
    gpus: list[GpuInfo] = []
    for g in DEMO_GPUS:
        gpus.append(g.info)
        gpus.extend(g.mig_info(d) for d in g.mig_devices)
    return gpus


def _short(uuid: str) -> str:
    return uuid[:12] + "…"


def render_slices(inventory: Inventory, held_by: dict[str, str]) -> list[str]:
    """The slice map: per GPU its slices and who holds them; a GPU in MIG mode with its MIG
    devices under it, each with its resource and slices."""
    lines = []
    for plan in inventory.plans:
        gpu = plan.gpu
        pad = "  " if gpu.is_mig_device else ""
        if gpu.is_mig_device:
            head = (
                f"  MIG {gpu.mig_profile}  GI {gpu.gpu_instance_id}  "
                f"{format_bytes(gpu.memory_total_bytes)}  {gpu.uuid}"
            )
        else:
            head = (
                f"GPU {gpu.index}  {gpu.name}  {format_bytes(gpu.memory_total_bytes)}  "
                f"NUMA {gpu.numa_node}  {gpu.uuid}"
            )
        lines.append(head)
        if not plan.sliced:
            lines.append(f"{pad}  not sliced: {plan.excluded_reason}")
            continue
        compute = (
            "compute not enforced"
            if gpu.is_mig_device
            else f"{plan.compute_share_ratio * 100:.4g}% compute each"
        )
        lines.append(
            f"{pad}  {plan.resource_name}: {plan.replicas} slices x "
            f"{format_bytes(plan.memory_per_slice_bytes)} memory, {compute}"
        )
        cells = []
        for s in inventory.slices:
            if s.id.gpu_uuid == gpu.uuid:
                owner = held_by.get(s.device_id, "free")
                cells.append(f"::{s.id.n} {owner}")
        for i in range(0, len(cells), 2):
            lines.append(f"{pad}    " + "".join(f"{c:<36}" for c in cells[i : i + 2]).rstrip())
    return lines


def _on_mig(inventory: Inventory, uuid: str) -> bool:
    plan = inventory.plan_for(uuid)
    return plan is not None and plan.gpu.is_mig_device


def render_pods(pods: Sequence[PodGrant], inventory: Inventory) -> list[str]:
    lines = [
        f"{'NAMESPACE/POD/CONTAINER':<38} {'SLICES':>6}  {'GPU':<5} {'MEMORY':>8} {'COMPUTE':>8}"
    ]
    for pod in pods:
        for c in pod.containers:
            slices = [inventory.by_id[d] for d in c.device_ids if d in inventory.by_id]
            gpus = sorted({s.gpu_index for s in slices})
            memory = sum(s.memory_limit_bytes for s in slices)
            compute = f"{sum(s.compute_share_ratio for s in slices) * 100:.4g}%"
            if any(_on_mig(inventory, s.id.gpu_uuid) for s in slices):
                compute = "MIG"  # not measured per MIG device, so not enforced
            lines.append(
                f"{pod.namespace + '/' + pod.name + '/' + c.name:<38} {len(c.device_ids):>6}  "
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
    # Closing the terminal (SIGHUP) stops the demo as cleanly as Ctrl-C does.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
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
        metrics_address="127.0.0.1:0",
        node_name="demo-node",
        # The demo's workloads are plain processes, in no pod cgroup.
        trust_host_processes=True,
    )
    backend = FakeBackend(state_file)
    daemon = Daemon(settings, backend, pod_resources_interval_s=1.0)
    workloads = DemoWorkloads(state_file)
    started = time.monotonic()
    run = asyncio.create_task(daemon.run(stop), name="daemon")

    def all_registered() -> bool:
        inventory = daemon.inventory.value
        names = inventory.resource_names
        return bool(names) and all(
            sim.is_registered(r)
            and len(sim.healthy_ids(r)) == len(inventory.for_resource(r).slices) > 0
            for r in names
        )

    try:
        await sim.wait_for(all_registered, timeout_s=10)
        inventory = daemon.inventory.value
        gpus = sum(1 for p in inventory.plans if not p.gpu.is_mig_device)
        say(
            f"vgpu demo: {gpus} fake GPUs and a built-in kubelet in {workdir}",
            f"state file (edit it to change the GPUs while the demo runs): {state_file}",
            "",
            *(
                f"kubelet: plugin registered and {len(sim.healthy_ids(r))} {r} slices "
                f"advertised {(time.monotonic() - started) * 1000:.0f} ms after start"
                for r in inventory.resource_names
            ),
            "",
        )
        for name, containers in DEMO_PODS:
            await sim.admit_pod(name, containers, resource_name=resource)
        for name, containers in DEMO_MIG_PODS:
            await sim.admit_pod(name, containers, resource_name=MIG_SMALL)
        pods = sim.pods()
        held_by = {
            d: f"{p.namespace}/{p.name}/{c.name}"
            for p in pods
            for c in p.containers
            for d in c.device_ids
        }
        say(*render_slices(inventory, held_by), "")
        say(*render_pods(pods, inventory), "")
        first = pods[0].containers[0]
        say(f"what {pods[0].namespace}/{pods[0].name}/{first.name} got from Allocate:")
        say(*(f"  {k}={v}" for k, v in sorted(first.envs.items())), "")

        say("restarting the kubelet (it deletes every plugin socket and re-creates kubelet.sock)…")
        before = len(sim.registrations)
        restarted = time.monotonic()
        await sim.restart()
        await sim.wait_for(lambda: len(sim.registrations) > before and all_registered())
        rereg_ms = (time.monotonic() - restarted) * 1000
        intact = sum(len(c.device_ids) for p in sim.pods() for c in p.containers)
        names = daemon.inventory.value.resource_names
        healthy = sum(len(sim.healthy_ids(r)) for r in names)
        say(
            f"kubelet: all {len(names)} resources re-registered {rereg_ms:.0f} ms after the "
            f"restart; {intact} allocated slices intact, {healthy} healthy",
            "",
        )
        before_work = daemon.poller.snapshot
        sized = workloads.start(sim.pods())
        assert daemon.http is not None
        address = f"127.0.0.1:{daemon.http.port}"
        say(
            "the containers now run GPU work: real processes that carry their Allocate env,",
            "listed in the state file; a host process with no slices uses the L4",
            *sized,
            f"metrics: http://{address}/metrics   status: vgpu-device-plugin status "
            f"--address {address} --watch",
            "",
        )
        await _wait_for_usage(daemon, timeout_s=3.0)
        say(*describe_actions(before_work, daemon.poller.snapshot), "")
        say(*_status_lines(daemon), "")
        say(
            "running; press Ctrl-C to stop"
            if duration_s is None
            else f"running for {duration_s:g} s; Ctrl-C stops earlier"
        )
        terminal = out.isatty()
        view = LiveView(out, terminal=terminal)
        await _live(daemon, workloads, stop, duration_s, view, seen=daemon.poller.snapshot)
        if not terminal:
            view.event("the status view at the end:")
            view.update(_status_lines(daemon))
        view.final()
        say("stopping")
        return 0
    finally:
        stop.set()
        await run
        workloads.stop()
        backend.close()
        await sim.stop()


async def _live(
    daemon: Daemon,
    workloads: DemoWorkloads,
    stop: asyncio.Event,
    duration_s: float | None,
    view: LiveView,
    *,
    seen: NodeSnapshot | None,
) -> None:
    """Until Ctrl-C or the duration: grow the notebook past its limit once, reap exited
    workloads, report each enforcement action as it happens (a killed process's exit only after
    its kill), and keep the status view current."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if duration_s is None else started + duration_s
    last_view = started
    grown = False
    reported_kills: set[str] = set()  # owners whose kill the enforcer has reported
    exits: list[tuple[float, int, str, int]] = []  # (seen at, pid, owner, return code)
    view.update(_status_lines(daemon, width=_width(view)) if view.terminal else [])
    while not stop.is_set() and (deadline is None or loop.time() < deadline):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
        now = loop.time()
        if not grown and now - started >= GROW_AFTER_S:
            grown = True
            (namespace, pod, container), memory = GROWN
            pid = workloads.grow(f"{namespace}/{pod}/{container}", memory)
            view.event(
                f"{namespace}/{pod}/{container} (pid {pid}) now uses {format_bytes(memory)} of "
                "GPU memory, over its limit",
                "",
            )
        exits.extend((now, pid, owner, code) for pid, owner, code in workloads.reap())
        snapshot = daemon.poller.snapshot
        if snapshot is not None:
            lines = describe_actions(seen, snapshot)
            if lines:
                view.event(*lines, "")
                reported_kills.update(_killed_owners(seen, snapshot))
            seen = snapshot
        for exit_ in list(exits):
            at, pid, owner, code = exit_
            killed = code == -signal.SIGKILL
            if not killed or owner in reported_kills or now - at >= KILL_REPORT_WAIT_S:
                exits.remove(exit_)
                reported_kills.discard(owner)
                how = " (SIGKILL)" if killed else ""
                view.event(f"process {pid} of {owner} has exited{how}", "")
        every = REDRAW_EVERY_S if view.terminal else STATUS_EVERY_S
        if view.terminal and now - last_view >= every:
            last_view = now
            view.update(_status_lines(daemon, width=_width(view)))


def _width(view: LiveView) -> int:
    """The view's width: the terminal's, less one column so that no line wraps."""
    return max(shutil.get_terminal_size((81, 24)).columns - 1, 40) if view.terminal else 80


def _killed_owners(before: NodeSnapshot | None, after: NodeSnapshot) -> set[str]:
    """namespace/pod/container of each container with a kill counted between two snapshots."""
    seen = {
        (e.allocation_id, e.gpu_uuid, e.kind, e.action): e.count
        for e in (before.enforcement if before else ())
    }
    return {
        f"{e.namespace}/{e.pod}/{e.container}"
        for e in after.enforcement
        if e.action == "kill"
        and e.count > seen.get((e.allocation_id, e.gpu_uuid, e.kind, e.action), 0)
    }


async def _wait_for_usage(daemon: Daemon, timeout_s: float) -> None:
    """Until every container with work is named and measured, or the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        snap = daemon.poller.snapshot
        busy = (
            {(c.pod, c.container) for c in snap.containers if c.sm_utilization_ratio > 0}
            if snap
            else set()
        )
        if busy >= set(DEMO_WORKLOADS) | set(SIZED_BY_HINTS):
            return
        await asyncio.sleep(0.1)


def _status_lines(daemon: Daemon, width: int = 80) -> list[str]:
    snapshot = daemon.poller.snapshot
    if snapshot is None:
        return ["(no snapshot yet)"]
    return render_status(snapshot_to_json(snapshot), width=width)


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In a child between fork and exec: have the kernel SIGKILL it when the demo dies. Only a
    system call here (prctl is async-signal-safe); the library was loaded before the fork."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# Waits for the demo to die (its end of the pipe closes, however it ends), then removes the
# demo's directory: a SIGKILLed demo leaves no files behind either.
_JANITOR = "import shutil,sys;sys.stdin.buffer.read();shutil.rmtree(sys.argv[1],ignore_errors=True)"


def _start_janitor(workdir: Path) -> int:
    """Start the janitor of `workdir`; returns the write end of its pipe, to keep open."""
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-c", _JANITOR, str(workdir)],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal's process group spares it
        )
    finally:
        os.close(read_end)
    return write_end


def run_demo(duration_s: float | None, out: TextIO) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="vgpu-demo-", dir="/tmp"))
    janitor = _start_janitor(workdir)
    try:
        return asyncio.run(_demo(duration_s, out, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        os.close(janitor)
