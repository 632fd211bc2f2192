"""Per-node configs chosen by the node label `nvidia.com/device-plugin.config`, read over real
HTTP from a small fake Kubernetes API server that grants only what the chart's RBAC grants: `get`
on nodes. Every other request is answered 403, and the tests check none was made."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deviceplugin.app import Daemon
from deviceplugin.errors import ConfigError, StartupError
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.nodeconfig import NODE_LABEL, NodeConfig, NodeConfigRules
from deviceplugin.reload import read_config
from tests.blackbox.daemon_harness import RESOURCE, Node, registered
from tests.blackbox.test_cli import CLI, run_cli

NODE = "test-node"


class FakeApiServer:
    """GET /api/v1/nodes/NAME for the nodes it holds (404 for others); 403 for anything else."""

    def __init__(self) -> None:
        self.labels: dict[str, dict[str, str]] = {}
        self.requests: list[tuple[str, str]] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}
                    ],
                    "users": [{"name": "daemon", "user": {"token": "not-a-secret"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "daemon"}}
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, target, _ = request_line.decode().split(" ", 2)
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                self.requests.append((method, target))
                status, body = self._answer(method, target.split("?", 1)[0])
                payload = json.dumps(body).encode()
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def _answer(self, method: str, path: str) -> tuple[str, dict[str, object]]:
        prefix = "/api/v1/nodes/"
        if method == "GET" and path.startswith(prefix) and "/" not in path[len(prefix) :]:
            name = path[len(prefix) :]
            if name in self.labels:
                node: dict[str, object] = {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": dict(self.labels[name])},
                }
                return "200 OK", node
            return "404 Not Found", status(404, "NotFound", f'nodes "{name}" not found')
        return "403 Forbidden", status(403, "Forbidden", f"{method} {path} is forbidden")


def status(code: int, reason: str, message: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def configmap(root: Path, version: int, files: dict[str, str]) -> Path:
    """Write `files` as the kubelet writes a ConfigMap volume (a timestamped directory, `..data`
    swapped to it, one symlink per key). Returns the volume's directory."""
    root.mkdir(exist_ok=True)
    target = root / f"..2026_12_01_00_00_0{version}.000000000"
    target.mkdir()
    for name, content in files.items():
        (target / name).write_text(content)
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.rename(tmp, root / "..data")
    for name in files:
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")
    return root


NVIDIA_GPU = "nvidia.com/gpu"
FAST = "enforcement:\n  pollInterval: 50ms\n"
CONFIGS = {
    "default": FAST + "slicing:\n  replicas: 2\n",
    "eight": FAST + "slicing:\n  replicas: 8\n",
    # NVIDIA's own format: time-slicing of nvidia.com/gpu, 3 per GPU.
    "nvidia-three": (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "      - name: nvidia.com/gpu\n        replicas: 3\n"
    ),
}


def node_config(api: FakeApiServer, directory: Path, **rules: object) -> NodeConfig:
    return NodeConfig(
        NodeConfigRules(directory, **rules),  # type: ignore[arg-type]
        NODE,
        kubeconfig=str(api.kubeconfig(directory.parent)),
        interval_s=0.1,
    )


def only_gets_of_the_node(api: FakeApiServer) -> None:
    assert api.requests, "no request reached the API server"
    assert set(api.requests) == {("GET", f"/api/v1/nodes/{NODE}")}, api.requests


async def test_the_label_names_the_config_at_start(api: FakeApiServer, tmp_path: Path) -> None:
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    api.labels[NODE] = {NODE_LABEL: "eight", "kubernetes.io/hostname": NODE}
    chosen = await node_config(api, directory).initial()
    assert chosen == directory / "eight"
    only_gets_of_the_node(api)


@pytest.mark.parametrize(
    ("labels", "rules", "expected"),
    [
        ({}, {}, "default"),  # fallback `named`
        ({}, {"default": "eight"}, "eight"),
        ({NODE_LABEL: ""}, {"default": "nvidia-three"}, "nvidia-three"),
        ({}, {"fallback": ("empty",)}, None),
    ],
)
async def test_without_the_label_the_default_then_the_fallbacks(
    api: FakeApiServer,
    tmp_path: Path,
    labels: dict[str, str],
    rules: dict[str, object],
    expected: str | None,
) -> None:
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    api.labels[NODE] = labels
    chosen = await node_config(api, directory, **rules).initial()
    assert chosen == (None if expected is None else directory / expected)


async def test_the_single_fallback_takes_the_only_config(
    api: FakeApiServer, tmp_path: Path
) -> None:
    directory = configmap(tmp_path / "cfg", 1, {"only": CONFIGS["eight"]})
    api.labels[NODE] = {}
    assert await node_config(api, directory).initial() == directory / "only"
    # `named` alone finds no config named default: an error that says what to do.
    with pytest.raises(ConfigError) as refused:
        await node_config(api, directory, fallback=("named",)).initial()
    (problem,) = refused.value.problems
    assert f"no label {NODE_LABEL}" in problem
    assert "only" in problem
    assert "add a config named 'default'" in problem


async def test_a_label_that_names_no_config_is_an_error_naming_the_configs(
    api: FakeApiServer, tmp_path: Path
) -> None:
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    api.labels[NODE] = {NODE_LABEL: "sixteen"}
    with pytest.raises(ConfigError) as refused:
        await node_config(api, directory).initial()
    (problem,) = refused.value.problems
    assert f"{NODE_LABEL}=sixteen names no config" in problem
    assert "default, eight, nvidia-three" in problem


async def test_an_unknown_node_or_no_api_server_stops_the_start(
    api: FakeApiServer, tmp_path: Path
) -> None:
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    with pytest.raises(StartupError, match="needs `get` on nodes"):
        await node_config(api, directory).initial()
    config = node_config(api, directory)
    await api.stop()
    with pytest.raises(StartupError, match="cannot reach the Kubernetes API"):
        await config.initial()


async def test_a_label_change_switches_the_running_daemon_live(
    api: FakeApiServer, node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """With pods admitted all along: 2 slices per GPU, then 8 when the label says `eight`,
    then NVIDIA's file (3 per GPU); a label naming no config is refused and the running config
    kept; removing the label goes back to the default."""
    caplog.set_level(logging.INFO)
    directory = configmap(node.root / "cfg", 1, CONFIGS)
    api.labels[NODE] = {}
    watcher = node_config(api, directory)
    path = await watcher.initial()
    assert path is not None
    loaded = read_config(path)
    settings = dataclasses.replace(
        node.settings(loaded.config),
        config_path=path,
        config_hash=loaded.hash,
        node_config=watcher,
        node_name=NODE,
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend, pod_resources_interval_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, asyncio.Event()))
    try:
        await registered(node, 4)  # 2 GPUs x 2
        api.labels[NODE] = {NODE_LABEL: "eight"}
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids(RESOURCE)) == 16)
        api.labels[NODE] = {NODE_LABEL: "nvidia-three"}
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids(NVIDIA_GPU)) == 6)

        api.labels[NODE] = {NODE_LABEL: "sixteen"}
        await wait_until(lambda: reloads(daemon, "refused") == 1)
        assert "sixteen names no config" in caplog.text
        await asyncio.sleep(0.5)  # the label stays: refused once, not at every read
        assert reloads(daemon, "refused") == 1
        assert len(node.sim.healthy_ids(NVIDIA_GPU)) == 6

        api.labels[NODE] = {}
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids(RESOURCE)) == 4)
        assert reloads(daemon, "applied") == 3
        assert not task.done(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()
    only_gets_of_the_node(api)


def reloads(daemon: Daemon, result: str) -> float:
    value = daemon.metrics.registry.get_sample_value(
        "vgpu_config_reloads_total", {"node": NODE, "result": result}
    )
    return value or 0.0


async def wait_until(condition: object, timeout_s: float = 10.0) -> None:
    assert callable(condition)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_serve_refuses_config_and_config_dir_together(tmp_path: Path) -> None:
    result = run_cli("serve", "--config", str(tmp_path / "c.yaml"), "--config-dir", str(tmp_path))
    assert result.returncode == 2
    assert "--config and --config-dir exclude each other" in result.stderr


async def test_serve_picks_the_labelled_config_and_says_why_it_cannot_start(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """The command line end to end: a label naming no config stops `serve` with exit 2."""
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    api.labels[NODE] = {NODE_LABEL: "sixteen"}
    process = await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        "--config-dir",
        str(directory),
        "--node-name",
        NODE,
        "--kubeconfig",
        str(api.kubeconfig(tmp_path)),
        "--backend",
        "fake:/nonexistent",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2, stderr.decode()
    assert "sixteen names no config" in stderr.decode()


async def test_outside_a_pod_without_a_kubeconfig_the_start_says_what_to_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    directory = configmap(tmp_path / "cfg", 1, CONFIGS)
    with pytest.raises(StartupError, match="automountServiceAccountToken"):
        await NodeConfig(NodeConfigRules(directory), NODE).initial()
