"""Polls that find nothing changed do no more than they must: the slice inventory is not built
again, and the kubelet is not sent the device list again."""

from __future__ import annotations

import pytest

from deviceplugin import incremental, slicing
from deviceplugin.config import DEFAULT_RESOURCE_NAME, MigConfig, SlicingConfig
from deviceplugin.model import Inventory, NodeReading
from tests.blackbox.daemon_harness import (
    RESOURCE,
    TWO_GPUS,
    Node,
    eventually,
    gpu,
    registered,
    running_daemon,
)


async def test_idle_polls_neither_rebuild_the_inventory_nor_resend_the_device_list(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Inventory] = []
    build = slicing.build_inventory

    def counting_build(
        reading: NodeReading,
        cfg: SlicingConfig,
        *,
        mig: MigConfig | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
    ) -> Inventory:
        inventory = build(reading, cfg, mig=mig, resource_name=resource_name)
        built.append(inventory)
        return inventory

    monkeypatch.setattr(incremental, "build_inventory", counting_build)
    async with running_daemon(node) as daemon:  # polls every 50 ms
        await registered(node, 8)
        builds, updates = len(built), node.sim.list_and_watch_updates(RESOURCE)
        inventory = daemon.inventory.value
        polled_s = daemon.poller.last_success_wall_s
        await eventually(
            lambda: daemon.poller.last_success_wall_s > polled_s + 0.5, what="ten more polls"
        )
        assert len(built) == builds
        assert node.sim.list_and_watch_updates(RESOURCE) == updates
        assert daemon.inventory.value is inventory

        # A change is still seen at the next poll: built once more, sent once more.
        node.write_gpus((TWO_GPUS[0], gpu(1, name="NVIDIA L4", memory_gib=24, healthy=False)))
        await node.sim.wait_for(lambda: len(node.sim.unhealthy_ids(RESOURCE)) == 4)
        assert len(built) == builds + 1
        assert node.sim.list_and_watch_updates(RESOURCE) == updates + 1
