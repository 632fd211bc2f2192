"""The HTTP endpoints against clients that are slow, far away or not the ones meant: slow clients
never keep the kubelet's probes out, /status names no process or pod to a network scraper, and a
client CA can be narrowed to named clients. Real daemons, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.usage.httpserver import MAX_CONNECTIONS, HttpServer, TlsFiles
from deviceplugin.usage.metrics import DaemonMetrics
from tests.blackbox.daemon_harness import Node, registered, serve_args
from tests.blackbox.test_metrics_exposition import make_ca, make_leaf
from tests.unit.test_metrics import sample_snapshot

CLI = [sys.executable, "-m", "deviceplugin"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(
    host: str, port: int, path: str, context: ssl.SSLContext | None = None, timeout: float = 3
) -> tuple[int, bytes]:
    if context is None:
        connection: http.client.HTTPConnection = http.client.HTTPConnection(
            host, port, timeout=timeout
        )
    else:
        connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def answers(host: str, port: int, path: str = "/healthz") -> bool:
    """Whether an HTTP answer (any status) comes back within the kubelet's probe timeout."""
    try:
        get(host, port, path)
    except (OSError, http.client.HTTPException):
        return False
    return True


class SlowClients:
    """`count` connections that each send one more byte of a request every `every_s` seconds,
    never finishing it: the slow client that holds a connection for ever. One the server
    closes is opened again, as an attacker would."""

    def __init__(self, port: int, count: int, every_s: float) -> None:
        self.port = port
        self.stop = threading.Event()
        self.sockets = [self._open() for _ in range(count)]
        self.thread = threading.Thread(target=self._trickle, args=(every_s,), daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.sendall(b"G")
        except OSError:
            return None
        return s

    def _trickle(self, every_s: float) -> None:
        while not self.stop.wait(every_s):
            for i, s in enumerate(self.sockets):
                try:
                    if s is None:
                        raise ConnectionError
                    s.sendall(b"E")
                except OSError:
                    if s is not None:
                        s.close()
                    self.sockets[i] = self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.sockets:
            if s is not None:
                s.close()


@contextlib.contextmanager
def serving(
    node: Node, *flags: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [*CLI, "serve", *serve_args(node), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_serving(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while not answers("127.0.0.1", port):
        assert proc.poll() is None, "the daemon exited"
        assert time.monotonic() < deadline, "the daemon never served"
        time.sleep(0.1)


# --- slow clients and the probes ---------------------------------------------------------------


async def test_slow_clients_never_keep_the_kubelets_probes_out(node: Node) -> None:
    metrics_port, probe_port = free_port(), free_port()
    with serving(
        node,
        "--metrics-address", f"127.0.0.1:{metrics_port}",
        "--probe-address", f"127.0.0.1:{probe_port}",
    ) as proc:  # fmt: skip
        await registered(node, 8)
        # Off the event loop: the kubelet simulator keeps serving the daemon meanwhile.
        await asyncio.to_thread(probes_answer_through_slow_clients, proc, metrics_port, probe_port)


def probes_answer_through_slow_clients(
    proc: subprocess.Popen[bytes], metrics_port: int, probe_port: int
) -> None:
    wait_until_serving(probe_port, proc)
    # More slow clients than the metrics listener serves at once, each sending a byte well
    # within its read timeout, so that none is ever timed out.
    slow = SlowClients(metrics_port, MAX_CONNECTIONS + 16, every_s=2.0)
    try:
        time.sleep(1.2)
        for _ in range(6):  # the kubelet's probes, for longer than a slow client's period
            assert get("127.0.0.1", probe_port, "/healthz")[0] == 200
            # The metrics listener's own /healthz, and a scrape, are answered too: the slow
            # clients' oldest connections make room.
            assert get("127.0.0.1", metrics_port, "/healthz")[0] == 200
            assert get("127.0.0.1", metrics_port, "/metrics")[0] == 200
            time.sleep(0.5)
    finally:
        slow.close()
    # The probe listener serves nothing else.
    assert get("127.0.0.1", probe_port, "/status")[0] == 404
    assert get("127.0.0.1", probe_port, "/metrics")[0] == 404


@pytest.mark.parametrize("probes_only", [True, False], ids=["probe-listener", "metrics-listener"])
def test_slow_clients_on_the_listener_itself_never_keep_a_probe_out(probes_only: bool) -> None:
    flags = {"probes_only": True} if probes_only else {}
    probes = HttpServer(
        "127.0.0.1:0",
        DaemonMetrics("n", lambda: None, version="test"),
        lambda: None,
        lambda: (True, ""),
        **flags,  # type: ignore[arg-type]
    )
    probes.start()
    try:
        # As many slow clients as the listener serves at once (the cap), from one address.
        slow = SlowClients(probes.port, MAX_CONNECTIONS, every_s=1.0)
        try:
            time.sleep(1.2)  # the slow connections are old enough to give way
            for _ in range(8):  # for longer than a slow client's period
                assert get("127.0.0.1", probes.port, "/healthz") == (200, b"ok\n")
                time.sleep(0.3)
        finally:
            slow.close()
    finally:
        probes.stop()


# --- /status is not for the network --------------------------------------------------------------


def non_loopback_address() -> str:
    """An IPv4 address of this machine that is not the loopback; skips the test when none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
            address = str(s.getsockname()[0])
        except OSError:
            address = ""
    if not address or address.startswith("127.") or address == "0.0.0.0":  # noqa: S104
        pytest.skip("this machine has no address but the loopback")
    return address


async def test_status_is_answered_on_the_loopback_but_not_to_a_network_scraper(
    node: Node,
) -> None:
    address = non_loopback_address()
    port = free_port()
    with serving(node, "--metrics-address", f":{port}") as proc:
        await registered(node, 8)
        await asyncio.to_thread(status_only_on_the_loopback, proc, address, port)


def status_only_on_the_loopback(proc: subprocess.Popen[bytes], address: str, port: int) -> None:
    wait_until_serving(port, proc)
    deadline = time.monotonic() + 10
    while (local := get("127.0.0.1", port, "/status"))[0] != 200:
        assert time.monotonic() < deadline, local
        time.sleep(0.1)
    assert "gpus" in json.loads(local[1])
    status, body = get(address, port, "/status")
    assert status == 403
    assert b"loopback" in body  # says where it is served
    assert b"pid" not in body
    # /metrics keeps its labels for the network, and /healthz answers every client.
    status, body = get(address, port, "/metrics")
    assert status == 200
    assert b"vgpu_gpu_info" in body
    assert get(address, port, "/healthz")[0] == 200


def test_status_through_the_status_command_on_the_loopback() -> None:
    """`vgpu-device-plugin status` in the daemon's pod reaches it on the loopback, as before."""
    snapshot = sample_snapshot()
    server = HttpServer(
        ":0",
        DaemonMetrics("node-a", lambda: snapshot, version="test"),
        lambda: snapshot,
        lambda: (True, ""),
    )
    server.start()
    try:
        result = subprocess.run(
            [*CLI, "status", "--address", f":{server.port}", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["containers"]
        address = non_loopback_address()
        result = subprocess.run(
            [*CLI, "status", "--address", f"{address}:{server.port}"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 1
        assert "HTTP 403" in result.stderr
        assert "loopback" in result.stderr
    finally:
        server.stop()


# --- client certificates narrowed to named clients -------------------------------------------


@pytest.fixture(scope="module")
def named_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: it makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    make_ca("ca", d)
    make_leaf("server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", d)
    # Prometheus's client certificate, named in its SAN; another by its common name only.
    make_leaf("prometheus", "ca", "subjectAltName=DNS:prometheus.monitoring.svc\n", d)
    make_leaf("scraper", "ca", "extendedKeyUsage=clientAuth\n", d)
    # Another node's own certificate from the same CA (no extended key usage: any purpose, as
    # cert-manager issues by default): signed by the CA, but no scraper.
    make_leaf("node-b", "ca", "subjectAltName=DNS:node-b,IP:10.0.0.2\n", d)
    return d


def client(d: Path, name: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(d / "ca.crt"))
    if name is not None:
        context.load_cert_chain(d / f"{name}.crt", d / f"{name}.key")
    return context


def test_client_names_narrow_the_client_ca_to_the_clients_named(named_pki: Path) -> None:
    d = named_pki
    server = HttpServer(
        "127.0.0.1:0",
        DaemonMetrics("n", lambda: None, version="test"),
        lambda: None,
        lambda: (True, ""),
        tls=TlsFiles(
            d / "server.crt",
            d / "server.key",
            d / "ca.crt",
            frozenset({"prometheus.monitoring.svc", "scraper"}),
        ),
    )
    server.start()
    try:
        port = server.port
        assert get("127.0.0.1", port, "/metrics", client(d, "prometheus"))[0] == 200
        assert get("127.0.0.1", port, "/metrics", client(d, "scraper"))[0] == 200
        status, body = get("127.0.0.1", port, "/metrics", client(d, "node-b"))
        assert status == 403
        assert b"--metrics-client-names" in body
        assert get("127.0.0.1", port, "/status", client(d, "node-b"))[0] == 403
        assert get("127.0.0.1", port, "/metrics", client(d, None))[0] == 403
        # The kubelet's probes still need no certificate.
        assert get("127.0.0.1", port, "/healthz", client(d, None))[0] == 200
    finally:
        server.stop()


async def test_serve_takes_client_names_and_refuses_them_without_a_client_ca(
    node: Node, named_pki: Path
) -> None:
    d = named_pki
    tls = ["--metrics-tls-cert", str(d / "server.crt"), "--metrics-tls-key", str(d / "server.key")]
    result = await asyncio.to_thread(
        subprocess.run,
        [*CLI, "serve", *serve_args(node), *tls, "--metrics-client-names", "prometheus"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--metrics-client-names needs --metrics-client-ca" in result.stderr

    port = free_port()
    with serving(
        node, "--metrics-address", f"127.0.0.1:{port}", *tls,
        "--metrics-client-ca", str(d / "ca.crt"),
        env={"VGPU_METRICS_CLIENT_NAMES": "prometheus.monitoring.svc"},
    ) as proc:  # fmt: skip
        await registered(node, 8)
        await asyncio.to_thread(only_named_clients, proc, port, d)


def only_named_clients(proc: subprocess.Popen[bytes], port: int, d: Path) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            status, _ = get("127.0.0.1", port, "/metrics", client(d, "prometheus"))
            break
        except (OSError, http.client.HTTPException):
            assert proc.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, "the daemon never served"
            time.sleep(0.1)
    assert status == 200
    assert get("127.0.0.1", port, "/metrics", client(d, "node-b"))[0] == 403
