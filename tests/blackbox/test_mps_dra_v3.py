"""MPS v3 in DRA mode, on the fake control command and a fake API server: NodePrepareResources
makes the claim's namespace, capped at what it consumed, before it writes the claim's CDI spec,
which mounts only that namespace's directory; NodeUnprepareResources lets it go."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import Config, MpsConfig
from tests.blackbox.daemon_harness import FAST, Node, dra_frontend, eventually
from tests.blackbox.test_dra import (
    GPU0,
    GPU1,
    _claim,
    _dra,
    _env,
    _prepare,
    _register,
    _spec,
    _unprepare,
    dra_daemon,
)
from tests.blackbox.test_mps import mps_root, no_stray_control_daemon  # noqa: F401
from tests.blackbox.test_mps_daemon_v3 import CANARY, caps, mps_of, namespaces
from tests.support.fake_apiserver import FakeApiServer
from tests.support.fake_mps.client import FAKE_CONTROL


@pytest.fixture
def node(short_tmp: Path) -> Node:
    return Node(short_tmp, [GPU0, GPU1])


@contextlib.asynccontextmanager
async def dra_mps_daemon(node: Node, api: FakeApiServer) -> AsyncIterator[Daemon]:
    config = Config(
        enforcement=FAST,
        mps=MpsConfig(
            enabled=True,
            root=str(mps_root(node)),
            control_command=str(FAKE_CONTROL),
            canary_command=CANARY,
        ),
    )
    dra = _dra(node, api)
    async with dra_daemon(node, api, dra=dra, config=config) as daemon:
        await _register(dra)
        await eventually(lambda: dra_frontend(daemon).registered, what="the registration")
        mps_of(daemon).check_interval_s = 0.05
        daemon.mps_part.release_grace_s = 0.0
        yield daemon


def mounts(spec: Path) -> list[dict[str, Any]]:
    doc = json.loads(spec.read_text())
    found: list[dict[str, Any]] = doc["devices"][0]["containerEdits"]["mounts"]
    return found


async def test_a_claim_gets_its_own_namespace_before_its_spec_and_loses_it_once_unprepared(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_mps_daemon(node, api) as daemon:
        assert mps_of(daemon).protocol == 3
        api.put_claim(_claim("u-15", "15Gi", "30"))
        api.put_claim(_claim("u-5", "5Gi", "10"))
        assert (await _prepare(settings.service_socket, "u-15")).error == ""
        assert (await _prepare(settings.service_socket, "u-5")).error == ""
        env = _env(_spec(node, "u-15"))
        directory = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert directory.startswith(str(mps_root(node) / "pipe") + "/")
        assert directory != _env(_spec(node, "u-5"))["CUDA_MPS_PIPE_DIRECTORY"]
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
        shown = {
            (m["hostPath"], m["containerPath"], m["options"][0])
            for m in mounts(_spec(node, "u-15"))
        }
        assert (directory, directory, "ro") in shown
        assert all(host != str(mps_root(node) / "pipe") for host, _, _ in shown)
        # What the claim consumed: 30 % of the GPU's threads, 15 GiB pinned.
        assert caps(node, directory)["active-thread-percentage"] == "30"
        assert caps(node, directory)["pinned-memory-limit"] in ("15360M", "15G")
        # Prepared again (a kubelet retry): the same namespace.
        assert (await _prepare(settings.service_socket, "u-15")).error == ""
        assert _env(_spec(node, "u-15"))["CUDA_MPS_PIPE_DIRECTORY"] == directory

        held = "/".join(Path(directory).parts[-2:])
        assert held in namespaces(node)
        assert await _unprepare(settings.service_socket, "u-15") == ""
        await eventually(lambda: held not in namespaces(node), 10, "the namespace deleted")
        assert len(mps_of(daemon).status.namespaces) == 1  # u-5's


async def test_a_claim_without_its_namespace_is_not_prepared(
    node: Node, api: FakeApiServer
) -> None:
    settings = _dra(node, api)
    async with dra_mps_daemon(node, api):
        (mps_root(node) / "fake-fail-commands").touch()
        api.put_claim(_claim("u-1", "10Gi", "25"))
        answer = await _prepare(settings.service_socket, "u-1")
        assert "no MPS namespace" in answer.error
        assert not _spec(node, "u-1").exists()
