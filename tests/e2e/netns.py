"""Talking to servers inside the cluster's network namespace from the test process.

The cluster listens only on the loopback of its own network namespace. A socket belongs to the
network namespace of the thread that created it, so a short-lived thread enters the namespace
(setns on that thread only), creates and connects the socket, and hands it back: the test
process keeps its own namespace, and the socket works from any thread afterwards."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def connect_in_netns(netns: Path, address: tuple[str, int], timeout: float) -> socket.socket:
    """A TCP socket connected to `address` as seen inside the network namespace `netns`
    (a /proc/PID/ns/net path)."""
    result: list[socket.socket] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(socket.create_connection(address, timeout=timeout))
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            error.append(exc)

    thread = threading.Thread(target=work, name="netns-connect")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, netns: Path, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._netns = netns

    def connect(self) -> None:
        self.sock = connect_in_netns(self._netns, (self.host, self.port), self.timeout or 10.0)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(
        self, netns: Path, host: str, port: int, timeout: float, context: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._netns = netns
        self._tls = context

    def connect(self) -> None:
        raw = connect_in_netns(self._netns, (self.host, self.port), self.timeout or 10.0)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


def http_get(netns: Path, port: int, path: str, *, timeout: float = 10.0) -> tuple[int, bytes]:
    """GET http://127.0.0.1:PORT/PATH inside the namespace: (status, body)."""
    conn = _HTTPConnection(netns, "127.0.0.1", port, timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]!r}")
        self.status = status
        self.body = body


class ApiClient:
    """The Kubernetes API server over HTTPS with a client certificate; JSON in and out. One
    connection kept open, re-made when it breaks."""

    def __init__(
        self, netns: Path, port: int, *, ca: Path, cert: Path, key: Path, timeout: float = 15.0
    ) -> None:
        self._netns = netns
        self._port = port
        self._timeout = timeout
        self._context = ssl.create_default_context(cafile=str(ca))
        self._context.load_cert_chain(str(cert), str(key))
        self._conn: _HTTPSConnection | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def raw(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        with self._lock:
            for attempt in (0, 1):
                if self._conn is None:
                    self._conn = _HTTPSConnection(
                        self._netns, "127.0.0.1", self._port, self._timeout, self._context
                    )
                try:
                    self._conn.request(method, path, body=data, headers=headers)
                    response = self._conn.getresponse()
                    return response.status, response.read()
                except (OSError, http.client.HTTPException):
                    self._conn.close()
                    self._conn = None
                    if attempt == 1:
                        raise
        raise AssertionError("unreachable")

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
    ) -> Any:
        status, data = self.raw(method, path, body, content_type)
        if status >= 300:
            raise ApiError(status, method, path, data)
        return json.loads(data) if data else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: object) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str, body: object = None) -> Any:
        return self.request("DELETE", path, body)

    def patch(self, path: str, body: object) -> Any:
        return self.request("PATCH", path, body, "application/merge-patch+json")
