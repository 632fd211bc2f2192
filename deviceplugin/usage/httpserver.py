"""The exporter's HTTP endpoint: /metrics, /healthz and /status, on a thread of its own.

Every request reads the latest snapshot reference and nothing else: no GPU backend call, no lock
shared with the poll loop. The snapshot is immutable, so a request sees one consistent poll.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.exposition import gzip_accepted

from deviceplugin.errors import StartupError
from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.metrics import DaemonMetrics
from deviceplugin.usage.statusdoc import snapshot_to_json

log = logging.getLogger(__name__)

_SAFETY_POLL_INTERVAL_S = 60.0
# A connection that sends nothing for this long is closed (a half-sent request, or a TLS
# handshake that stalls, must not hold a thread for ever); at most this many connections are
# served at once, the rest are closed at once. Prometheus, the probes and `status` need a handful.
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64

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
    only a client that presents a certificate it signed; /healthz answers every client, since
    the kubelet's probes present none."""

    cert: Path
    key: Path
    client_ca: Path | None = None


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
    _slots: threading.BoundedSemaphore | None = None
    refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to `max_connections`; past that the connection is
        closed at once (counted in `refused`)."""
        if self._slots is None:
            self._slots = threading.BoundedSemaphore(self.max_connections)
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning(
                    "http connections over the cap; closing new ones limit=%d refused=%d",
                    self.max_connections,
                    self.refused,
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            if self._slots is not None:
                self._slots.release()

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
    """Serves GET (and HEAD) /metrics, /healthz and /status on a daemon thread; `stop()` ends
    and joins it."""

    def __init__(
        self,
        address: str,
        metrics: DaemonMetrics,
        get_snapshot: Callable[[], NodeSnapshot | None],
        healthz: Callable[[], tuple[bool, str]],
        *,
        tls: TlsFiles | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.address = address
        self.tls = tls
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._host, self._port = parse_address(address)
        self._metrics = metrics
        self._get_snapshot = get_snapshot
        self._healthz = healthz
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

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
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            # No timer while no request comes: stop() wakes the select by shutting the
            # listening socket down; the long interval is only a safety net.
            kwargs={"poll_interval": _SAFETY_POLL_INTERVAL_S},
            name="vgpu-http",
            daemon=True,
        )
        self._thread.start()
        log.info(
            "http listening address=%s port=%d tls=%s client_ca=%s",
            self.address,
            self.port,
            "on" if self.tls else "off",
            self.tls.client_ca if self.tls and self.tls.client_ca else "none",
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
                if not self._client_allowed():
                    status, content_type, body = (
                        HTTPStatus.FORBIDDEN,
                        TEXT_TYPE,
                        b"a client certificate signed by the metrics client CA is required\n",
                    )
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
            if gzip_accepted(self.headers.get("Accept-Encoding", "")):
                body = gzip.compress(body)
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def _client_allowed(self) -> bool:
            """Without a client CA, every client; with one, /healthz for every client and the
            rest for those whose certificate the handshake verified against it."""
            if owner.tls is None or owner.tls.client_ca is None:
                return True
            if self.path.split("?", 1)[0] == "/healthz":
                return True
            connection = self.connection
            return isinstance(connection, ssl.SSLSocket) and bool(connection.getpeercert())

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http %s %s", self.address_string(), format % args)

    return Handler
