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
gave it. As root with a writable cgroup v2 hierarchy, one more container runs in a real cgroup
and the GPU's driver, not the enforcer, holds it at its memory limit (`demo_limits`). It runs
until Ctrl-C or --duration, then stops everything it started and removes its directory and
cgroups.

The story is printed once. Then, on a terminal, the status view stays at the bottom and is
redrawn in place while events (enforcement actions, exits) scroll above it; into a pipe or a file,
only the events are written as they happen, and the view once more at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.gpu.examples import MiB
from deviceplugin.gpu.fake import (
    FakeBackend,
    FakeState,
    write_state_file,
)
from deviceplugin.memlimits.settings import MemoryLimitSettings
from deviceplugin.sim.demo_limits import (
    DriverLimits,
    HeldAtLimit,
    demo_subtree_name,
    grant_id,
    hook_request,
    place,
    remove_tree,
)
from deviceplugin.sim.demo_view import (
    LiveView,
    _live,
    _status_lines,
    _wait_for_usage,
    describe_actions,
    plural,
    render_pods,
    render_slices,
)
from deviceplugin.sim.demo_workloads import (
    DEMO_CONFIG,
    DEMO_MIG_PODS,
    DEMO_PODS,
    DRIVER_LIMITED_POD,
    DRIVER_LIMITED_WORK,
    MIG_SMALL,
    DemoWorkloads,
    demo_gpus,
)
from deviceplugin.sim.kubelet import KubeletSimulator


async def _demo(
    duration_s: float | None, out: TextIO, workdir: Path, limits: DriverLimits | None, why: str
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Closing the terminal (SIGHUP) stops the demo as cleanly as Ctrl-C does.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        loop.add_signal_handler(sig, stop.set)
    node = await _Node.start(workdir, out, limits)
    started = time.monotonic()
    run = asyncio.create_task(node.daemon.run(stop), name="daemon")
    try:
        await node.sim.wait_for(node.all_registered, timeout_s=10)
        if limits is not None:  # Allocate names the hook once the daemon serves it
            await _hook_served(node.daemon, timeout_s=10)
        node.introduce(started, why)
        await node.admit_pods()
        await node.restart_kubelet()
        await node.run_work()
        await node.run_live(stop, duration_s)
        return 0
    finally:
        stop.set()
        await run
        node.workloads.stop()
        node.backend.close()
        await node.sim.stop()


async def _hook_served(daemon: Daemon, timeout_s: float) -> None:
    """Wait for the daemon to serve the memory-limit hook (from its first poll of the GPUs)."""
    deadline = time.monotonic() + timeout_s
    while daemon.memory_limits.server is None:
        if time.monotonic() > deadline:
            why = daemon.memory_limits.view.why_not
            raise RuntimeError(f"no memory-limit hook served after {timeout_s:g} s: {why}")
        await asyncio.sleep(0.05)


@dataclasses.dataclass(frozen=True, slots=True)
class _Node:
    """The demo's node: the kubelet simulator, the daemon on its fake GPUs, the workloads, and
    where the story is told. Each method is one act of the story (this module's docstring)."""

    workdir: Path
    state_file: Path
    sim: KubeletSimulator
    backend: FakeBackend
    daemon: Daemon
    workloads: DemoWorkloads
    out: TextIO
    # The cgroups of the driver-limited container (demo_limits); None where it is left out.
    limits: DriverLimits | None
    held: list[HeldAtLimit] = dataclasses.field(default_factory=list)

    @classmethod
    async def start(cls, workdir: Path, out: TextIO, limits: DriverLimits | None) -> _Node:
        """The fake GPUs written and the simulator started; the daemon built, not yet run."""
        plugin_dir = workdir / "device-plugins"
        podres_socket = workdir / "pod-resources" / "kubelet.sock"
        state_file = workdir / "gpus.json"
        podres_socket.parent.mkdir(parents=True)
        gpus = demo_gpus(partitioned=limits is not None)
        write_state_file(state_file, FakeState(gpus=gpus))
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
        if limits is not None:
            # The driver-limited pod's cgroups are in the kubelet's cgroupfs layout, under the
            # demo's subtree; the hook's socket and the CDI specs in the demo's directory.
            settings = dataclasses.replace(
                settings,
                memory_limits=MemoryLimitSettings(
                    socket=workdir / "run" / "hook.sock", cdi_dir=workdir / "cdi"
                ),
                kubelet_cgroup_driver="cgroupfs",
                kubelet_cgroup_root=limits.root,
                cgroup_mount=limits.mount,
            )
            backend = FakeBackend(state_file, cgroup_root=limits.mount)
        daemon = Daemon(settings, backend, pod_resources_interval_s=1.0)
        workloads = DemoWorkloads(state_file, gpus)
        return cls(workdir, state_file, sim, backend, daemon, workloads, out, limits)

    def say(self, *lines: str) -> None:
        for line in lines:
            print(line, file=self.out)
        self.out.flush()

    def all_registered(self) -> bool:
        """Every resource registered with the simulator, every slice of it advertised healthy."""
        inventory = self.daemon.inventory.value
        names = inventory.resource_names
        return bool(names) and all(
            self.sim.is_registered(r)
            and len(self.sim.healthy_ids(r)) == len(inventory.for_resource(r).slices) > 0
            for r in names
        )

    def introduce(self, started: float, why: str) -> None:
        """The GPUs, and how soon after `started` each resource was advertised; `why` the
        driver-limited container is left out, if it is."""
        inventory = self.daemon.inventory.value
        gpus = sum(1 for p in inventory.plans if not p.gpu.is_mig_device)
        self.say(
            f"vgpu demo: {gpus} fake GPUs and a built-in kubelet in {self.workdir}",
            f"state file (edit it to change the GPUs while the demo runs): {self.state_file}",
            "",
            *(
                f"kubelet: plugin registered and "
                f"{plural(len(self.sim.healthy_ids(r)), r + ' slice')} "
                f"advertised {(time.monotonic() - started) * 1000:.0f} ms after start"
                for r in inventory.resource_names
            ),
            "",
        )
        if self.limits is None:
            self.say(
                f"no driver-limited container: {why} (every GPU is polled)",
                "",
            )

    async def admit_pods(self) -> None:
        """The example pods admitted; which slice each got, and one container's Allocate env."""
        sim = self.sim
        inventory = self.daemon.inventory.value
        for name, containers in DEMO_PODS:
            await sim.admit_pod(name, containers, resource_name=DEMO_CONFIG.resource_name)
        for name, containers in DEMO_MIG_PODS:
            await sim.admit_pod(name, containers, resource_name=MIG_SMALL)
        if self.limits is not None:
            name, containers = DRIVER_LIMITED_POD
            await sim.admit_pod(name, containers, resource_name=DEMO_CONFIG.resource_name)
        pods = sim.pods()
        held_by = {
            d: f"{p.namespace}/{p.name}/{c.name}"
            for p in pods
            for c in p.containers
            for d in c.device_ids
        }
        self.say(*render_slices(inventory, held_by), "")
        self.say(*render_pods(pods, inventory), "")
        first = pods[0].containers[0]
        self.say(f"what {pods[0].namespace}/{pods[0].name}/{first.name} got from Allocate:")
        self.say(*(f"  {k}={v}" for k, v in sorted(first.envs.items())), "")

    async def restart_kubelet(self) -> None:
        """The kubelet restarted, as a node upgrade does; the plugin registers again."""
        sim = self.sim
        self.say(
            "restarting the kubelet (it deletes every plugin socket and re-creates kubelet.sock)…"
        )
        before = len(sim.registrations)
        restarted = time.monotonic()
        await sim.restart()
        await sim.wait_for(lambda: len(sim.registrations) > before and self.all_registered())
        rereg_ms = (time.monotonic() - restarted) * 1000
        intact = sum(len(c.device_ids) for p in sim.pods() for c in p.containers)
        names = self.daemon.inventory.value.resource_names
        healthy = sum(len(sim.healthy_ids(r)) for r in names)
        self.say(
            f"kubelet: all {len(names)} resources re-registered {rereg_ms:.0f} ms after the "
            f"restart; {intact} allocated slices intact, {healthy} healthy",
            "",
        )

    async def run_work(self) -> None:
        """The containers' GPU work started; what the enforcer did, and the usage."""
        daemon = self.daemon
        before_work = daemon.poller.snapshot
        if self.limits is not None:
            await self.start_limited(self.limits)
        sized = self.workloads.start(self.sim.pods())
        assert daemon.http is not None
        address = f"127.0.0.1:{daemon.http.port}"
        self.say(
            "the containers now run GPU work: real processes that carry their Allocate env,",
            "listed in the state file; a host process with no slices uses the L4",
            *sized,
            f"metrics: http://{address}/metrics   status: vgpu-device-plugin status "
            f"--address {address} --watch",
            "",
        )
        await _wait_for_usage(daemon, timeout_s=3.0)
        self.say(*describe_actions(before_work, daemon.poller.snapshot), "")
        self.say(*_status_lines(daemon), "")
        self.say(
            "DRA mode (serve --kubelet-api dra): pods claim an amount of memory and compute, the",
            "stock scheduler places them, vgpu enforces the same way; the built-in kubelet does",
            'not speak DRA: try it on a node, docs/dra.md "Try DRA on a node by hand".',
            "",
        )

    async def start_limited(self, limits: DriverLimits) -> None:
        """The driver-limited container started as a runtime starts it: its process in its own
        cgroup, the hook's request answered, before the process asks for GPU memory."""
        name, ((container_name, _),) = DRIVER_LIMITED_POD
        pod = next(p for p in self.sim.pods() if p.name == name)
        container = next(c for c in pod.containers if c.name == container_name)
        owner = f"{pod.namespace}/{pod.name}/{container.name}"
        cgroup = limits.container_cgroup(pod.uid, container.name)
        pid = self.workloads.start_one(pod, container, DRIVER_LIMITED_WORK)
        place(pid, cgroup)
        grant = grant_id(container)
        memory = self.daemon.settings.memory_limits
        answer = (
            "ERR Allocate named no CDI device carrying the hook"
            if grant is None or memory is None
            else await hook_request(memory.socket, pid, grant)
        )
        limit = int(container.envs.get("VGPU_MEMORY_LIMIT_MIB_0", "0")) * MiB
        shown = f"{limits.root}/kubepods/burstable/pod{pod.uid[:8]}…/{cgroup.name[:12]}…"
        self.say(
            f"{owner} starts as a runtime starts a container: its process (pid {pid})",
            f"  in its own cgroup v2, in the kubelet's layout: {shown}",
            f"  the runtime's hook asked the daemon to limit it (grant {grant}); the daemon",
            f"  answered: {answer}",
        )
        if answer.startswith("OK"):
            self.held.append(HeldAtLimit(self.workloads, owner, pid, limit, self.state_file))

    async def run_live(self, stop: asyncio.Event, duration_s: float | None) -> None:
        """The live view until `stop` or `duration_s`."""
        self.say(
            "running; press Ctrl-C to stop"
            if duration_s is None
            else f"running for {duration_s:g} s; Ctrl-C stops earlier"
        )
        terminal = self.out.isatty()
        view = LiveView(self.out, terminal=terminal)
        daemon = self.daemon
        await _live(
            daemon,
            self.workloads,
            stop,
            duration_s,
            view,
            seen=daemon.poller.snapshot,
            extra=lambda elapsed_s: [line for h in self.held for line in h.tick(elapsed_s)],
        )
        if not terminal:
            view.event("the status view at the end:")
            view.update(_status_lines(daemon))
        view.final()
        self.say("stopping")


# Waits for the demo to die (its end of the pipe closes, however it ends), then removes the
# demo's directory and its cgroup subtree, if any (once its processes, which die with the demo,
# have left it): a SIGKILLed demo leaves no files or cgroups behind either.
# (demo_limits.remove_tree, repeated: the janitor imports nothing of the demo's.)
_JANITOR = """
import os, shutil, sys, time
sys.stdin.buffer.read()
shutil.rmtree(sys.argv[1], ignore_errors=True)
for _ in range(100):
    for top in sys.argv[2:]:
        for path, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(path)
            except OSError:
                continue
    if not any(os.path.exists(top) for top in sys.argv[2:]):
        break
    time.sleep(0.1)
"""


def _start_janitor(workdir: Path, *cgroups: Path) -> int:
    """Start the janitor of `workdir` and of the cgroup subtrees `cgroups`; returns the write
    end of its pipe, to keep open."""
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-c", _JANITOR, str(workdir), *map(str, cgroups)],
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
    limits: DriverLimits | None = None
    try:
        limits, why = DriverLimits.prepare(demo_subtree_name())
        janitor = _start_janitor(workdir, *([limits.top] if limits is not None else []))
    except BaseException:
        # No janitor to clean up after us: what was made so far goes now.
        shutil.rmtree(workdir, ignore_errors=True)
        if limits is not None:
            _remove_cgroups(limits.top)
        raise
    try:
        return asyncio.run(_demo(duration_s, out, workdir, limits, why))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if limits is not None:
            _remove_cgroups(limits.top)
        os.close(janitor)


def _remove_cgroups(top: Path) -> None:
    """Remove the demo's cgroup subtree; its processes were killed and waited for, but the
    kernel may take a moment to empty their cgroups (the janitor retries longer)."""
    for _ in range(20):
        if remove_tree(top):
            return
        time.sleep(0.05)
