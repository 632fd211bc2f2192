"""What a careless operator can do to `serve` and `status`: two daemons on one node, relative
paths, a state directory or fake state file that other users can write, a /status of another
shape. Each gets a clear message and the right exit code, never a traceback."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.blackbox.daemon_harness import Node, registered, serve_args

CLI = [sys.executable, "-m", "deviceplugin"]


async def start_serve(
    node: Node, *args: str, cwd: Path | None = None
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *CLI, "serve", *args,
        "--metrics-address", "",
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def stop(proc: asyncio.subprocess.Process, *, terminate: bool = True) -> tuple[int, str]:
    """Its exit code and stderr; SIGTERM first when `terminate`, else wait for it to exit."""
    if terminate and proc.returncode is None:
        proc.terminate()
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_a_second_daemon_on_the_same_state_dir_exits_2_naming_the_first(
    node: Node,
) -> None:
    first = await start_serve(node, *serve_args(node))
    try:
        await registered(node, 8)
        second = await start_serve(node, *serve_args(node))
        code, err = await stop(second, terminate=False)
        assert code == 2, err
        assert f"pid {first.pid}" in err
        assert "Traceback" not in err
        # The first one was left alone: still registered, its socket still there.
        await asyncio.sleep(0.5)
        assert node.sim.is_registered("nvidia.com/vgpu")
        assert node.plugin_socket().exists()
    finally:
        code, err = await stop(first)
    assert code == 0, err


async def test_relative_paths_are_resolved_at_the_edge(node: Node) -> None:
    proc = await start_serve(
        node,
        "--backend", f"fake:{node.state_file.name}",
        "--device-plugin-dir", node.plugin_dir.name,
        "--pod-resources-socket", str(node.podres_socket.relative_to(node.root)),
        "--state-dir", "state",
        cwd=node.root,
    )  # fmt: skip
    try:
        await registered(node, 8)
    finally:
        code, err = await stop(proc)
    assert code == 0, err
    assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is on ownership by another user too")
async def test_a_state_dir_that_others_can_write_is_refused(node: Node) -> None:
    state = node.root / "state"
    state.mkdir()
    state.chmod(0o777)
    proc = await start_serve(node, *serve_args(node))
    code, err = await stop(proc, terminate=False)
    assert code == 2
    assert str(state) in err
    assert "other users" in err


async def test_a_fake_state_file_that_others_can_write_is_refused(node: Node) -> None:
    node.state_file.chmod(0o666)
    proc = await start_serve(node, *serve_args(node))
    code, err = await stop(proc, terminate=False)
    assert code == 2
    assert str(node.state_file) in err
    assert "other users" in err


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def odd_status() -> Iterator[tuple[int, type[_Answer]]]:
    class Answer(_Answer):
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], Answer
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "doc",
    [
        {"gpus": "not a list"},
        {"node": {"x": 1}, "gpus": [1, 2]},
        {"gpus": [{"slices": 5}]},
        {"containers": [1]},
    ],
)
async def test_status_with_an_unexpected_document_gives_a_clear_error(
    odd_status: tuple[int, type[_Answer]], doc: object
) -> None:
    port, handler = odd_status
    handler.body = json.dumps(doc).encode()
    proc = await asyncio.create_subprocess_exec(
        *CLI, "status", "--address", f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 1
    assert "Traceback" not in text
    assert "shape" in text
