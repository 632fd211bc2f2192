"""The DRA driver's ResourceSlice and registration as an operator sees them (docs/dra.md, "When
the API server refuses the slice"): a slice the API server refuses, or would, is an ERROR line
naming the field, a metric, and /healthz failing after a while; a new set of devices or a reload
publishes at once whatever the backoff; a kubelet that never registers the driver is a WARNING
and /healthz says why."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.app import Daemon
from deviceplugin.dra import publisher
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.kubelet import draplugin
from deviceplugin.reload import read_config
from tests.blackbox.daemon_harness import FAST, Node, dra_frontend, eventually, gpu
from tests.blackbox.test_dra import NODE, _dra, _register, dra_daemon
from tests.blackbox.test_usage import get
from tests.support.fake_apiserver import FakeApiServer

GPU0 = gpu(0, name="NVIDIA A100-PCIE-40GB", memory_gib=40)
# What NVML reports for an L4: 23034Mi, not a multiple of the 256Mi step.
L4 = dataclasses.replace(gpu(1, name="NVIDIA L4", memory_gib=24), memory_total_bytes=23034 << 20)
MEMORY_MIN = "spec.devices[1].capacity[memory].requestPolicy.validRange.min"


@pytest.fixture
def node(short_tmp: Path) -> Node:
    return Node(short_tmp, [GPU0, L4])


def _gauge(daemon: Daemon, name: str) -> dict[str, float]:
    """A gauge's samples by pool, as GET /metrics serves them."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(get(daemon, "/metrics")[1]):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["pool"]] = sample.value
    return found


def _slice_writes(api: FakeApiServer) -> list[tuple[str, str]]:
    return [(m, p) for m, p in api.requests if m in ("POST", "PUT") and "resourceslices" in p]


@contextlib.asynccontextmanager
async def reloading_daemon(node: Node, api: FakeApiServer, config: str) -> AsyncIterator[Daemon]:
    """A DRA daemon that watches its config file (node.root/config.yaml), registered."""
    path = node.root / "config.yaml"
    path.write_text(config)
    loaded = read_config(path)
    settings = dataclasses.replace(
        node.settings(dataclasses.replace(loaded.config, enforcement=FAST)),
        dra=_dra(node, api),
        config_path=path,
        config_hash=loaded.hash,
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        assert settings.dra is not None
        await _register(settings.dra)
        yield daemon
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def test_the_default_policy_publishes_an_l4_of_23034mi(
    node: Node, api: FakeApiServer
) -> None:
    async with dra_daemon(node, api) as daemon:
        await _register(_dra(node, api))
        await eventually(lambda: len(api.slice_list()) == 1, 10, "the slice")
        (l4,) = [d for d in api.slice_list()[0]["spec"]["devices"] if d["name"] == "gpu-1"]
        memory = l4["capacity"]["memory"]
        assert memory["value"] == str(23034 << 20)
        assert memory["requestPolicy"]["validRange"]["max"] == str(22784 << 20)
        await eventually(lambda: _gauge(daemon, "vgpu_dra_resourceslice_published") == {NODE: 1})
        assert _gauge(daemon, "vgpu_dra_resourceslice_refused") == {NODE: 0}


async def test_a_slice_that_breaks_the_api_servers_rules_is_not_sent_and_names_the_field(
    node: Node,
    api: FakeApiServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publisher, "REFUSED_UNHEALTHY_S", 0.5)
    # 30Gi as the least a claim may ask: more than the L4 holds.
    async with reloading_daemon(node, api, "dra: {memory: {min: 30Gi}}\n") as daemon:
        await eventually(lambda: _gauge(daemon, "vgpu_dra_resourceslice_refused") == {NODE: 1})
        assert _gauge(daemon, "vgpu_dra_resourceslice_published") == {NODE: 0}
        assert _slice_writes(api) == []
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        line = next(m for m in errors if MEMORY_MIN in m)
        assert "ResourceSlice not written: the API server would refuse it" in line
        assert "device gpu-1 (NVIDIA L4" in line
        assert "min is larger than capacity value" in line
        assert "dra.memory" in line
        await eventually(lambda: get(daemon, "/healthz")[0] == 503, 10, "/healthz failing")
        body = get(daemon, "/healthz")[1]
        assert "the API server has refused the node's ResourceSlice" in body
        assert MEMORY_MIN in body
        # Retried with backoff, reported once.
        await asyncio.sleep(1.0)
        assert len([m for m in _errors(caplog) if MEMORY_MIN in m]) == 1


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


async def test_a_slice_the_api_server_refuses_fails_healthz_until_it_is_taken(
    node: Node,
    api: FakeApiServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publisher, "REFUSED_UNHEALTHY_S", 0.5)
    refusal = 'ResourceSlice "test-node-vgpu.dev" is invalid: spec.devices[0].name: Invalid value'
    api.refuse_slices = refusal
    async with dra_daemon(node, api) as daemon:
        await _register(_dra(node, api))
        await eventually(lambda: get(daemon, "/healthz")[0] == 503, 10, "/healthz failing")
        assert "spec.devices[0].name: Invalid value" in get(daemon, "/healthz")[1]
        assert _gauge(daemon, "vgpu_dra_resourceslice_refused") == {NODE: 1}
        refused = [m for m in _errors(caplog) if "ResourceSlice refused by the API server" in m]
        assert len(refused) == 1
        assert "status=422" in refused[0]
        assert refusal in refused[0]
        api.refuse_slices = ""
        # Taken at the next try (the backoff is short here).
        await eventually(lambda: len(api.slice_list()) == 1, 15, "the slice taken")
        await eventually(lambda: get(daemon, "/healthz")[0] == 200, 10, "/healthz ok again")
        assert _gauge(daemon, "vgpu_dra_resourceslice_published") == {NODE: 1}


async def test_a_health_change_publishes_at_once_whatever_the_backoff(
    node: Node, api: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first retry an hour away: only a new set of devices can bring the slice sooner.
    monkeypatch.setattr(publisher, "RETRY_FIRST_S", 3600.0)
    api.fail_writes = True
    async with dra_daemon(node, api) as daemon:
        await _register(_dra(node, api))
        dra = dra_frontend(daemon)
        await eventually(lambda: dra.publisher.failures >= 1, 10, "a failed write")
        api.fail_writes = False
        node.write_gpus([dataclasses.replace(GPU0, healthy=False), L4])

        def tainted() -> bool:
            slices = api.slice_list()
            return bool(slices) and "taints" in slices[0]["spec"]["devices"][0]

        await eventually(tainted, 10, "the slice with the unhealthy GPU tainted")


async def test_a_reload_publishes_at_once_whatever_the_backoff(
    node: Node, api: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher, "RETRY_FIRST_S", 3600.0)
    api.fail_writes = True
    async with reloading_daemon(node, api, "dra: {compute: {default: 10}}\n") as daemon:
        dra = dra_frontend(daemon)
        await eventually(lambda: dra.publisher.failures >= 1, 10, "a failed write")
        api.fail_writes = False
        (node.root / "config.yaml").write_text("dra: {compute: {default: 20}}\n")

        def compute_default() -> str:
            slices = api.slice_list()
            if not slices:
                return ""
            device = slices[0]["spec"]["devices"][0]
            return str(device["capacity"]["compute"]["requestPolicy"]["default"])

        await eventually(lambda: compute_default() == "20", 15, "the reloaded policy published")


async def test_a_driver_the_kubelet_never_registers_is_a_warning_and_fails_healthz(
    node: Node,
    api: FakeApiServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(draplugin, "REGISTRATION_WARN_S", 0.3)
    monkeypatch.setattr(draplugin, "UNREGISTERED_UNHEALTHY_S", 0.6)
    settings = _dra(node, api)
    async with dra_daemon(node, api) as daemon:
        # No kubelet finds the registration socket (a wrong --kubelet-root-dir).

        def warned() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.WARNING
                and "has not registered the DRA driver" in r.getMessage()
            ]

        await eventually(lambda: bool(warned()), 10, "the warning")
        assert "--kubelet-root-dir" in warned()[0]
        assert str(settings.registration_socket) in warned()[0]
        await eventually(lambda: get(daemon, "/healthz")[0] == 503, 10, "/healthz failing")
        body = get(daemon, "/healthz")[1]
        assert "the kubelet has not registered the DRA driver" in body
        assert "--kubelet-root-dir" in body
        await _register(settings)
        await eventually(lambda: get(daemon, "/healthz")[0] == 200, 10, "/healthz ok")


def _config_reloads(daemon: Daemon, result: str) -> float | None:
    value: float | None = daemon.metrics.registry.get_sample_value(
        "vgpu_config_reloads_total", {"node": NODE, "result": result}
    )
    return value


def _compute_default(api: FakeApiServer) -> str:
    slices = api.slice_list()
    if not slices:
        return ""
    return str(slices[0]["spec"]["devices"][0]["capacity"]["compute"]["requestPolicy"]["default"])


async def test_a_reload_whose_slice_would_be_refused_is_refused_before_it_is_applied(
    node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with reloading_daemon(node, api, "dra: {compute: {default: 10}}\n") as daemon:
        await eventually(lambda: _compute_default(api) == "10", 10, "the first slice")
        (node.root / "config.yaml").write_text(
            "dra: {memory: {min: 30Gi}, compute: {default: 20}}\n"
        )
        await eventually(lambda: _config_reloads(daemon, "refused") == 1, 10, "the refusal")
        assert _config_reloads(daemon, "applied") == 0
        assert daemon.config.dra.compute_default == 10
        line = next(m for m in _errors(caplog) if MEMORY_MIN in m)
        assert line.startswith("config reload refused: ")
        assert "dra.memory" in line
        # The slice the API server took stays, and stays published.
        await asyncio.sleep(0.5)
        assert _compute_default(api) == "10"
        assert _gauge(daemon, "vgpu_dra_resourceslice_published") == {NODE: 1}


async def test_a_reload_the_api_server_refuses_is_undone_and_not_counted_applied(
    node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with reloading_daemon(node, api, "dra: {compute: {default: 10}}\n") as daemon:
        await eventually(lambda: _compute_default(api) == "10", 10, "the first slice")
        await eventually(lambda: _gauge(daemon, "vgpu_dra_resourceslice_published") == {NODE: 1})
        api.refuse_slices = "spec.devices[0].capacity[compute]: Invalid value: refused by the test"
        (node.root / "config.yaml").write_text("dra: {compute: {default: 20}}\n")
        await eventually(lambda: _config_reloads(daemon, "refused") == 1, 15, "the refusal")
        assert _config_reloads(daemon, "applied") == 0
        assert daemon.config.dra.compute_default == 10
        assert any(
            "the API server refuses the ResourceSlice this config makes" in m
            and "refused by the test" in m
            for m in _errors(caplog)
        )
        api.refuse_slices = ""
        # The running config's slice is the API server's still.
        assert _compute_default(api) == "10"
