"""The exporter's HTTP endpoints, each on a thread of its own: /metrics, /healthz and /status on
the metrics address, and /healthz alone on the probe address, so that no client of the one can
keep the kubelet's probes from the other.

Every request reads the latest snapshot reference and nothing else: no GPU backend call, no lock
shared with the poll loop. The snapshot is immutable, so a request sees one consistent poll.

/status names host PIDs, pods and allocation IDs: it is answered only to a client on this
machine's loopback (the `status` command in the daemon's pod), or, with a client CA, to a client
whose certificate passed it, like /metrics.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import ipaddress
import json
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from deviceplugin.errors import StartupError
from deviceplugin.logs import brief_list
from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.statusdoc import snapshot_to_json

log = logging.getLogger(__name__)

_SAFETY_POLL_INTERVAL_S = 60.0
# A connection that sends nothing for this long is closed (a half-sent request, or a TLS
# handshake that stalls, must not hold a thread for ever); at most this many connections are
# served at once, and at most PER_CLIENT_CONNECTIONS from one client address. Prometheus, the
# probes and `status` need a handful. A new connection is never refused for a slow one: past a
# client's own share its oldest connection is closed; past the cap, the oldest connection open
# for at least EVICTABLE_AFTER_S (no answer takes that long); only when every connection is
# younger is the new one closed.
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
PER_CLIENT_CONNECTIONS = 16
EVICTABLE_AFTER_S = 1.0

JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain; charset=utf-8"


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port", ":port" (all interfaces) or "[v6addr]:port" as (host, port); ValueError
    naming the address when it is none of these."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an unbracketed IPv6 address: refused below
        sep = ""
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(
            f"metrics address {address!r} is not HOST:PORT, :PORT or [IPV6]:PORT (port 0-65535)"
        )
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """HTTPS for the endpoint: the server's certificate chain and key (PEM), and optionally the
    CA that client certificates must chain to. With a client CA, /metrics and /status answer
    only a client that presents a certificate it signed, and with `client_names` only one whose
    certificate names one of them (a DNS or URI subject alternative name, or the common name);
    /healthz answers every client, since the kubelet's probes present none."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    client_names: frozenset[str] = frozenset()


class MetricsExposition(Protocol):
    """What /metrics renders (a DaemonMetrics): prometheus_client is imported only by the
    first scrape or by whoever makes it, not with this server, which the daemon starts before
    its first registration."""

    def render(self, accept: str = "") -> tuple[bytes, str]: ...


def certificate_names(cert: Any) -> set[str]:
    """The names a peer certificate (as `SSLSocket.getpeercert()` gives it) carries: its DNS and
    URI subject alternative names and its common names."""
    if not isinstance(cert, dict):
        return set()
    names = {str(value) for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")}
    for rdn in cert.get("subject", ()):
        names.update(str(value) for key, value in rdn if key == "commonName")
    return names


def is_loopback(host: str) -> bool:
    """Whether a peer address is this machine's loopback (IPv4, IPv6, or IPv4 mapped in IPv6)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def tls_context(tls: TlsFiles) -> ssl.SSLContext:
    """A server context for `tls`; StartupError naming the file at fault."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(
            f"cannot load the metrics TLS certificate {tls.cert} with the key {tls.key}: {e}; "
            "set --metrics-tls-cert and --metrics-tls-key to a PEM certificate and its key"
        ) from e
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except (OSError, ssl.SSLError) as e:
            raise StartupError(
                f"cannot load the metrics client CA {tls.client_ca}: {e}; "
                "set --metrics-client-ca to a PEM file of CA certificates"
            ) from e
        # Optional at the handshake, required by the routes that need it (see TlsFiles).
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Rebinding right after a restart of the daemon must not wait for TIME_WAIT.
    allow_reuse_address = True
    max_connections = MAX_CONNECTIONS
    per_client = PER_CLIENT_CONNECTIONS
    evictable_after_s = EVICTABLE_AFTER_S
    refused = 0
    evicted = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Each open connection: its client address and when it was accepted, oldest first.
        self._open: dict[Any, tuple[str, float]] = {}
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def server_bind(self) -> None:
        # The bind alone: HTTPServer's also asks DNS for the host's fully qualified name (a
        # reverse lookup, seconds where the node's DNS is not up yet, before the daemon
        # registers) for `server_name`, which nothing here reads.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection. Past a client's share or the cap, an older connection
        makes room (see EVICTABLE_AFTER_S); when none can, the new one is closed at once
        (counted in `refused`)."""
        client = str(client_address[0])
        with self._open_lock:
            if not self._make_room(client, time.monotonic()):
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning(
                        "http connections over the cap; closing new ones limit=%d refused=%d",
                        self.max_connections,
                        self.refused,
                    )
                self.shutdown_request(request)
                return
            self._open[request] = (client, time.monotonic())
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def _make_room(self, client: str, now: float) -> bool:
        """Under the lock: close connections until `client` may open one more; False when it
        may not (every connection is young)."""
        own = [c for c, (owner, _) in self._open.items() if owner == client]
        if len(own) >= self.per_client:
            self._evict(own[0], "over the client's share", client)  # oldest first (insertion)
        if len(self._open) < self.max_connections:
            return True
        for connection, (owner, opened) in self._open.items():
            if now - opened >= self.evictable_after_s:
                self._evict(connection, "over the cap", owner)
                return True
        return False

    def _evict(self, connection: Any, why: str, client: str) -> None:
        del self._open[connection]
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:
            log.warning(
                "http closing an older connection to make room (%s) client=%s evicted=%d",
                why,
                client,
                self.evicted,
            )
        # The socket's own shutdown, not TLS's: this thread must not touch the TLS state the
        # connection's thread is using. Its blocked read then ends, and so does its thread.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(connection, socket.SHUT_RDWR)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that fails its TLS handshake (plain HTTP, an unknown certificate) or goes
        away is a line in the log, not a traceback on stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, ssl.SSLError):
            log.info("http tls handshake failed client=%s error=%s", client_address[0], error)
        elif isinstance(error, OSError):
            log.debug("http connection failed client=%s error=%s", client_address[0], error)
        else:
            super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DualStack(_Server6):
    """All interfaces, IPv6 and IPv4 alike: what ":PORT" means, so that probes and scrapes on
    an IPv6-only cluster reach the daemon too."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class HttpServer:
    """Serves GET (and HEAD) /metrics, /healthz and /status on a daemon thread (with
    `probes_only`, /healthz alone: the kubelet's probes' own listener); `stop()` ends and joins
    it."""

    def __init__(
        self,
        address: str,
        metrics: MetricsExposition,
        get_snapshot: Callable[[], NodeSnapshot | None],
        healthz: Callable[[], tuple[bool, str]],
        *,
        tls: TlsFiles | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        per_client_connections: int = PER_CLIENT_CONNECTIONS,
        probes_only: bool = False,
    ) -> None:
        self.address = address
        self.tls = tls
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.per_client_connections = per_client_connections
        self.probes_only = probes_only
        self._host, self._port = parse_address(address)
        self._metrics = metrics
        self._get_snapshot = get_snapshot
        self._healthz = healthz
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def evicted(self) -> int:
        """Connections closed to make room for newer ones (slow or idle clients)."""
        return self._server.evicted if self._server is not None else 0

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one for ":0") once started, else the configured one."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    def start(self) -> None:
        """Bind and serve. OSError (e.g. the port is taken) propagates, naming the address."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        handler = _make_handler(self)
        context = tls_context(self.tls) if self.tls is not None else None
        try:
            server = self._bind(handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {self.address!r}: {e.strerror}") from e
        if context is not None:
            # The handshake happens on the request's thread, at its first read, under the
            # connection's read timeout and within the connection cap: a slow client holds its
            # own thread, never the accepting one.
            server.socket = context.wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False
            )
        server.max_connections = self.max_connections
        server.per_client = self.per_client_connections
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            # No timer while no request comes: stop() wakes the select by shutting the
            # listening socket down; the long interval is only a safety net.
            kwargs={"poll_interval": _SAFETY_POLL_INTERVAL_S},
            name="vgpu-probes" if self.probes_only else "vgpu-http",
            daemon=True,
        )
        self._thread.start()
        log.info(
            "http listening address=%s port=%d serves=%s tls=%s client_ca=%s client_names=%s",
            self.address,
            self.port,
            "/healthz" if self.probes_only else "/metrics,/status,/healthz",
            "on" if self.tls else "off",
            self.tls.client_ca if self.tls and self.tls.client_ca else "none",
            ",".join(sorted(self.tls.client_names))
            if self.tls and self.tls.client_names
            else "any",
        )

    def _bind(self, handler: type[BaseHTTPRequestHandler]) -> _Server:
        if ":" in self._host:
            return _Server6((self._host, self._port), handler)
        if self._host == "" and socket.has_ipv6:
            try:
                return _DualStack(("::", self._port), handler)
            except OSError as e:
                if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    raise
                log.debug("no IPv6 on this node; listening on IPv4 only error=%s", e)
        return _Server((self._host, self._port), handler)

    def stop(self) -> None:
        """Stop serving and join the thread; requests in flight finish on their own threads."""
        server, thread = self._server, self._thread
        if server is None:
            return
        # shutdown() waits for serve_forever to notice; the socket's shutdown wakes its select.
        stopper = threading.Thread(target=server.shutdown, name="vgpu-http-stop", daemon=True)
        stopper.start()
        with contextlib.suppress(OSError):
            server.socket.shutdown(socket.SHUT_RDWR)
        stopper.join()
        server.server_close()
        if thread is not None:
            thread.join()
        self._server = self._thread = None
        log.info("http stopped address=%s", self.address)

    # --- routes, called on the request's thread --------------------------------------------

    def route(self, path: str, accept: str = "") -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path` with this Accept header."""
        path = path.split("?", 1)[0]
        if self.probes_only and path != "/healthz":
            return HTTPStatus.NOT_FOUND, TEXT_TYPE, b"not found: this address serves /healthz\n"
        if path == "/metrics":
            payload, content_type = self._metrics.render(accept)
            return HTTPStatus.OK, content_type, payload
        if path == "/healthz":
            ok, reason = self._healthz()
            if ok:
                return HTTPStatus.OK, TEXT_TYPE, b"ok\n"
            return HTTPStatus.SERVICE_UNAVAILABLE, TEXT_TYPE, f"{reason}\n".encode()
        if path == "/status":
            snapshot = self._get_snapshot()
            if snapshot is None:
                return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "no poll yet"})
            return _json(HTTPStatus.OK, snapshot_to_json(snapshot))
        return HTTPStatus.NOT_FOUND, TEXT_TYPE, b"not found: try /metrics, /healthz, /status\n"


def _gzip_accepted(accept_encoding: str) -> bool:
    from prometheus_client.exposition import gzip_accepted  # noqa: PLC0415 (see MetricsExposition)

    return bool(gzip_accepted(accept_encoding))


def _json(status: int, doc: Any) -> tuple[int, str, bytes]:
    return status, JSON_TYPE, (json.dumps(doc, allow_nan=False) + "\n").encode()


def _make_handler(owner: HttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "vgpu"
        protocol_version = "HTTP/1.1"
        timeout = owner.read_timeout_s  # per connection, on every read

        def do_HEAD(self) -> None:  # the name http.server dispatches to
            self.do_GET(with_body=False)

        def do_GET(self, *, with_body: bool = True) -> None:
            status: int
            try:
                refusal = self._refusal()
                if refusal:
                    status, content_type, body = HTTPStatus.FORBIDDEN, TEXT_TYPE, refusal
                else:
                    status, content_type, body = owner.route(
                        self.path, self.headers.get("Accept", "")
                    )
            except Exception:  # a broken route answers 500; serving goes on
                log.exception("http request failed path=%s", self.path)
                status, content_type, body = (
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    TEXT_TYPE,
                    b"internal error\n",
                )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if _gzip_accepted(self.headers.get("Accept-Encoding", "")):
                body = gzip.compress(body)
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def _refusal(self) -> bytes:
            """Why this client may not have this path, or b"" when it may. /healthz: every
            client. With a client CA: the rest only for a client whose certificate the handshake
            verified against it (and that names one of `client_names`, when given). Without
            one: /metrics for every client, /status only from the loopback."""
            path = self.path.split("?", 1)[0]
            if path == "/healthz" or owner.probes_only:
                return b""
            tls = owner.tls
            if tls is None or tls.client_ca is None:
                if path != "/status" or is_loopback(str(self.client_address[0])):
                    return b""
                return (
                    b"/status names host PIDs, pods and allocation IDs: it is answered on the "
                    b"loopback (vgpu-device-plugin status in the daemon's pod), or over TLS to a "
                    b"client certificate (--metrics-client-ca)\n"
                )
            connection = self.connection
            cert = connection.getpeercert() if isinstance(connection, ssl.SSLSocket) else None
            if not cert:
                return b"a client certificate signed by the metrics client CA is required\n"
            if tls.client_names and not certificate_names(cert) & tls.client_names:
                log.info(
                    "http client refused: its certificate names none of the allowed clients "
                    "client=%s names=%s",
                    self.client_address[0],
                    brief_list(sorted(certificate_names(cert))),
                )
                return b"this client certificate is not one of --metrics-client-names\n"
            return b""

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http %s %s", self.address_string(), format % args)

    return Handler
