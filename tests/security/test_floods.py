"""Floods and forged input from outside: half-sent HTTP requests must not hold a thread each, a
device ID with a newline must not forge a log line, and a 100k-ID Allocate must not write a
megabyte line (nor get a megabyte error back)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from deviceplugin.kubelet.proto import dp, dp_grpc
from deviceplugin.usage.httpserver import HttpServer
from deviceplugin.usage.metrics import DaemonMetrics
from tests.blackbox.daemon_harness import Node, registered, serve_args

CLI = [sys.executable, "-m", "deviceplugin"]


@pytest.fixture
def server() -> Iterator[HttpServer]:
    http_server = HttpServer(
        "127.0.0.1:0",
        DaemonMetrics("n", lambda: None, version="test"),
        lambda: None,
        lambda: (True, ""),
        read_timeout_s=0.5,
        max_connections=16,
    )
    http_server.start()
    try:
        yield http_server
    finally:
        http_server.stop()


def get(server: HttpServer, method: str = "GET", path: str = "/healthz") -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_half_sent_requests_hold_no_thread_for_long(server: HttpServer) -> None:
    threads_before = threading.active_count()
    sockets: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            sockets.append(s)
        time.sleep(0.2)
        # At most the cap, not one thread per connection (300 before).
        assert threading.active_count() <= threads_before + 16 + 2
        # Each is closed by the server once its read times out; then requests are served again.
        deadline = time.monotonic() + 5
        while True:
            try:
                status, _ = get(server)
                break
            except (ConnectionError, http.client.HTTPException):
                assert time.monotonic() < deadline, "the endpoint never served again"
                time.sleep(0.1)
        assert status == 200
        sockets[0].settimeout(5)
        assert sockets[0].recv(4096) == b""  # closed by the server
    finally:
        for s in sockets:
            s.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before + 1:
        assert time.monotonic() < deadline, "connection threads left behind"
        time.sleep(0.05)


def test_head_is_answered_without_a_body(server: HttpServer) -> None:
    assert get(server, "HEAD", "/healthz") == (200, b"")
    assert get(server, "HEAD", "/metrics") == (200, b"")
    assert get(server, "GET", "/healthz") == (200, b"ok\n")


async def allocate(node: Node, ids: list[str]) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"unix:{node.plugin_socket()}") as channel:
        stub = dp_grpc.DevicePluginStub(channel)
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Allocate(request, timeout=30)
    return caught.value


async def test_forged_and_flooding_device_ids_stay_on_one_short_log_line(node: Node) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "serve", *serve_args(node), "--metrics-address", "",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await registered(node, 8)
        forged = "x\n2030-01-01T00:00:00.000Z ERROR deviceplugin FORGED kill pid=1"
        error = await allocate(node, [forged])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        flood = [f"GPU-flood-{n:08d}::0" for n in range(100_000)]
        error = await allocate(node, flood)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(error.details() or "") < 5000
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    lines = err.decode().splitlines()
    assert all("allocate refused" in line for line in lines if "FORGED" in line)
    assert not any(line.startswith("2030-01-01") for line in lines)
    refused = [line for line in lines if "allocate refused" in line]
    assert len(refused) == 2
    assert max(len(line) for line in lines) < 5000
    assert "(100000 in all)" in refused[1]
