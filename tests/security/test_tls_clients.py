"""Who the HTTP endpoints answer over TLS. With a client CA, only a client certificate that CA
vouches for, now, for client use, reaches /metrics and /status: none, another CA's, an expired
one, and a server-only one (another node's serving certificate) are refused. Without a client
CA, TLS or not, /status stays on the loopback whatever certificate or header a network client
presents. Real listeners on real sockets."""

from __future__ import annotations

import http.client
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.usage.httpserver import HttpServer, TlsFiles
from deviceplugin.usage.metrics import DaemonMetrics
from tests.blackbox.test_metrics_exposition import make_ca, make_leaf, openssl
from tests.security.test_http_access import get, non_loopback_address
from tests.unit.test_metrics import sample_snapshot


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: it makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    make_ca("ca", d)
    make_ca("other-ca", d)
    make_leaf("server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", d)
    make_leaf("client", "ca", "extendedKeyUsage=clientAuth\n", d)
    make_leaf("foreign", "other-ca", "extendedKeyUsage=clientAuth\n", d)
    # Another node's serving certificate, from the same CA: for servers only.
    make_leaf("node-b", "ca", "subjectAltName=DNS:node-b\nextendedKeyUsage=serverAuth\n", d)
    expired_leaf("expired", "ca", d)
    return d


def expired_leaf(name: str, ca: str, d: Path) -> None:
    """A client certificate the CA signed for one day in 2020."""
    (d / f"{name}.ext").write_text("extendedKeyUsage=clientAuth\n")
    (d / "ca.cnf").write_text(
        "[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\nserial = serial\n"
        "new_certs_dir = .\ndefault_md = sha256\npolicy = anything\n"
        "[anything]\ncommonName = supplied\n"
    )
    (d / "index.txt").write_text("")
    (d / "serial").write_text("1000\n")
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
        "-keyout", f"{name}.key", "-out", f"{name}.csr",
        cwd=d,
    )  # fmt: skip
    openssl(
        "ca", "-batch", "-config", "ca.cnf", "-cert", f"{ca}.crt", "-keyfile", f"{ca}.key",
        "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
        "-extfile", f"{name}.ext", "-in", f"{name}.csr", "-out", f"{name}.crt", "-notext",
        cwd=d,
    )  # fmt: skip


def client(d: Path, name: str | None, *, by_address: bool = False) -> ssl.SSLContext:
    """A client trusting the test CA, presenting `name`'s certificate (none for None); with
    `by_address`, one reaching the server by an address its certificate does not name."""
    context = ssl.create_default_context(cafile=str(d / "ca.crt"))
    context.check_hostname = not by_address
    if name is not None:
        context.load_cert_chain(d / f"{name}.crt", d / f"{name}.key")
    return context


@pytest.fixture
def serving(pki: Path, request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    """An HTTPS listener on every address, with the client CA when the test asks for it."""
    snapshot = sample_snapshot()
    client_ca = pki / "ca.crt" if getattr(request, "param", False) else None
    server = HttpServer(
        ":0",
        DaemonMetrics("node-a", lambda: snapshot, version="test"),
        lambda: snapshot,
        lambda: (True, ""),
        tls=TlsFiles(pki / "server.crt", pki / "server.key", client_ca),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def refused_at_the_handshake(port: int, context: ssl.SSLContext) -> bool:
    try:
        get("127.0.0.1", port, "/metrics", context)
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return True
    return False


@pytest.mark.parametrize("serving", [True], indirect=True)
def test_with_a_client_ca_only_a_current_client_certificate_of_that_ca_gets_in(
    pki: Path, serving: HttpServer
) -> None:
    port = serving.port
    assert get("127.0.0.1", port, "/metrics", client(pki, "client"))[0] == 200
    assert get("127.0.0.1", port, "/status", client(pki, "client"))[0] == 200
    # No certificate: the probe's /healthz only.
    assert get("127.0.0.1", port, "/metrics", client(pki, None))[0] == 403
    assert get("127.0.0.1", port, "/status", client(pki, None))[0] == 403
    assert get("127.0.0.1", port, "/healthz", client(pki, None))[0] == 200
    # Another CA's, an expired one, a server-only one: refused before any request is read.
    for name in ("foreign", "expired", "node-b"):
        assert refused_at_the_handshake(port, client(pki, name)), name
    # The listener serves on after each refusal.
    assert get("127.0.0.1", port, "/metrics", client(pki, "client"))[0] == 200


def test_without_a_client_ca_status_over_tls_stays_on_the_loopback(
    pki: Path, serving: HttpServer
) -> None:
    """No client CA: a certificate proves nothing (none is verified), and no header makes a
    network client the loopback. /metrics and /healthz answer every client."""
    address = non_loopback_address()
    port = serving.port
    assert get("127.0.0.1", port, "/status", client(pki, None))[0] == 200
    for name in (None, "client", "foreign", "node-b"):
        status, body = get(address, port, "/status", client(pki, name, by_address=True))
        assert status == 403, name
        assert b"loopback" in body
        assert b"pid" not in body
    for header in ("X-Forwarded-For", "X-Real-IP", "Forwarded"):
        context = client(pki, None, by_address=True)
        connection = http.client.HTTPSConnection(address, port, timeout=3, context=context)
        try:
            value = "for=127.0.0.1" if header == "Forwarded" else "127.0.0.1"
            connection.request("GET", "/status", headers={header: value, "Host": "localhost"})
            response = connection.getresponse()
            assert response.status == 403, header
            response.read()
        finally:
            connection.close()
    assert get(address, port, "/metrics", client(pki, None, by_address=True))[0] == 200
    assert get(address, port, "/healthz", client(pki, None, by_address=True))[0] == 200
