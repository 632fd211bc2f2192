"""What a pod that shares the node's MPS control daemon can try against the root daemon, against
the stand-in for nvidia-cuda-mps-control (tests/support/fake_mps_control.py): a PID written into
the control daemon's PID file, a `quit` or raised defaults sent through the control socket, and a
control program that floods its output or will not exit. The daemon signals only the control
daemon it started or verified, reports what really runs, undoes and counts what was changed, and
stays small and in charge.

Every process these tests signal or kill is one they spawned (a `sleep` standing for a host
process, the fake control daemon in the test's own directory)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.config import Config, MpsConfig, MpsProtocol
from deviceplugin.gpu.mps import PID_FILE
from tests.blackbox.daemon_harness import (
    FAST,
    TWO_GPUS,
    Node,
    eventually,
    registered,
    running_daemon,
)

FAKE_CONTROL = Path(__file__).resolve().parents[1] / "support" / "fake_mps_control.py"


def mps_root(node: Node) -> Path:
    return node.root / "mps"


def mps_config(node: Node, protocol: MpsProtocol = MpsProtocol.V2) -> Config:
    """MPS v2 unless told: the per-slice defaults a pod can try to raise (the fake control
    command offers v3 too; tests/blackbox/test_mps_v3.py has v3's namespaces drifting)."""
    return Config(
        enforcement=FAST,
        mps=MpsConfig(
            enabled=True,
            root=str(mps_root(node)),
            control_command=str(FAKE_CONTROL),
            protocol=protocol,
        ),
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def pid_in_file(node: Node) -> int | None:
    try:
        return int((mps_root(node) / "pipe" / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def as_a_pod(node: Node, *commands: str) -> str:
    """Send commands to the control daemon through its socket, as any MPS client can."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CUDA_MPS_PIPE_DIRECTORY": str(mps_root(node) / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(node.root / "pod-log"),
    }
    done = subprocess.run(
        [str(FAKE_CONTROL)],
        input="".join(f"{c}\n" for c in commands),
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body: bytes = r.read()
    return body.decode()


@pytest.fixture
def host_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing for any host process whose PID a pod could learn."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def no_stray_control_daemon(node: Node) -> Iterator[None]:
    """No fake control daemon of this test outlives it: found by its environment naming this
    test's pipe directory, killed, and the test failed."""
    yield
    pipe = f"CUDA_MPS_PIPE_DIRECTORY={mps_root(node) / 'pipe'}".encode()
    strays = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"fake_mps_control" in cmdline and pipe in environ and alive(int(entry.name)):
            strays.append(int(entry.name))
    for pid in strays:
        os.kill(pid, signal.SIGKILL)
    if strays:
        pytest.fail(f"MPS control daemons {strays} outlived the daemon")


async def test_a_pid_written_into_the_pid_file_is_never_signalled(
    node: Node, host_process: subprocess.Popen[bytes]
) -> None:
    """The pipe directory is the pods': a PID written into the PID file is not the control
    daemon's, neither for /status nor for the signals at stop."""
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS is started before the registration
        assert daemon.mps is not None
        daemon.mps.check_interval_s = 0.05
        control = pid_in_file(node)
        assert control is not None
        (mps_root(node) / "pipe" / PID_FILE).write_text(f"{host_process.pid}\n")
        await asyncio.sleep(0.3)  # several checks
        status = daemon.health().mps
        assert status is not None
        assert status.up
        assert status.pid == control
    # Stopped: the control daemon it started got quit; the host process got nothing.
    assert not alive(control)
    assert host_process.poll() is None
    assert alive(host_process.pid)


async def test_a_quit_from_a_pod_is_a_restart_even_with_a_pid_written_after_it(
    node: Node, host_process: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS is started before the registration
        assert daemon.mps is not None
        assert daemon.http is not None
        first = pid_in_file(node)
        assert first is not None
        as_a_pod(node, "quit")
        (mps_root(node) / "pipe" / PID_FILE).write_text(f"{host_process.pid}\n")

        def restarted() -> bool:
            status = daemon.health().mps
            return status is not None and status.restarts_total == 1 and status.up

        await eventually(restarted, what="the control daemon started again")
        status = daemon.health().mps
        assert status is not None
        assert status.pid not in (first, host_process.pid)
        assert status.pid == pid_in_file(node)
        assert dict(status.drift_total) == {"quit": 1}
        assert "a client sent it quit" in caplog.text
        port = daemon.http.port
        await eventually(
            lambda: 'vgpu_mps_drift_total{change="quit",node="test-node"} 1.0' in metrics(port),
            what="the quit in the metrics",
        )
        # Its defaults are set again on the new control daemon.
        a100 = TWO_GPUS[0].uuid
        assert as_a_pod(node, "get_default_active_thread_percentage").strip() == "25.0"
        assert as_a_pod(node, f"get_default_device_pinned_mem_limit {a100}").strip() == "20480M"
    assert host_process.poll() is None


async def test_defaults_raised_through_the_control_socket_are_set_again_and_counted(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    a100, l4 = TWO_GPUS
    async with running_daemon(node, mps_config(node)) as daemon:
        await registered(node, 8)  # MPS is started before the registration
        assert daemon.mps is not None
        assert daemon.http is not None
        daemon.mps.check_interval_s = 0.05
        control = pid_in_file(node)
        # A pod takes the whole GPU for the next MPS server: all threads, all memory.
        as_a_pod(
            node,
            "set_default_active_thread_percentage 100",
            f"set_default_device_pinned_mem_limit {a100.uuid} 80G",
        )

        def restored() -> bool:
            threads = as_a_pod(node, "get_default_active_thread_percentage").strip()
            memory = as_a_pod(node, f"get_default_device_pinned_mem_limit {a100.uuid}").strip()
            return threads == "25.0" and memory == "20480M"

        await eventually(restored, what="the defaults set again")
        assert as_a_pod(node, f"get_default_device_pinned_mem_limit {l4.uuid}").strip() == "6144M"
        status = daemon.health().mps
        assert status is not None
        assert dict(status.drift_total) == {"active_thread_percentage": 1, "pinned_mem_limit": 1}
        assert status.restarts_total == 0
        assert status.pid == control
        assert f"found={a100.uuid}=80G restored={a100.uuid}=20480M" in caplog.text
        assert "found=100.0 restored=25" in caplog.text
        port = daemon.http.port
        memory = 'vgpu_mps_drift_total{change="pinned_mem_limit",node="test-node"} 1.0'
        threads = 'vgpu_mps_drift_total{change="active_thread_percentage",node="test-node"} 1.0'
        await eventually(
            lambda: memory in metrics(port) and threads in metrics(port),
            what="both drifts in the metrics",
        )


def test_a_control_command_that_floods_its_output_is_cut_off(short_tmp: Path) -> None:
    """400 MiB printed by the control command cost the daemon its size in memory; now it is cut
    off after a bounded read, and the command counts as failed."""
    root = short_tmp / "mps"
    (root / "pipe").mkdir(parents=True)
    (root / "fake-flood").touch()
    script = f"""
import json, time
from deviceplugin.config import MpsConfig
from deviceplugin.gpu.mps import MpsCommandError, MpsControlDaemon
mps = MpsControlDaemon(MpsConfig(enabled=True, root={str(root)!r},
                                 control_command={str(FAKE_CONTROL)!r}))
start = time.monotonic()
try:
    mps.send("get_server_list")
    error = ""
except MpsCommandError as e:
    error = str(e)
# VmHWM: this process's own peak (ru_maxrss also counts the parent's at exec).
peak = next(int(line.split()[1]) for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print(json.dumps({{"error": error, "seconds": time.monotonic() - start, "maxrss_kib": peak}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "printed more than 64 KiB" in seen["error"]
    assert seen["maxrss_kib"] < 100 * 1024, seen
    assert seen["seconds"] < 5, seen


async def test_a_control_daemon_that_ignores_quit_and_sigterm_is_killed(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    mps_root(node).mkdir()
    (mps_root(node) / "fake-ignore-quit").touch()
    (mps_root(node) / "fake-ignore-sigterm").touch()
    async with running_daemon(node, mps_config(node)):
        await registered(node, 8)
        control = pid_in_file(node)
        assert control is not None
    assert not alive(control)
    assert "sending SIGKILL" in caplog.text


@pytest.mark.parametrize("protocol", [MpsProtocol.V2, MpsProtocol.V3])
async def test_pods_get_the_pipe_directory_read_only(node: Node, protocol: MpsProtocol) -> None:
    """A pod cannot write the PID file, plant a socket or a symlink in the pipe directory: it is
    mounted read-only (connecting to a socket needs no write access to the mount); under MPS v3
    only its namespace's directory is, never the node's pipe directory; /dev/shm, where clients
    and the MPS server exchange data, stays writable."""
    async with running_daemon(node, mps_config(node, protocol)):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
    pipe = str(mps_root(node) / "pipe")
    directory = grant.envs["CUDA_MPS_PIPE_DIRECTORY"]
    assert (directory, directory, True) in grant.mounts
    if protocol is MpsProtocol.V2:
        assert directory == pipe
    else:
        assert directory.startswith(pipe + "/")
        assert not any(host == pipe for _, host, _ in grant.mounts)
    assert ("/dev/shm", str(mps_root(node) / "shm"), False) in grant.mounts
