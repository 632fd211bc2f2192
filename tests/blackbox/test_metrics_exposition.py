"""/metrics as Prometheus meets it: the format it asks for, gzip, counters at zero, and HTTPS
with a test certificate authority made here (openssl)."""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as parse_text

from deviceplugin.gpu.fake import FakeState, write_state_file
from deviceplugin.usage.httpserver import HttpServer, TlsFiles
from tests.blackbox.daemon_harness import TWO_GPUS
from tests.blackbox.test_httpserver import Daemon
from tests.unit.test_metrics import NAMED_A, sample_snapshot

# What Prometheus 2.x and 3.x send by default (scrape_protocols without the protobuf format).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
CLI = [sys.executable, "-m", "deviceplugin"]


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


def request(
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    if context is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# --- negotiation ------------------------------------------------------------------------------


def test_a_plain_scrape_gets_the_text_format_without_created_series(server: HttpServer) -> None:
    status, headers, body = request(server.port, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "Content-Encoding" not in headers
    text = body.decode()
    names = {s.name for f in parse_text(text) for s in f.samples}
    assert "vgpu_allocate_duration_seconds_count" in names
    assert "vgpu_gpu_utilization_ratio" in names
    assert not [n for n in names if n.endswith("_created")]


def test_prometheus_gets_openmetrics(server: HttpServer) -> None:
    status, headers, body = request(server.port, "/metrics", {"Accept": PROMETHEUS_ACCEPT})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in parse_om(text)}
    # OpenMetrics names a counter family without _total and carries it on the sample.
    enforcement = families["vgpu_enforcement_actions"]
    assert enforcement.type == "counter"
    assert {s.name for s in enforcement.samples} == {"vgpu_enforcement_actions_total"}
    assert families["vgpu_allocate_duration_seconds"].type == "histogram"


def test_a_text_scrape_that_names_its_version_gets_text(server: HttpServer) -> None:
    _, headers, body = request(server.port, "/metrics", {"Accept": "text/plain;version=0.0.4"})
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert not body.decode().endswith("# EOF\n")


@pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT])
def test_gzip_when_accepted(server: HttpServer, accept: str) -> None:
    _, plain_headers, plain = request(server.port, "/metrics", {"Accept": accept})
    status, headers, body = request(
        server.port, "/metrics", {"Accept": accept, "Accept-Encoding": "gzip"}
    )
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"] == plain_headers["Content-Type"]
    assert int(headers["Content-Length"]) == len(body) < len(plain)
    unzipped = gzip.decompress(body).decode()
    # Same families (the age gauge moves between the two scrapes).
    assert [f.name for f in parse_any(unzipped)] == [f.name for f in parse_any(plain.decode())]


def parse_om(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))  # type: ignore[no-untyped-call]


def parse_any(text: str) -> list[Metric]:
    return list(parse_om(text) if text.endswith("# EOF\n") else parse_text(text))


# --- counters at zero --------------------------------------------------------------------------


def test_every_container_has_its_enforcement_counters_at_zero_from_the_start(
    daemon: Daemon, server: HttpServer
) -> None:
    daemon.snapshot = dataclasses.replace(sample_snapshot(containers=(NAMED_A,)), enforcement=())
    _, _, body = request(server.port, "/metrics")
    samples = [
        s
        for f in parse_text(body.decode())
        for s in f.samples
        if s.name == "vgpu_enforcement_actions_total"
    ]
    got = {(s.labels["kind"], s.labels["action"]): s.value for s in samples}
    assert got == {
        ("memory", "kill"): 0.0,
        ("memory", "monitor"): 0.0,
        ("memory", "reclaim"): 0.0,
        ("compute", "throttle"): 0.0,
        ("compute", "monitor"): 0.0,
    }
    for s in samples:
        assert s.labels["pod"] == NAMED_A.pod
        assert s.labels["allocation_id"] == NAMED_A.allocation_id


def test_a_counted_action_is_exposed_once_beside_the_zeroes(
    daemon: Daemon, server: HttpServer
) -> None:
    _, _, body = request(server.port, "/metrics")
    over = [
        s
        for f in parse_text(body.decode())
        for s in f.samples
        if s.name == "vgpu_enforcement_actions_total"
        and s.labels["container"] == "server"
        and s.labels["kind"] == "memory"
        and s.labels["action"] == "kill"
    ]
    assert [s.value for s in over] == [2.0]


# --- TLS ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(name: str, d: Path) -> None:
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt",
        cwd=d,
    )  # fmt: skip


def make_leaf(name: str, ca: str, extensions: str, d: Path) -> None:
    (d / f"{name}.ext").write_text(extensions)
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
        "-keyout", f"{name}.key", "-out", f"{name}.csr",
        cwd=d,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: it makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    make_ca("ca", d)
    make_ca("stranger-ca", d)
    make_leaf("server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", d)
    make_leaf("client", "ca", "extendedKeyUsage=clientAuth\n", d)
    make_leaf("stranger", "stranger-ca", "extendedKeyUsage=clientAuth\n", d)
    return Pki(
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "stranger.crt",
        d / "stranger.key",
    )


def client_context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


@pytest.fixture
def tls_server(daemon: Daemon, pki: Pki, request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    client_ca = pki.ca if getattr(request, "param", False) else None
    srv = HttpServer(
        "127.0.0.1:0",
        daemon.metrics,
        daemon.get_snapshot,
        daemon.healthz,
        tls=TlsFiles(pki.cert, pki.key, client_ca),
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_https_serves_metrics_with_the_certificate(pki: Pki, tls_server: HttpServer) -> None:
    status, headers, body = request(
        tls_server.port,
        "/metrics",
        {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
        context=client_context(pki),
    )
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body).decode().endswith("# EOF\n")
    # A client that does not trust the CA refuses the server.
    with pytest.raises(ssl.SSLCertVerificationError):
        request(tls_server.port, "/metrics", context=ssl.create_default_context())


def test_https_does_not_answer_plain_http(tls_server: HttpServer) -> None:
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        request(tls_server.port, "/metrics")


@pytest.mark.parametrize("tls_server", [True], indirect=True)
def test_a_client_ca_requires_a_client_certificate_but_for_healthz(
    pki: Pki, tls_server: HttpServer
) -> None:
    anonymous = client_context(pki)
    status, _, body = request(tls_server.port, "/metrics", context=anonymous)
    assert status == 403
    assert b"client certificate" in body
    assert request(tls_server.port, "/status", context=anonymous)[0] == 403
    # The kubelet's probes present no certificate.
    assert request(tls_server.port, "/healthz", context=anonymous)[:1] == (200,)

    known = client_context(pki, pki.client_cert, pki.client_key)
    status, _, body = request(tls_server.port, "/metrics", context=known)
    assert status == 200
    assert b"vgpu_build_info" in body

    stranger = client_context(pki, pki.stranger_cert, pki.stranger_key)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        request(tls_server.port, "/metrics", context=stranger)


# --- `vgpu-device-plugin status` over HTTPS -------------------------------------------------------


def status_over(
    port: int, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "status", "--address", f"https://127.0.0.1:{port}", *flags],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "80", **(env or {})},
    )  # fmt: skip


def test_status_reads_an_https_daemon_trusting_its_ca(pki: Pki, tls_server: HttpServer) -> None:
    result = status_over(tls_server.port, "--ca-file", str(pki.ca))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("node ")


def test_status_in_the_daemons_pod_trusts_the_daemons_own_certificate(
    pki: Pki, tls_server: HttpServer
) -> None:
    # Inside the pod the daemon's certificate is in VGPU_METRICS_TLS_CERT; its CA is not there.
    # The address needs no https:// either: the variable says the daemon serves TLS.
    result = subprocess.run(
        [*CLI, "status", "--address", f"127.0.0.1:{tls_server.port}", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "VGPU_METRICS_TLS_CERT": str(pki.cert)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["node"]


def test_status_refuses_a_daemon_it_cannot_verify_and_says_how_to_trust_it(
    pki: Pki, tls_server: HttpServer
) -> None:
    result = status_over(tls_server.port)  # the system's CAs: none signed the test certificate
    assert result.returncode == 1
    assert "over TLS" in result.stderr
    assert "--ca-file" in result.stderr
    # A certificate from another CA is no better.
    result = status_over(tls_server.port, env={"VGPU_METRICS_TLS_CERT": str(pki.stranger_cert)})
    assert result.returncode == 1
    assert "over TLS" in result.stderr


@pytest.mark.parametrize("tls_server", [True], indirect=True)
def test_status_presents_a_client_certificate_when_the_daemon_requires_one(
    pki: Pki, tls_server: HttpServer
) -> None:
    result = status_over(tls_server.port, "--ca-file", str(pki.ca))
    assert result.returncode == 1
    assert "HTTP 403" in result.stderr
    assert "--client-cert" in result.stderr
    result = status_over(
        tls_server.port, "--ca-file", str(pki.ca),
        "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("node ")
    result = status_over(tls_server.port, "--client-cert", str(pki.client_cert))
    assert result.returncode == 2
    assert "--client-key" in result.stderr


# --- the command line --------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--metrics-tls-cert", "/x.crt"], "--metrics-tls-key"),
        (["--metrics-tls-key", "/x.key"], "--metrics-tls-cert"),
        (["--metrics-client-ca", "/ca.crt"], "--metrics-tls-cert"),
    ],
)
def test_incomplete_tls_flags_exit_2_saying_what_is_missing(
    short_tmp: Path, flags: list[str], says: str
) -> None:
    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    result = run_cli("serve", "--backend", f"fake:{state}", *flags)
    assert result.returncode == 2
    assert says in result.stderr


def test_an_unreadable_certificate_exits_2_naming_it(short_tmp: Path, pki: Pki) -> None:
    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    missing = short_tmp / "missing.crt"
    result = run_cli(
        "serve",
        "--backend",
        f"fake:{state}",
        "--device-plugin-dir",
        str(short_tmp / "dp"),
        "--state-dir",
        str(short_tmp / "state"),
        "--metrics-address",
        "127.0.0.1:0",
        "--metrics-tls-cert",
        str(missing),
        "--metrics-tls-key",
        str(pki.key),
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "--metrics-tls-cert" in result.stderr
