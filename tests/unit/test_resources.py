"""The set of plugin endpoints, one per resource, reconciled with the inventory: resources come
and go with the slices, the primary one always stays, and an endpoint re-created for a resource
starts only once the old one has gone (it removes the socket both would use)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from deviceplugin.model import GpuInfo, GpuPlan, Inventory, Slice, SliceId
from deviceplugin.plugin.lifecycle import LifecycleStats, PluginLifecycle
from deviceplugin.plugin.resources import ResourceEndpoint, ResourcePlugins
from deviceplugin.plugin.server import DevicePluginService
from deviceplugin.state import Published

PRIMARY = "nvidia.com/vgpu"
SMALL = "nvidia.com/mig-1g.10gb"


class StubLifecycle:
    """Stands in for a PluginLifecycle: records when it runs and stops."""

    def __init__(self, name: str, events: list[str], hold_s: float = 0.0) -> None:
        self.name = name
        self.events = events
        self.hold_s = hold_s
        self.stats = LifecycleStats()

    async def run(self, stop: asyncio.Event) -> None:
        self.events.append(f"start {self.name}")
        await stop.wait()
        await asyncio.sleep(self.hold_s)  # removing the socket, closing the server
        self.events.append(f"stop {self.name}")


def inventory(*resources: str) -> Inventory:
    plans, slices = [], []
    for i, resource in enumerate(resources):
        gpu = GpuInfo(f"MIG-{i}", 0, "x", 1 << 30, 0)
        plans.append(GpuPlan(gpu, 1, 1 << 30, 1.0, resource_name=resource))
        slices.append(Slice(SliceId(gpu.uuid, 0), 0, None, 1 << 30, 1.0, True, resource))
    return Inventory.of(plans, slices)


def plugins(events: list[str], hold_s: float = 0.0) -> ResourcePlugins:
    def make(name: str, published: Published[Inventory]) -> ResourceEndpoint:
        lifecycle = cast(PluginLifecycle, StubLifecycle(name, events, hold_s))
        return ResourceEndpoint(name, published, cast(DevicePluginService, None), lifecycle)

    return ResourcePlugins(make(PRIMARY, Published(Inventory())), make)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_resources_follow_the_inventory_and_the_primary_always_stays() -> None:
    events: list[str] = []
    resources = plugins(events)
    stop = asyncio.Event()
    task = asyncio.create_task(resources.run(stop))

    resources.reconcile(inventory(SMALL))
    await settle()
    assert resources.names == {PRIMARY, SMALL}
    small = resources.get(SMALL)
    assert small is not None
    assert [s.device_id for s in small.inventory.value.slices] == ["MIG-0::0"]
    assert set(events) == {f"start {PRIMARY}", f"start {SMALL}"}

    resources.reconcile(inventory())
    await settle()
    assert resources.names == {PRIMARY}
    assert events[-1] == f"stop {SMALL}"

    stop.set()
    await asyncio.wait_for(task, 5)
    assert events[-1] == f"stop {PRIMARY}"


async def test_a_resource_back_at_once_starts_after_the_old_endpoint_has_gone() -> None:
    events: list[str] = []
    resources = plugins(events, hold_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(resources.run(stop))
    resources.reconcile(inventory(SMALL))
    await settle()

    resources.reconcile(inventory())
    resources.reconcile(inventory(SMALL))
    await asyncio.sleep(0.2)

    small = [e for e in events if e.endswith(SMALL)]
    assert small == [f"start {SMALL}", f"stop {SMALL}", f"start {SMALL}"]
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_new_primary_starts_at_once_and_the_old_goes_when_no_slice_is_left() -> None:
    """A renamed resourceName: the new name is served at once and counts registrations on from
    the old; the old name stays while the inventory still names it, then stops."""
    renamed = "example.com/gpu"
    events: list[str] = []
    resources = plugins(events)
    stop = asyncio.Event()
    runner = asyncio.create_task(resources.run(stop))
    try:
        resources.reconcile(inventory(PRIMARY))
        await settle()
        resources.primary_endpoint.lifecycle.stats.registrations = 3
        resources.set_primary(renamed)
        await settle()
        assert events == [f"start {PRIMARY}", f"start {renamed}"]
        assert resources.primary == renamed
        assert resources.primary_endpoint.lifecycle.stats.registrations == 3
        # The poll before the new config took effect still names the old resource: it stays.
        resources.reconcile(inventory(PRIMARY))
        await settle()
        assert resources.names == {PRIMARY, renamed}
        resources.reconcile(inventory(renamed))
        await settle()
        assert resources.names == {renamed}
        assert events[-1] == f"stop {PRIMARY}"
    finally:
        stop.set()
        await asyncio.wait_for(runner, 5)


async def test_a_poll_that_changed_nothing_costs_no_reconcile_but_a_new_primary_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After every poll the daemon reconciles with the inventory; one that changed nothing hands
    the very same inventory, and nothing is split per resource or compared again. A new primary
    resource still takes effect with that same inventory: the old one, no longer named, stops."""
    split: list[str] = []
    for_resource = Inventory.for_resource

    def counting(self: Inventory, resource_name: str) -> Inventory:
        split.append(resource_name)
        return for_resource(self, resource_name)

    monkeypatch.setattr(Inventory, "for_resource", counting)
    renamed = "example.com/gpu"
    events: list[str] = []
    resources = plugins(events)
    stop = asyncio.Event()
    runner = asyncio.create_task(resources.run(stop))
    try:
        polled = inventory(SMALL)
        resources.reconcile(polled)
        await settle()
        assert sorted(split) == sorted([PRIMARY, SMALL])
        for _ in range(3):
            resources.reconcile(polled)
        assert len(split) == 2

        resources.set_primary(renamed)
        resources.reconcile(polled)
        await settle()
        assert resources.names == {renamed, SMALL}
        assert f"stop {PRIMARY}" in events
    finally:
        stop.set()
        await asyncio.wait_for(runner, 5)


async def test_a_slice_held_under_a_retired_name_is_offered_unhealthy_until_freed() -> None:
    resources = plugins([])
    resources.set_primary("example.com/renamed")
    renamed = inventory("example.com/renamed", "example.com/renamed")
    resources.reconcile(renamed, {"MIG-1::0": PRIMARY})
    # The old name is served no more, and what is held under it is still this node's.
    assert resources.names == {"example.com/renamed"}
    assert resources.retired == {PRIMARY}
    assert resources.known_names == {PRIMARY, "example.com/renamed"}
    endpoint = resources.get("example.com/renamed")
    assert endpoint is not None
    health = {s.device_id: s.healthy for s in endpoint.inventory.value.slices}
    assert health == {"MIG-0::0": True, "MIG-1::0": False}
    # The same inventory once the kubelet freed it: offered again.
    resources.reconcile(renamed, {})
    assert all(s.healthy for s in endpoint.inventory.value.slices)
    # Renamed back: the old name is served again, not retired.
    resources.set_primary(PRIMARY)
    resources.reconcile(inventory(PRIMARY))
    assert resources.retired == {"example.com/renamed"}
