"""The daemon against a hung GPU backend and a kubelet that accepts but never streams."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.app import Daemon
from deviceplugin.errors import StartupError
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.kubelet.proto import KUBELET_SOCKET, dp, dp_grpc
from deviceplugin.model import allocation_id
from tests.blackbox.daemon_harness import (
    RESOURCE,
    TWO_GPUS,
    HangingBackend,
    Node,
    eventually,
    plugins,
    registered,
    running_daemon,
)


async def test_a_first_poll_that_never_answers_is_a_clear_start_up_error(node: Node) -> None:
    backend = HangingBackend(FakeBackend(node.state_file))
    backend.hang.set()
    daemon = Daemon(node.settings(), backend)
    daemon.poller.timeout_s = 0.3
    try:
        with pytest.raises(StartupError, match="did not answer its first poll"):
            await daemon.run(asyncio.Event())
    finally:
        backend.close()


async def test_a_hung_backend_never_stalls_allocate_or_registration(node: Node) -> None:
    backend = HangingBackend(FakeBackend(node.state_file))
    daemon = Daemon(node.settings(), backend)
    daemon.poller.timeout_s = 0.3
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await registered(node, 8)
        backend.hang.set()  # every poll from now on hangs in the driver
        await eventually(lambda: daemon.poller.failures >= 2, 5, "polls timing out")
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        assert snapshot.stale
        # The kubelet is still served, from memory ...
        pod = await asyncio.wait_for(node.sim.admit_pod("during-hang", [("c", 2)]), 2)
        assert len(pod.containers[0].device_ids) == 2
        # ... and a kubelet restart is still noticed and answered.
        before = len(node.sim.registrations)
        await node.sim.restart()
        await node.sim.wait_for(
            lambda: (
                len(node.sim.registrations) > before and node.sim.is_registered("nvidia.com/vgpu")
            )
        )
        backend.release.set()
        backend.hang.clear()
        await eventually(lambda: daemon.poller.failures == 0, 5, "polling to recover")
    finally:
        stop.set()
        backend.release.set()
        await asyncio.wait_for(task, 10)
        backend.close()


def test_a_call_hung_in_the_poll_worker_does_not_keep_the_process_alive() -> None:
    script = (
        "import threading\n"
        "from deviceplugin.poller import DaemonWorker\n"
        "worker = DaemonWorker('vgpu-poll')\n"
        "worker.submit(threading.Event().wait)\n"
        "worker.shutdown()\n"
        "print('exiting')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "exiting"


class SilentKubelet(dp_grpc.RegistrationServicer):
    """Accepts every registration and never dials back: a kubelet whose dial-back failed."""

    def __init__(self) -> None:
        self.registrations = 0

    async def Register(  # noqa: N802 (the kubelet's method name)
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dp.Empty:
        self.registrations += 1
        return dp.Empty()


async def test_registration_without_a_stream_is_tried_again(short_tmp: Path) -> None:
    node = Node(short_tmp, TWO_GPUS)
    kubelet = SilentKubelet()
    server = grpc.aio.server()
    dp_grpc.add_RegistrationServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{node.plugin_dir / KUBELET_SOCKET}")
    await server.start()
    backend = FakeBackend(node.state_file)
    daemon = Daemon(node.settings(), backend)
    plugins(daemon).lifecycle.stream_open_timeout_s = 0.3
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await eventually(lambda: kubelet.registrations >= 3, 10, "registering again")
        assert "no ListAndWatch stream" in plugins(daemon).lifecycle.stats.last_restart_reason
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()
        await server.stop(None)


def _status(daemon: Daemon) -> dict[str, Any]:
    assert daemon.http is not None
    url = f"http://127.0.0.1:{daemon.http.port}/status"
    with urllib.request.urlopen(url, timeout=5) as response:
        document: dict[str, Any] = json.load(response)
    return document


async def test_status_says_how_long_the_plugin_has_been_unregistered(short_tmp: Path) -> None:
    # No kubelet at all: the daemon keeps trying to register. /status says for how long, in
    # seconds since, not as a reading of some clock that only the daemon has.
    node = Node(short_tmp, TWO_GPUS)
    started = time.time()
    async with running_daemon(node) as daemon:
        await eventually(lambda: daemon.poller.snapshot is not None, 10, "a first poll")
        await asyncio.sleep(1.2)
        await eventually(
            lambda: (
                daemon.poller.snapshot is not None
                and daemon.poller.snapshot.taken_at_s > started + 1.0
            ),
            10,
            "a poll a second in",
        )
        health = (await asyncio.to_thread(_status, daemon))["health"]
    assert health["registered"] is False
    since = health["unregistered_since_s"]
    assert 0.5 <= since <= time.time() - started + 0.5, health
    assert health["unregistered_since"] is not None


async def test_a_register_that_races_the_kubelets_start_up_cleanup_does_not_stall(
    node: Node,
) -> None:
    # A restarting kubelet removes every plugin socket. A Register that reaches it just after
    # that names a socket that is gone: the kubelet dials it for 10 s. The plugin must notice
    # its socket went, serve again and register again at once, not wait out its own timeout.
    async with running_daemon(node):
        await registered(node, 8)
        waits = []
        for _ in range(3):
            await node.sim.stop()
            started = time.monotonic()
            await node.sim.start(cleanup_races_registration=True)
            await node.sim.wait_for(lambda: node.sim.is_registered(RESOURCE), timeout_s=20)
            waits.append(time.monotonic() - started)
    # About 0.04 s; a Register left to its own timeout takes 5 s. (Room for a loaded machine.)
    assert max(waits) < 2.5, [f"{w:.3f}s" for w in waits]


def _allocated_slices(daemon: Daemon) -> int:
    return sum(g["slices"]["allocated"] for g in _status(daemon)["gpus"])


async def test_a_restarted_kubelet_that_lists_no_pods_yet_takes_no_allocation_away(
    node: Node,
) -> None:
    # Right after a restart the kubelet lists no pod until it has had them from the API server;
    # its checkpoint still names them. That answer is not the pods leaving: what they hold stays
    # known, counted and asked about, and goes only once the pod is really deleted.
    async with running_daemon(node, pod_resources_interval_s=0.1) as daemon:
        await registered(node, 8)
        pod = await node.sim.admit_pod("train", [("main", 2)])
        held = allocation_id(pod.containers[0].device_ids)
        await eventually(lambda: _named(daemon, held) == "train", 10, "the pod named")
        await node.sim.restart(pods_synced=False)
        await registered(node, 8)
        seen = plugins(daemon).tracker.refreshes
        await eventually(lambda: plugins(daemon).tracker.refreshes >= seen + 4, 10, "refreshes")
        assert daemon.book.get(held) is not None, "dropped on an answer that listed no pod"
        await asyncio.sleep(0.2)  # a poll or two
        assert await asyncio.to_thread(_allocated_slices, daemon) == 2
        node.sim.sync_pods()
        seen = plugins(daemon).tracker.refreshes
        await eventually(lambda: plugins(daemon).tracker.refreshes >= seen + 2, 10, "refreshes")
        assert _named(daemon, held) == "train"
        await node.sim.delete_pod("default", "train")
        await eventually(lambda: daemon.book.get(held) is None, 10, "the deleted pod's slices")
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(_allocated_slices, daemon) == 0


def _named(daemon: Daemon, allocation: str) -> str | None:
    record = daemon.book.get(allocation)
    return None if record is None else record.pod


async def test_a_stream_that_ends_just_before_a_kubelet_restart_is_not_a_failure(
    node: Node,
) -> None:
    # A kubelet killed outright: its ListAndWatch stream can end while its socket still takes
    # connections for a moment, which looks like a broken stream. Once a new kubelet is there,
    # that was a restart: registered and healthy at once, not after 10 s of probation.
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        await eventually(lambda: daemon.health().registered, 10, "registered")
        waits = []
        for _ in range(3):
            await node.sim.break_stream(RESOURCE)
            await eventually(
                lambda: plugins(daemon).lifecycle.unstable_since_s > 0, 10, "a failure"
            )
            await node.sim.restart()
            started = time.monotonic()
            await eventually(
                lambda: daemon.health().registered and node.sim.is_registered(RESOURCE),
                5,
                "registered with the new kubelet and healthy",
            )
            waits.append(time.monotonic() - started)
            # Tens of milliseconds; 10 s of probation otherwise. (Room for a loaded machine.)
            assert waits[-1] < 3.0, [f"{w:.3f}s" for w in waits]
