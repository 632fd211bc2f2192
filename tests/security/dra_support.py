"""The DRA driver as the security suite drives it: a daemon of its own process (what it stalls
on, and what it logs, are seen from outside, as the kubelet and an operator see them), and the
kubelet's calls with several claims at once."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from deviceplugin._proto.dra.v1 import api_pb2 as dra_v1
from deviceplugin._proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from deviceplugin.dra.settings import DraSettings
from tests.blackbox.daemon_harness import Node, eventually, serve_args
from tests.blackbox.test_dra import NODE, RPC_TIMEOUT_S, _dra, _register
from tests.support.fake_apiserver import FakeApiServer

CLI = [sys.executable, "-m", "deviceplugin"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving_dra(node: Node, api: FakeApiServer) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`serve --kubelet-api dra` as a process of its own on the node; yields it and its metrics
    port. Its log goes to node.root/serve.log."""
    settings = _dra(node, api)
    port = free_port()
    log = (node.root / "serve.log").open("wb")
    args = [
        *CLI, "serve", *serve_args(node),
        "--kubelet-api", "dra", "--node-name", NODE,
        "--kubeconfig", str(settings.kubeconfig),
        "--kubelet-root-dir", str(settings.kubelet_root_dir),
        "--cdi-dir", str(settings.cdi_dir),
        "--metrics-address", f"127.0.0.1:{port}",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
    try:
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def register(settings: DraSettings) -> None:
    """Register a daemon of its own process as the kubelet does, once its registration socket
    is there (a new process on a busy machine takes a while). The socket may be there a moment
    before it listens (gRPC binds it before it serves): a refused connection is tried again."""
    await eventually(settings.registration_socket.exists, 60, "the registration socket")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        try:
            await _register(settings)
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline:
                raise
        await asyncio.sleep(0.1)


def healthz(port: int) -> int:
    """The status of GET /healthz; raises when no answer comes within a probe's timeout."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status
    finally:
        connection.close()


def healthy(port: int) -> bool:
    try:
        return healthz(port) == 200
    except OSError:
        return False


def ref(uid: str, name: str | None = None, namespace: str = "default") -> Any:
    return dra_v1.Claim(namespace=namespace, uid=uid, name=name or f"claim-{uid}")


async def prepare_all(socket: Path, refs: list[Any], timeout_s: float = RPC_TIMEOUT_S) -> Any:
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        return await dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(
            dra_v1.NodePrepareResourcesRequest(claims=refs), timeout=timeout_s
        )


async def unprepare_all(socket: Path, refs: list[Any]) -> Any:
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        return await dra_v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
            dra_v1.NodeUnprepareResourcesRequest(claims=refs), timeout=RPC_TIMEOUT_S
        )
