"""MPS v2 end to end, against a stand-in for nvidia-cuda-mps-control
(tests/support/fake_mps_control.py) that daemonises like the real one and records what it was
asked: the daemon starts the node's control daemon, sets one slice's limits per GPU, starts it
again when it dies, hands containers the pipe directory, and sends it `quit` on every way out.
The fake offers MPS v3 too: these configs ask for v2 (`mps.protocol: v2`), the protocol of
drivers before R615 (tests/blackbox/test_mps_daemon_v3.py runs v3)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import Config, MpsConfig, MpsProtocol
from deviceplugin.errors import StartupError
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.gpu.mps import PID_FILE
from tests.blackbox.daemon_harness import (
    FAST,
    TWO_GPUS,
    Node,
    eventually,
    registered,
    running_daemon,
    serve_args,
)
from tests.blackbox.test_reload import configmap, daemon_with_config, reloads

FAKE_CONTROL = Path(__file__).resolve().parents[1] / "support" / "fake_mps_control.py"
MiB = 1024**2


def mps_root(node: Node) -> Path:
    return node.root / "mps"


def mps_config(node: Node) -> Config:
    return Config(
        enforcement=FAST,
        mps=MpsConfig(
            enabled=True,
            root=str(mps_root(node)),
            control_command=str(FAKE_CONTROL),
            protocol=MpsProtocol.V2,
        ),
    )


def records(node: Node) -> list[dict[str, Any]]:
    path = mps_root(node) / "log" / "fake-control.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def commands(node: Node) -> list[str]:
    """The commands the control daemon was sent, but the reads of its defaults that the
    supervisor makes at every check."""
    return [
        r["command"]
        for r in records(node)
        if r["event"] == "command" and not r["command"].startswith("get_default_")
    ]


def control_pid(node: Node) -> int | None:
    try:
        pid = int((mps_root(node) / "pipe" / PID_FILE).read_text())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text()


def one_slice_defaults() -> list[str]:
    a100, l4 = TWO_GPUS  # 80Gi and 24Gi, 4 slices each
    return [
        f"set_default_device_pinned_mem_limit {a100.uuid} {80 * 1024 // 4}M",
        f"set_default_device_pinned_mem_limit {l4.uuid} {24 * 1024 // 4}M",
        "set_default_active_thread_percentage 25",
    ]


@pytest.fixture(autouse=True)
def no_stray_control_daemon(node: Node) -> Iterator[None]:
    """Whatever a test does, no fake control daemon outlives it (only the one this test's
    daemon started, found by its PID file in the test's own directory, is ever signalled)."""
    yield
    pid = control_pid(node)
    if pid is not None and "fake_mps_control" in cmdline(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the MPS control daemon (pid {pid}) outlived the daemon")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 (loopback)
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_starts_the_control_daemon_with_one_slice_per_gpu(node: Node) -> None:
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)
        runs = [r for r in records(node) if r["event"] == "run"]
        assert runs[0]["argv"] == ["-f"]
        assert runs[0]["env"] == {
            "CUDA_MPS_PIPE_DIRECTORY": str(mps_root(node) / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(mps_root(node) / "log"),
        }
        # One command per run of the control command, on its stdin, with the same environment.
        assert commands(node) == one_slice_defaults()
        assert all(r["env"] == runs[0]["env"] for r in runs)
        pid = control_pid(node)
        assert pid is not None

        assert daemon.http is not None
        base = f"http://127.0.0.1:{daemon.http.port}"

        def published_up() -> bool:
            snapshot = daemon.poller.snapshot
            return (
                snapshot is not None and snapshot.health.mps is not None and snapshot.health.mps.up
            )

        await eventually(published_up, what="a snapshot with the MPS state")
        _, body = await asyncio.to_thread(get, f"{base}/status")
        mps = json.loads(body)["health"]["mps"]
        assert mps == {
            "up": True,
            "pid": pid,
            "restarts_total": 0,
            "pipe_directory": str(mps_root(node) / "pipe"),
            "error": "",
            "protocol": 2,
            "drains_total": 0,
            "undrained_total": 0,
            "wedges_total": 0,
            "canary_error": "",
            "drift_total": {},
            "root_clients": [],
            "namespaces": [],
        }
        _, metrics = await asyncio.to_thread(get, f"{base}/metrics")
        assert 'vgpu_mps_daemon_up{node="test-node"} 1.0' in metrics
        assert 'vgpu_mps_daemon_restarts_total{node="test-node"} 0.0' in metrics
        assert (await asyncio.to_thread(get, f"{base}/healthz"))[0] == 200
        # The shared memory directory is open to MPS servers of any user, like /dev/shm.
        assert (mps_root(node) / "shm").stat().st_mode & 0o7777 == 0o1777
        # The pipe directory is open to clients of any user (the daemon's own files are not).
        assert (mps_root(node) / "pipe").stat().st_mode & 0o7777 == 0o755
    assert "quit" in commands(node)


async def test_allocate_hands_containers_the_pipe_directory_and_shared_memory(
    node: Node,
) -> None:
    async with running_daemon(node, mps_config(node)):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 2)])).containers[0]
    pipe = str(mps_root(node) / "pipe")
    assert grant.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert (pipe, pipe, True) in grant.mounts
    assert ("/dev/shm", str(mps_root(node) / "shm"), False) in grant.mounts
    # Two slices of one GPU: the container's own limits, besides the control daemon's defaults.
    assert grant.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert grant.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=")


async def test_a_dead_control_daemon_is_started_again_with_its_defaults(node: Node) -> None:
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS runs by then
        assert daemon.mps is not None
        daemon.mps.check_interval_s = 0.05
        first = control_pid(node)
        assert first is not None
        assert "fake_mps_control" in cmdline(first)
        os.kill(first, signal.SIGKILL)  # a crash: it leaves its PID file and socket behind

        await eventually(
            lambda: (daemon.health().mps or pytest.fail("no MPS status")).restarts_total == 1,
            what="the control daemon to be started again",
        )
        second = control_pid(node)
        assert second is not None
        assert second != first
        status = daemon.health().mps
        assert status is not None
        assert status.up
        assert status.pid == second
        # Its settings died with it: they are set again.
        assert commands(node) == one_slice_defaults() * 2
        starts = [r for r in records(node) if r["event"] == "run" and r["argv"] == ["-f"]]
        assert len(starts) == 2

        assert daemon.http is not None
        url = f"http://127.0.0.1:{daemon.http.port}/metrics"
        counted = 'vgpu_mps_daemon_restarts_total{node="test-node"} 1.0'
        await eventually(lambda: counted in get(url)[1], what="the restart in the metrics")
    assert commands(node)[-1] == "quit"
    assert not alive(second)


async def test_a_control_daemon_that_will_not_start_again_is_retried_and_reported(
    node: Node,
) -> None:
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS runs by then
        assert daemon.mps is not None
        daemon.mps.check_interval_s = 0.05
        first = control_pid(node)
        assert first is not None
        (mps_root(node) / "fake-fail-start").touch()
        os.kill(first, signal.SIGKILL)

        def down() -> bool:
            status = daemon.health().mps
            return status is not None and not status.up and "exited with 1" in status.error

        await eventually(down, what="the failed restart to be reported")
        assert daemon.healthz()[0]  # not yet: /healthz fails after 30 s down
        (mps_root(node) / "fake-fail-start").unlink()
        await eventually(
            lambda: (daemon.health().mps or pytest.fail("no MPS status")).up,
            what="the retry, after the backoff",
        )
        status = daemon.health().mps
        assert status is not None
        assert status.restarts_total == 1
        assert status.error == ""
        assert commands(node) == one_slice_defaults() * 2


async def test_a_change_of_gpus_is_sent_to_the_running_control_daemon(node: Node) -> None:
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS runs by then
        assert daemon.mps is not None
        daemon.mps.check_interval_s = 0.05
        pid = control_pid(node)
        node.write_gpus([TWO_GPUS[0]])  # the L4 is gone
        a100 = one_slice_defaults()[0]
        threads = one_slice_defaults()[2]
        await eventually(
            lambda: commands(node)[3:] == [a100, threads], what="the new defaults to be sent"
        )
        assert control_pid(node) == pid  # the same control daemon, not a restart


async def test_a_failed_start_stops_the_daemon_and_still_sends_quit(node: Node) -> None:
    mps_root(node).mkdir()
    (mps_root(node) / "fake-fail-start").touch()
    backend = FakeBackend(node.state_file)
    try:
        daemon = Daemon(node.settings(mps_config(node)), backend)
        with pytest.raises(StartupError, match="cannot start the MPS control daemon"):
            await asyncio.wait_for(daemon.run(asyncio.Event()), 20)
    finally:
        backend.close()
    runs = [r for r in records(node) if r["event"] == "run"]
    assert [r["argv"] for r in runs] == [["-f"], []]
    assert runs[1]["stdin"] == "quit\n"
    assert not node.sim.is_registered("nvidia.com/vgpu")


async def test_defaults_that_cannot_be_set_fail_the_start_and_the_daemon_is_stopped(
    node: Node,
) -> None:
    mps_root(node).mkdir()
    (mps_root(node) / "fake-fail-commands").touch()
    backend = FakeBackend(node.state_file)
    try:
        daemon = Daemon(node.settings(mps_config(node)), backend)
        with pytest.raises(StartupError, match="set_default_device_pinned_mem_limit"):
            await asyncio.wait_for(daemon.run(asyncio.Event()), 30)
    finally:
        backend.close()
    started = [r for r in records(node) if r["event"] == "started"]
    assert len(started) == 1
    # It refused quit too; the control daemon it had started was ended all the same.
    assert commands(node)[-1] == "quit"
    assert not alive(started[0]["pid"])


async def test_a_control_daemon_left_running_is_taken_over(node: Node) -> None:
    """A daemon killed outright (SIGKILL) leaves its control daemon behind: the next one takes it
    over instead of failing on "already running"."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CUDA_MPS_PIPE_DIRECTORY": str(mps_root(node) / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(mps_root(node) / "log"),
    }
    left = await asyncio.create_subprocess_exec(str(FAKE_CONTROL), "-d", env=env)
    assert await left.wait() == 0
    orphan = control_pid(node)
    assert orphan is not None
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)
        assert control_pid(node) == orphan
        assert commands(node) == one_slice_defaults()
        status = daemon.health().mps
        assert status is not None
        assert status.up
        assert status.pid == orphan
    argvs = [r["argv"] for r in records(node) if r["event"] == "run"]
    assert argvs.count(["-d"]) == 1
    assert ["-f"] not in argvs
    assert commands(node)[-1] == "quit"
    assert not alive(orphan)


async def test_serve_sends_quit_on_sigterm(node: Node) -> None:
    config = node.root / "config.yaml"
    config.write_text(
        "enforcement: {pollInterval: 100ms}\n"
        f"mps: {{enabled: true, root: {mps_root(node)}, controlCommand: {FAKE_CONTROL},"
        " protocol: v2}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve", "--config", str(config),
        *serve_args(node),
        "--metrics-address", "127.0.0.1:0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await registered(node, 8)
        pid = control_pid(node)
        assert pid is not None
        # serve makes its own files owner-only (umask 077), but clients of any user must reach
        # the control daemon: its directories and socket are not.
        pipe = mps_root(node) / "pipe"
        assert pipe.stat().st_mode & 0o777 == 0o755
        assert (pipe / "control").stat().st_mode & 0o777 == 0o755
        assert (node.root / "state").stat().st_mode & 0o777 == 0o700
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert commands(node)[-1] == "quit"
    assert not alive(pid)
    assert "MPS control daemon stopped" in err.decode()


async def test_a_reload_starts_moves_and_stops_the_control_daemon(node: Node) -> None:
    """mps.enabled off -> on starts the control daemon with its defaults and hands containers
    its pipe; a new mps.root moves it (the old one gets quit); off again stops it, and new
    containers get no pipe."""
    other = node.root / "mps2"

    def content(enabled: bool, root: Path) -> str:
        return (
            "enforcement:\n  pollInterval: 50ms\n"
            f"mps:\n  enabled: {str(enabled).lower()}\n  root: {root}\n"
            f"  controlCommand: {FAKE_CONTROL}\n  protocol: v2\n"
        )

    def pid_in(root: Path) -> int | None:
        try:
            pid = int((root / "pipe" / PID_FILE).read_text())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    cfg = node.root / "cfg"
    path = configmap(cfg, 1, content(False, mps_root(node)))
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        assert daemon.mps is None
        assert records(node) == []

        configmap(cfg, 2, content(True, mps_root(node)))
        await eventually(lambda: commands(node) == one_slice_defaults(), what="MPS defaults")
        first = control_pid(node)
        assert first is not None
        await eventually(lambda: getattr(daemon.health().mps, "up", False), what="MPS up")
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
        assert grant.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(mps_root(node) / "pipe")

        configmap(cfg, 3, content(True, other))
        await eventually(lambda: pid_in(other) is not None, what="the control daemon moved")
        assert commands(node)[-1] == "quit"
        assert not alive(first)
        grant = (await node.sim.admit_pod("q", [("c", 1)])).containers[0]
        assert grant.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(other / "pipe")

        moved = pid_in(other)
        assert moved is not None
        configmap(cfg, 4, content(False, other))
        await eventually(lambda: not alive(moved), what="the control daemon stopped")
        await eventually(lambda: reloads(daemon, "applied") == 3, what="the reload's end")
        assert daemon.mps is None
        assert daemon.health().mps is None
        grant = (await node.sim.admit_pod("r", [("c", 1)])).containers[0]
        assert "CUDA_MPS_PIPE_DIRECTORY" not in grant.envs
        # Supervision stopped with it: nothing starts it again.
        await asyncio.sleep(0.5)
        assert pid_in(other) is None
