"""A pod with an init container, through the kubelet simulator: pod-resources lists the pod's
regular containers only, the checkpoint every container. /status names every allocation; a
finished init container's allocation is released when the kubelet reused all its devices, and
otherwise stays under its pod and its own name (the kubelet keeps those devices for the pod)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from deviceplugin.app import Daemon
from tests.blackbox.daemon_harness import Node, eventually, registered, running_daemon
from tests.blackbox.test_mps import get


async def _allocations(daemon: Daemon) -> list[dict[str, Any]]:
    assert daemon.http is not None
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{daemon.http.port}/status")
    assert status == 200, body
    return list(json.loads(body)["allocations"])


async def _settled(daemon: Daemon, pod: str) -> list[dict[str, Any]]:
    """The allocations once the pod's listed container is named (the tracker has refreshed)."""
    latest: list[dict[str, Any]] = []

    async def poll() -> None:
        nonlocal latest
        while True:
            latest = await _allocations(daemon)
            if any(a["pod"] == pod and a["container"] == "main" for a in latest):
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), 10)
    await asyncio.sleep(0.6)  # one more refresh at least (min gap 0.25 s after the Allocates)
    return await _allocations(daemon)


async def test_an_init_container_whose_devices_were_reused_is_released(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        pod = await node.sim.admit_pod("with-init", [("main", 2)], init_containers=[("setup", 1)])
        setup, main = pod.containers
        assert set(setup.device_ids) < set(main.device_ids)  # the kubelet reused it

        allocations = await _settled(daemon, "with-init")

    assert [(a["namespace"], a["pod"], a["container"]) for a in allocations] == [
        ("default", "with-init", "main")
    ]
    assert sorted(allocations[0]["slice_ids"]) == sorted(main.device_ids)


async def test_an_init_container_holding_devices_of_its_own_is_named(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        pod = await node.sim.admit_pod("with-init", [("main", 1)], init_containers=[("setup", 2)])
        setup, main = pod.containers
        assert set(main.device_ids) < set(setup.device_ids)

        allocations = await _settled(daemon, "with-init")
        named = {(a["namespace"], a["pod"], a["container"]): a for a in allocations}
        assert set(named) == {("default", "with-init", "main"), ("default", "with-init", "setup")}
        assert sorted(named["default", "with-init", "setup"]["slice_ids"]) == sorted(
            setup.device_ids
        )
        assert named["default", "with-init", "setup"]["init_container"] is True
        assert named["default", "with-init", "main"]["init_container"] is False

        # The pod goes: so does every allocation of it, the init container's with it.
        await node.sim.delete_pod("default", "with-init")
        await eventually(
            lambda: not any(r.pod == "with-init" for r in daemon.book), what="the pod's release"
        )
