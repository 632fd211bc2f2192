"""A storm of config updates, valid and invalid mixed, written as fast as the kubelet swaps a
ConfigMap, while pods hold slices (device-plugin mode) or claims are prepared (DRA mode): the
daemon keeps serving, never drops or re-offers what is held, refuses each bad config with its
reason, and ends on the last valid config."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from functools import partial

import pytest

from deviceplugin.app import Daemon
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.reload import read_config
from tests.blackbox.daemon_harness import RESOURCE, Node, dra_frontend, eventually, registered
from tests.blackbox.test_dra import _claim, _dra, _prepare, _register, _spec
from tests.blackbox.test_reload import FAST, configmap, daemon_with_config, reloads, running_hash
from tests.support.fake_apiserver import FakeApiServer

VALID = [FAST + f"slicing:\n  replicas: {n}\n" for n in (4, 2, 3, 4, 5)]
INVALID = [
    FAST + "slicing:\n  replicas: 0\n",  # out of range
    FAST + "slicing: [not, a, map\n",  # not YAML
    FAST + "slicing:\n  replicas: 4\nunknownKey: 1\n",  # unknown key
    FAST + "slicing:\n  memoryPerSlice: 64Mi\n",  # too many slices for the kubelet
    FAST + "slicing:\n  replicas: 99999999999999999999999\n",  # a huge integer
]
STORM = [c for pair in zip(INVALID * 3, VALID * 3, strict=True) for c in pair]


def runs(daemon: Daemon, config_hash: str) -> bool:
    return bool(running_hash(daemon) == config_hash)


def refused_more_than(daemon: Daemon, count: float) -> bool:
    return bool(reloads(daemon, "refused") > count)


async def test_a_reload_storm_keeps_held_slices_and_ends_on_the_last_valid_config(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="deviceplugin.reload")
    root = node.root / "cfg"
    path = configmap(root, 1, VALID[0])
    sim = node.sim
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        pod = await sim.admit_pod("held", [("c", 3)])
        held = set(pod.containers[0].device_ids)
        allocation = pod.containers[0].envs["VGPU_ALLOCATION_ID"]
        for version, content in enumerate(STORM, start=2):
            configmap(root, version, content)
            # Some back to back, some a moment apart: the daemon applies some and coalesces
            # others. Whatever it is applying, every held slice stays advertised (healthy, or
            # unhealthy where the plan of the moment has no place for it) and in the book.
            await asyncio.sleep(0.01 * (version % 4))
            if version % 5 == 0 and content in VALID:
                # Now and then a valid content stays long enough to settle and is applied
                # before the storm goes on.
                want = read_config(path).hash
                await eventually(partial(runs, daemon, want), 20, "a settled config")
            assert held <= set(sim.devices(RESOURCE)), (version, sorted(sim.devices(RESOURCE)))
            assert allocation in {r.allocation_id for r in daemon.book}
        # Two different invalid configs last in the storm, each seen refused (a content is
        # reported once, so the same one twice would be one refusal); then the one the storm
        # ends on.
        for version, content in enumerate(INVALID[1::-1], start=len(STORM) + 2):
            before = reloads(daemon, "refused")
            configmap(root, version, content)
            await eventually(partial(refused_more_than, daemon, before), 20, "a refusal")
        configmap(root, len(STORM) + 4, FAST + "slicing:\n  replicas: 3\n")
        await eventually(
            lambda: running_hash(daemon) == read_config(path).hash, 20, "the last config applied"
        )
        # Three slices per GPU, the pod's three on GPU 0 among them.
        await sim.wait_for(
            lambda: len(sim.healthy_ids(RESOURCE)) == 6 and held <= sim.healthy_ids(RESOURCE)
        )
        still = sim.get_pod("default", "held")
        assert still is not None
        assert set(still.containers[0].device_ids) == held
        assert allocation in {r.allocation_id for r in daemon.book}
        # The storm went through both paths, more than once each.
        assert reloads(daemon, "applied") >= 2, reloads(daemon, "applied")
        assert reloads(daemon, "refused") >= 2, reloads(daemon, "refused")
        # A new pod gets the free slices only.
        other = await sim.admit_pod("other", [("c", 3)])
        assert not set(other.containers[0].device_ids) & held
    refusals = [r.getMessage() for r in caplog.records if "config reload refused" in r.getMessage()]
    assert refusals, "no refusal logged"


async def test_a_reload_storm_in_dra_mode_keeps_prepared_claims_and_publishes_the_last_policy(
    dra_node: Node, dra_api: FakeApiServer
) -> None:
    """DRA mode: the request policies (`dra`) change with each valid config; the prepared
    claims keep their specs, their checkpoint entries and their place in the book, and the
    slice ends with the last valid policy."""
    root = dra_node.root / "cfg"
    policies = [FAST + f"dra: {{compute: {{default: {n}}}}}\n" for n in (10, 20, 30, 40, 50)]
    path = configmap(root, 1, policies[0])
    loaded = read_config(path)
    settings = dataclasses.replace(
        dra_node.settings(loaded.config),
        dra=_dra(dra_node, dra_api),
        config_path=path,
        config_hash=loaded.hash,
    )
    assert settings.dra is not None
    backend = FakeBackend(dra_node.state_file)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, asyncio.Event()))
    try:
        await _register(settings.dra)
        dra_api.put_claim(_claim("u-held", "4Gi", "25"))
        assert (await _prepare(settings.dra.service_socket, "u-held")).error == ""
        spec = _spec(dra_node, "u-held")
        before = spec.read_text()
        storm = [c for pair in zip(INVALID * 2, policies * 2, strict=True) for c in pair]
        for version, content in enumerate(storm, start=2):
            configmap(root, version, content)
            await asyncio.sleep(0.01 * (version % 4))
            assert spec.read_text() == before
            assert any(r.claim == "default/claim-u-held" for r in daemon.book)
        configmap(root, len(storm) + 2, FAST + "dra: {compute: {default: 35}}\n")

        def compute_default() -> str:
            slices = dra_api.slice_list()
            if not slices:
                return ""
            policy = slices[0]["spec"]["devices"][0]["capacity"]["compute"]["requestPolicy"]
            return str(policy["default"])

        await eventually(lambda: compute_default() == "35", 20, "the last policy published")
        assert not task.done()
        assert spec.read_text() == before
        assert dra_frontend(daemon).store.get("u-held") is not None
        assert any(r.claim == "default/claim-u-held" for r in daemon.book)
        checkpoint = json.loads((dra_node.root / "state" / "dra-claims.json").read_text())
        assert [c["uid"] for c in checkpoint["claims"]] == ["u-held"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()
