"""The exporter's HTTP endpoint on a real socket, and `vgpu-device-plugin status` against it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.httpserver import HttpServer, parse_address
from deviceplugin.usage.metrics import DaemonMetrics
from deviceplugin.usage.statusdoc import snapshot_to_json
from tests.unit.test_metrics import NODE, UNNAMED, sample_snapshot

CLI = [sys.executable, "-m", "deviceplugin"]


class Daemon:
    """What the server reads: the latest snapshot and a health verdict, swapped by the test."""

    def __init__(self) -> None:
        self.snapshot: NodeSnapshot | None = sample_snapshot()
        self.health: tuple[bool, str] = (True, "ok")
        self.metrics = DaemonMetrics(NODE, self.get_snapshot, version="9.9.9")

    def get_snapshot(self) -> NodeSnapshot | None:
        return self.snapshot

    def healthz(self) -> tuple[bool, str]:
        return self.health


@pytest.fixture
def daemon() -> Daemon:
    return Daemon()


@pytest.fixture
def server(daemon: Daemon) -> Iterator[HttpServer]:
    srv = HttpServer("127.0.0.1:0", daemon.metrics, daemon.get_snapshot, daemon.healthz)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def get(server: HttpServer, path: str) -> tuple[int, str, bytes]:
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers["Content-Type"], e.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- routes ----------------------------------------------------------------------------------


def test_metrics_parse(server: HttpServer) -> None:
    status, content_type, body = get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"vgpu_gpu_info", "vgpu_container_gpu_memory_used_bytes", "vgpu_slices"} <= names
    assert f'vgpu_build_info{{node="{NODE}",version="9.9.9"}} 1.0' in body.decode()


def test_metrics_ignores_a_query_string(server: HttpServer) -> None:
    status, _, body = get(server, "/metrics?name[]=vgpu_slices")
    assert status == 200
    assert b"vgpu_slices" in body


def test_metrics_before_the_first_poll(daemon: Daemon, server: HttpServer) -> None:
    daemon.snapshot = None
    status, _, body = get(server, "/metrics")
    assert status == 200
    assert b"vgpu_build_info" in body
    assert b"vgpu_gpu_info" not in body


def test_healthz(daemon: Daemon, server: HttpServer) -> None:
    assert get(server, "/healthz")[::2] == (200, b"ok\n")
    daemon.health = (False, "last successful poll 31.0s ago (limit 10s)")
    status, content_type, body = get(server, "/healthz")
    assert status == 503
    assert content_type.startswith("text/plain")
    assert body == b"last successful poll 31.0s ago (limit 10s)\n"


def test_status_json(daemon: Daemon, server: HttpServer) -> None:
    status, content_type, body = get(server, "/status")
    assert status == 200
    assert content_type == "application/json"
    assert daemon.snapshot is not None
    assert json.loads(body) == json.loads(json.dumps(snapshot_to_json(daemon.snapshot)))


def test_status_before_the_first_poll(daemon: Daemon, server: HttpServer) -> None:
    daemon.snapshot = None
    status, content_type, body = get(server, "/status")
    assert status == 503
    assert content_type == "application/json"
    assert json.loads(body) == {"error": "no poll yet"}


@pytest.mark.parametrize("path", ["/", "/metricsx", "/status/x", "/favicon.ico"])
def test_unknown_path_is_404(server: HttpServer, path: str) -> None:
    assert get(server, path)[0] == 404


def test_concurrent_scrapes_while_snapshots_swap(daemon: Daemon, server: HttpServer) -> None:
    stop = threading.Event()
    snapshots = [sample_snapshot(), sample_snapshot(stale=True, containers=()), None]

    def swap() -> None:
        i = 0
        while not stop.is_set():
            daemon.snapshot = snapshots[i % len(snapshots)]
            i += 1
            time.sleep(0.001)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: get(server, "/metrics"), range(80)))
    finally:
        stop.set()
        swapper.join()
    for status, _, body in results:
        assert status == 200
        list(text_string_to_metric_families(body.decode()))


# --- life cycle and addresses ----------------------------------------------------------------


def test_stop_closes_the_port(daemon: Daemon) -> None:
    srv = HttpServer("127.0.0.1:0", daemon.metrics, daemon.get_snapshot, daemon.healthz)
    srv.start()
    port = srv.port
    assert port > 0
    srv.stop()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    srv.stop()  # a second stop is harmless


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_all_interfaces_means_ipv6_and_ipv4(daemon: Daemon) -> None:
    # ":PORT" must answer on IPv6-only clusters too, where probes and scrapes come over IPv6.
    srv = HttpServer(":0", daemon.metrics, daemon.get_snapshot, daemon.healthz)
    srv.start()
    try:
        for url in (f"http://127.0.0.1:{srv.port}/metrics", f"http://[::1]:{srv.port}/metrics"):
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (loopback)
                assert response.status == 200
    finally:
        srv.stop()


def test_a_taken_port_is_a_clear_error(daemon: Daemon, server: HttpServer) -> None:
    other = HttpServer(
        f"127.0.0.1:{server.port}", daemon.metrics, daemon.get_snapshot, daemon.healthz
    )
    with pytest.raises(OSError, match=f"127.0.0.1:{server.port}"):
        other.start()


@pytest.mark.parametrize(
    ("address", "want"),
    [
        ("127.0.0.1:9410", ("127.0.0.1", 9410)),
        (":9410", ("", 9410)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9410", ("::1", 9410)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),  # noqa: S104
    ],
)
def test_parse_address(address: str, want: tuple[str, int]) -> None:
    assert parse_address(address) == want


@pytest.mark.parametrize("address", ["", "9410", "host:", "host:port", ":70000", "::1:9410"])
def test_bad_address_is_a_value_error_naming_it(daemon: Daemon, address: str) -> None:
    with pytest.raises(ValueError, match="metrics address") as info:
        HttpServer(address, daemon.metrics, daemon.get_snapshot, daemon.healthz)
    assert repr(address) in str(info.value)


# --- `vgpu-device-plugin status` -------------------------------------------------------------


def run_status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run(
        [*CLI, "status", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_status_command_prints_the_view(server: HttpServer) -> None:
    result = run_status("--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"node {NODE}")
    assert any(line.startswith("GPU 0  NVIDIA A100-SXM4-80GB") for line in lines)
    assert any("THROTTLED duty=60%" in line for line in lines)
    assert any(UNNAMED in line for line in lines)
    assert all(len(line) <= 80 for line in lines)


def test_status_command_json(daemon: Daemon, server: HttpServer) -> None:
    result = run_status("--address", f"127.0.0.1:{server.port}", "--json")
    assert result.returncode == 0, result.stderr
    assert daemon.snapshot is not None
    assert json.loads(result.stdout) == json.loads(json.dumps(snapshot_to_json(daemon.snapshot)))


def test_status_command_unreachable_daemon() -> None:
    port = free_port()
    result = run_status("--address", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert result.stdout == ""
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1
    assert f"127.0.0.1:{port}" in err
    assert "--address" in err  # the hint


def test_status_command_before_the_first_poll(daemon: Daemon, server: HttpServer) -> None:
    daemon.snapshot = None
    result = run_status("--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 1
    assert "no poll yet" in result.stderr


def test_status_command_bad_address() -> None:
    result = run_status("--address", "nonsense")
    assert result.returncode == 2
    assert "'nonsense'" in result.stderr


def _watch(server: HttpServer, stdout: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*CLI, "status", "--address", f"127.0.0.1:{server.port}", "--watch", "0.1"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "100"},
    )


def _read_until(fd: int, needle: bytes, count: int) -> bytes:
    seen = b""
    deadline = time.monotonic() + 30
    while seen.count(needle) < count and time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty whose other end closed
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_status_command_watch_refreshes_until_ctrl_c(server: HttpServer) -> None:
    """Into a pipe: one frame after another, no screen codes."""
    proc = _watch(server, subprocess.PIPE)
    assert proc.stdout is not None
    header = f"node {NODE}".encode()
    seen = _read_until(proc.stdout.fileno(), header, 3)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=10)
    assert seen.count(header) >= 3, err
    assert proc.returncode == 0, err
    assert b"\x1b" not in seen + rest
    frame = (seen + rest).decode().split("\n\n" + f"node {NODE}")[0]
    assert frame.startswith(f"node {NODE}")
    assert max(len(line) for line in frame.splitlines()) <= 100


def test_status_command_watch_redraws_in_place_on_a_terminal(server: HttpServer) -> None:
    primary, secondary = pty.openpty()
    proc = _watch(server, secondary)
    os.close(secondary)
    try:
        seen = _read_until(primary, b"\x1b[H\x1b[2J", 3)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        os.close(primary)
    assert seen.count(b"\x1b[H\x1b[2J") >= 3, err
    assert proc.returncode == 0, err
    frame = seen.split(b"\x1b[H\x1b[2J")[1].decode()
    assert frame.startswith(f"node {NODE}")


def test_status_command_watch_exits_cleanly_when_the_reader_goes(server: HttpServer) -> None:
    """`vgpu-device-plugin status --watch | head`: no traceback when head has had enough."""
    proc = _watch(server, subprocess.PIPE)
    assert proc.stdout is not None
    _read_until(proc.stdout.fileno(), f"node {NODE}".encode(), 1)
    proc.stdout.close()
    try:
        proc.wait(timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "BrokenPipe" not in err


def test_status_command_fits_an_80_by_24_terminal(server: HttpServer) -> None:
    """The sample's node takes 24 lines in full: on an 80x24 terminal (the cursor's line left
    free) the compact view shows it, the throttled container first on its GPU."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [*CLI, "status", "--address", f"127.0.0.1:{server.port}"],
        stdout=secondary, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    os.close(secondary)
    try:
        seen = _read_until(primary, b"enforcement actions:", 1)
        seen += _read_until(primary, b"\n", 1)
    finally:
        _, err = proc.communicate(timeout=30)
        os.close(primary)
    assert proc.returncode == 0, err
    lines = seen.decode().replace("\r\n", "\n").rstrip("\n").split("\n")
    assert lines[0].startswith(f"node {NODE}")
    assert len(lines) <= 23
    assert max(len(line) for line in lines) <= 80
    assert lines[3].startswith("  THROTTLED 60% OVER LIMIT team-b/"), lines
