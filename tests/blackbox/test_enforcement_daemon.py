"""Enforcement through the real `serve` process: kills, throttles, and every exit path resuming
what the daemon stopped. Only processes these tests spawn are listed in the fake state, and the
Workloads fixture resumes and kills them whatever happens."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.sim.kubelet import ContainerGrant
from tests.blackbox.daemon_harness import (
    TWO_GPUS,
    GiB,
    Node,
    Workloads,
    eventually,
    registered,
    with_processes,
)

CONFIG = """\
version: v1
enforcement:
  pollInterval: 100ms
  memory: {action: kill, gracePeriod: 500ms}
  compute: {action: throttle, window: 1s, period: 200ms, workConserving: true}
"""


class Serve:
    """`vgpu-device-plugin serve` as its own process, on the node's fake GPUs."""

    def __init__(self, node: Node, config: str = CONFIG) -> None:
        self.node = node
        self.config = node.root / "config.yaml"
        self.config.write_text(config)
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deviceplugin", "serve", "--config", str(self.config),
            "--backend", f"fake:{self.node.state_file}", "--trust-host-processes",
            "--device-plugin-dir", str(self.node.plugin_dir),
            "--pod-resources-socket", str(self.node.podres_socket),
            "--state-dir", str(self.node.root / "state"),
            "--metrics-address", f"127.0.0.1:{self.port}",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    async def stop(self, sig: signal.Signals = signal.SIGTERM) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.send_signal(sig)
        _, err = await asyncio.wait_for(self.proc.communicate(), 20)
        assert self.proc.returncode is not None
        return self.proc.returncode, err.decode()

    async def status(self) -> dict[str, object]:
        def get() -> dict[str, object]:
            url = f"http://127.0.0.1:{self.port}/status"
            with urllib.request.urlopen(url, timeout=5) as r:
                doc: dict[str, object] = json.load(r)
                return doc

        return await asyncio.to_thread(get)

    async def kill_if_running(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def serve(node: Node) -> AsyncIterator[Serve]:
    daemon = Serve(node)
    try:
        yield daemon
    finally:
        await daemon.kill_if_running()


def state_of(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    try:
        return state_of(pid) != "Z"
    except FileNotFoundError:
        return False


async def start_contention(node: Node, workloads: Workloads) -> tuple[int, int]:
    """A 1-slice (25%) and a 3-slice (75%) container on one GPU, both wanting all of it."""
    small = (await node.sim.admit_pod("small", [("c", 1)])).containers[0]
    big = (await node.sim.admit_pod("big", [("c", 3)])).containers[0]
    assert gpu_of(small) == gpu_of(big)
    small_pid = workloads.spawn(small.envs)
    big_pid = workloads.spawn(big.envs)
    gpu = next(g for g in TWO_GPUS if g.uuid == gpu_of(small))
    node.write_gpus(
        [
            with_processes(g, FakeProcess(small_pid, GiB, 100), FakeProcess(big_pid, GiB, 100))
            if g is gpu
            else g
            for g in TWO_GPUS
        ]
    )
    return small_pid, big_pid


def gpu_of(grant: ContainerGrant) -> str:
    return grant.device_ids[0].rsplit("::", 1)[0]


async def throttled(serve: Serve, pod: str) -> bool:
    doc = await serve.status()
    containers = doc["containers"]
    assert isinstance(containers, list)
    return any(c["pod"] == pod and c["duty_cycle_ratio"] is not None for c in containers)


async def wait_throttled(serve: Serve, pod: str, timeout_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await throttled(serve, pod):
        assert loop.time() < deadline, f"{pod} never throttled"
        await asyncio.sleep(0.1)


async def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    await eventually(lambda: state_of(pid) == "T", timeout_s, f"pid {pid} stopped")


async def test_over_limit_container_is_killed_and_a_host_process_never_is(
    node: Node, serve: Serve, workloads: Workloads
) -> None:
    await serve.start()
    await registered(node, 8)
    grant = (await node.sim.admit_pod("hog", [("c", 1)])).containers[0]
    gpu = next(g for g in TWO_GPUS if g.uuid == gpu_of(grant))
    limit = gpu.memory_total_bytes // 4
    hog = workloads.spawn(grant.envs)
    host = workloads.spawn()  # no allocation: never touched, however much it uses
    node.write_gpus(
        [
            with_processes(g, FakeProcess(hog, limit + GiB, 10), FakeProcess(host, 3 * limit, 10))
            if g is gpu
            else g
            for g in TWO_GPUS
        ]
    )
    await eventually(lambda: not alive(hog), 10, "the over-limit process killed")
    assert alive(host)

    async def kills() -> list[tuple[object, object]]:
        enforcement = (await serve.status())["enforcement"]
        assert isinstance(enforcement, list)
        return [
            (e["pod"], e["count"])
            for e in enforcement
            if e["kind"] == "memory" and e["action"] == "kill"
        ]

    # Counted once, under the pod's name (which pod-resources gives within a fraction of a second).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (found := await kills()) != [("hog", 1)]:
        assert loop.time() < deadline, found
        await asyncio.sleep(0.1)
    code, err = await serve.stop()
    assert code == 0
    assert "pid=" in err
    assert f"pid={hog}" in err


async def test_throttled_process_runs_again_after_sigterm(
    node: Node, serve: Serve, workloads: Workloads
) -> None:
    await serve.start()
    await registered(node, 8)
    small, big = await start_contention(node, workloads)
    await wait_throttled(serve, "small")
    await wait_stopped(small)
    code, _ = await serve.stop(signal.SIGTERM)
    assert code == 0
    assert state_of(small) != "T"
    assert state_of(big) != "T"


async def test_throttled_process_runs_again_after_the_daemon_is_killed_and_restarted(
    node: Node, serve: Serve, workloads: Workloads
) -> None:
    await serve.start()
    await registered(node, 8)
    small, _ = await start_contention(node, workloads)
    await wait_throttled(serve, "small")
    await wait_stopped(small)
    code, _ = await serve.stop(signal.SIGKILL)
    assert code == -signal.SIGKILL
    # Killed outright, mid-cycle: nothing resumed it ...
    assert state_of(small) == "T"
    # ... until the next daemon starts, reads its record and resumes it.
    again = Serve(node)
    try:
        await again.start()
        await eventually(lambda: state_of(small) != "T", 15, "the stopped process resumed")
    finally:
        await again.kill_if_running()
