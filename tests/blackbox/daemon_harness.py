"""Runs the whole daemon in-process against the kubelet simulator and a fake GPU state file."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.config import Config, DeviceIdStrategy, EnforcementConfig
from deviceplugin.dra.frontend import DraFrontend
from deviceplugin.gpu.backend import GpuBackend
from deviceplugin.gpu.fake import FakeBackend, FakeGpu, FakeProcess, FakeState, write_state_file
from deviceplugin.memlimits.settings import MemoryLimitSettings
from deviceplugin.model import NodeReading
from deviceplugin.partitions import MemoryLimits, PartitionSupport
from deviceplugin.plugin.frontend import DevicePluginFrontend
from deviceplugin.plugin.lifecycle import endpoint_name
from deviceplugin.sim.kubelet import KubeletSimulator

GiB = 1024**3
RESOURCE = "nvidia.com/vgpu"
# Every 50 ms, idle or not (test_quiet_poll covers the idle interval).
FAST = EnforcementConfig(poll_interval_s=0.05, idle_poll_interval_s=0.05)


def gpu(
    index: int,
    *,
    name: str = "NVIDIA A100-SXM4-80GB",
    memory_gib: int = 80,
    numa_node: int | None = 0,
    healthy: bool = True,
    mig: bool = False,
) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-00000000-0000-4000-8000-{index:012d}",
        index=index,
        name=name,
        memory_total_bytes=memory_gib * GiB,
        minor=index,
        numa_node=numa_node,
        healthy=healthy,
        mig_enabled=mig,
    )


TWO_GPUS = (gpu(0), gpu(1, name="NVIDIA L4", memory_gib=24, numa_node=1))


@dataclass
class Node:
    """A node: directories, the fake GPUs' state file and the kubelet simulator."""

    root: Path
    gpus: Sequence[FakeGpu]
    sim: KubeletSimulator = field(init=False)

    def __post_init__(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.podres_socket.parent.mkdir(parents=True, exist_ok=True)
        self.write_gpus(self.gpus)
        self.sim = KubeletSimulator(self.plugin_dir, self.podres_socket)

    @property
    def plugin_dir(self) -> Path:
        return self.root / "dp"

    @property
    def podres_socket(self) -> Path:
        return self.root / "pr" / "kubelet.sock"

    @property
    def state_file(self) -> Path:
        return self.root / "gpus.json"

    def plugin_socket(self, resource: str = RESOURCE) -> Path:
        return self.plugin_dir / endpoint_name(resource)

    def write_gpus(self, gpus: Sequence[FakeGpu]) -> None:
        self.gpus = gpus
        write_state_file(self.state_file, FakeState(gpus=tuple(gpus)))

    def settings(self, config: Config | None = None) -> DaemonSettings:
        return DaemonSettings(
            config=config or Config(enforcement=FAST),
            backend=f"fake:{self.state_file}",
            device_plugin_dir=self.plugin_dir,
            pod_resources_socket=self.podres_socket,
            state_dir=self.root / "state",
            # Where node labels may be written (nodeLabels.file); made only when one is.
            node_features_dir=self.root / "features.d",
            metrics_address="127.0.0.1:0",
            node_name="test-node",
            # The test's workloads run outside pod cgroups, like the demo's.
            trust_host_processes=True,
        )


@contextlib.asynccontextmanager
async def running_daemon(
    node: Node,
    config: Config | None = None,
    *,
    pod_resources_interval_s: float = 10.0,
    pod_resources_socket: Path | None = None,
    trust_host_processes: bool = True,
    backend: GpuBackend | None = None,
    kubelet_cgroup_root: str = "",
    device_id_strategy: DeviceIdStrategy | None = None,
    enforce_nvidia_config: bool = False,
    memory_limits: MemoryLimitSettings | None = None,
) -> AsyncIterator[Daemon]:
    """Run a daemon until the block ends (on `backend`, default: the node's fake GPUs, closed at
    the end either way); fail the test if it died on its own. `kubelet_cgroup_root`: the
    kubelet's cgroupfs root the daemon is told (`--kubelet-cgroup-root`), when given."""
    settings = dataclasses.replace(node.settings(config), trust_host_processes=trust_host_processes)
    if kubelet_cgroup_root:
        settings = dataclasses.replace(
            settings, kubelet_cgroup_driver="cgroupfs", kubelet_cgroup_root=kubelet_cgroup_root
        )
    if pod_resources_socket is not None:
        settings = dataclasses.replace(settings, pod_resources_socket=pod_resources_socket)
    if device_id_strategy is not None:  # --device-id-strategy
        settings = dataclasses.replace(settings, device_id_strategy=device_id_strategy)
    if enforce_nvidia_config:  # --enforce-nvidia-config true
        settings = dataclasses.replace(settings, enforce_nvidia_config=True)
    if memory_limits is not None:  # --memory-limits on, its socket and CDI directory
        settings = dataclasses.replace(settings, memory_limits=memory_limits)
    if backend is None:
        backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend, pod_resources_interval_s=pod_resources_interval_s)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield daemon
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


def plugins(daemon: Daemon) -> DevicePluginFrontend:
    """The daemon's device-plugin frontend (its endpoints, life cycles, tracker)."""
    frontend = daemon.frontend
    assert isinstance(frontend, DevicePluginFrontend), "not in device-plugin mode"
    return frontend


def dra_frontend(daemon: Daemon) -> DraFrontend:
    """The daemon's DRA frontend (its driver, store, publisher, registration)."""
    frontend = daemon.frontend
    assert isinstance(frontend, DraFrontend), "not in DRA mode"
    return frontend


def serve_args(node: Node) -> list[str]:
    """The `serve` flags that put a daemon on `node`: its fake GPUs, the simulator's sockets and
    a state directory of its own."""
    return [
        "--backend", f"fake:{node.state_file}",
        "--device-plugin-dir", str(node.plugin_dir),
        "--pod-resources-socket", str(node.podres_socket),
        "--state-dir", str(node.root / "state"),
    ]  # fmt: skip


async def registered(node: Node, count: int, resource: str = RESOURCE) -> None:
    sim = node.sim
    await sim.wait_for(
        lambda: sim.is_registered(resource) and len(sim.devices(resource)) == count, timeout_s=10
    )


class Workloads:
    """Real processes standing in for containers' GPU processes. Only processes spawned here are
    ever listed in the fake state, and every one is resumed and killed when the test ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, envs: Mapping[str, str] | None = None) -> int:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(envs or {})}
        proc = subprocess.Popen(["sleep", "300"], env=env)
        self.procs.append(proc)
        return proc.pid

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)


def with_processes(base: FakeGpu, *processes: FakeProcess) -> FakeGpu:
    return dataclasses.replace(base, processes=tuple(processes))


class HangingBackend:
    """The fake backend, whose polls hang from the moment `hang` is set until `release`."""

    def __init__(self, inner: FakeBackend) -> None:
        self.inner = inner
        self.hang = threading.Event()
        self.release = threading.Event()
        self.hanging = threading.Event()  # set once a poll hangs

    @property
    def name(self) -> str:
        return "hanging"

    def poll(self) -> NodeReading:
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait()
        return self.inner.poll()

    def close(self) -> None:
        self.release.set()
        self.inner.close()

    def set_wake(self, wake: Callable[[], None]) -> None:
        self.inner.set_wake(wake)

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        return self.inner.memory_partitioning()

    def set_memory_limits(
        self, gpu_uuid: str, cgroup: str, soft_bytes: int, hard_bytes: int
    ) -> None:
        self.inner.set_memory_limits(gpu_uuid, cgroup, soft_bytes, hard_bytes)

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        return self.inner.get_memory_limits(gpu_uuid, cgroup)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        return self.inner.clear_memory_limits(gpu_uuid, cgroup)


async def eventually(
    predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition"
) -> None:
    """Wait until `predicate()` holds, checking every 20 ms: for conditions on the daemon's own
    state, which the simulator's wait_for (woken only by kubelet-side events) does not see."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.02)
