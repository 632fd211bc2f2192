"""Runs the whole daemon in-process against the kubelet simulator and a fake GPU state file."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deviceplugin.app import Daemon, DaemonSettings
from deviceplugin.config import Config, EnforcementConfig
from deviceplugin.gpu.fake import FakeBackend, FakeGpu, FakeState, write_state_file
from deviceplugin.kubelet_sim import KubeletSimulator
from deviceplugin.plugin.lifecycle import endpoint_name

GiB = 1024**3
RESOURCE = "nvidia.com/vgpu"
FAST = EnforcementConfig(poll_interval_s=0.05)


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
            node_name="test-node",
        )


@contextlib.asynccontextmanager
async def running_daemon(node: Node, config: Config | None = None) -> AsyncIterator[Daemon]:
    """Run a daemon until the block ends; fail the test if it died on its own."""
    settings = node.settings(config)
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield daemon
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def registered(node: Node, count: int, resource: str = RESOURCE) -> None:
    sim = node.sim
    await sim.wait_for(
        lambda: sim.is_registered(resource) and len(sim.devices(resource)) == count, timeout_s=10
    )
