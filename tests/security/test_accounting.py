"""Truthful accounting: a slice counts as allocated only while the kubelet lists its allocation
(or in the first seconds after Allocate, before a refresh could list it); otherwise it is
`unconfirmed`, in /status and in vgpu_slices. What is expected on a node (no checkpoint yet, a
kubelet restart) is logged at INFO, not WARNING."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import urllib.request

import grpc
import pytest

import deviceplugin.usage.charges as usage_module
from deviceplugin.kubelet.proto import dp, dp_grpc
from deviceplugin.model import AllocationRecord, DaemonHealth
from deviceplugin.state import AllocationBook
from deviceplugin.usage.attribution import UNCONFIRMED_AFTER_S, SnapshotBuilder
from deviceplugin.usage.statusdoc import snapshot_to_json
from tests.blackbox.daemon_harness import Node, eventually, registered, running_daemon
from tests.unit.test_attribution import INVENTORY, UUID0, reading, record, sid

WALL_S = 1_700_000_000.0


def slices_of(records: list[AllocationRecord], wall_s: float = WALL_S) -> dict[str, int]:
    snapshot, _ = SnapshotBuilder("n", 5.0).build(
        reading(),
        INVENTORY,
        records,
        {},
        now_s=10.0,
        wall_s=wall_s,
        health=DaemonHealth(),
        previous_reading_s=9.0,
    )
    doc = snapshot_to_json(snapshot)
    gpu0 = next(g for g in doc["gpus"] if g["uuid"] == UUID0)
    return dict(gpu0["slices"])


def test_an_allocation_the_kubelet_never_listed_is_unconfirmed_after_a_while() -> None:
    fresh = dataclasses.replace(record(sid(UUID0, 0)), allocated_at_s=WALL_S - 1.0, listed=False)
    stale = dataclasses.replace(
        record(sid(UUID0, 2)), allocated_at_s=WALL_S - UNCONFIRMED_AFTER_S - 1, listed=False
    )
    listed = dataclasses.replace(record(sid(UUID0, 1)), allocated_at_s=WALL_S - 3600.0, listed=True)
    slices = slices_of([fresh, listed, stale])
    assert slices == {"total": 4, "allocated": 2, "free": 1, "unhealthy": 0, "unconfirmed": 1}


def test_the_book_marks_what_the_kubelet_does_not_list() -> None:
    book = AllocationBook()
    a, b = record(sid(UUID0, 0)), record(sid(UUID0, 1))
    book.allocated(a)
    book.allocated(b)
    assert all(r.listed for r in book)  # pod-resources has not answered yet: nothing to doubt
    book.sync([a], now_s=a.allocated_at_s + 1, grace_s=60)
    assert {r.allocation_id: r.listed for r in book} == {
        a.allocation_id: True,
        b.allocation_id: False,
    }


async def test_a_slice_allocated_for_a_pod_the_kubelet_never_lists_shows_unconfirmed(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage_module, "UNCONFIRMED_AFTER_S", 0.5)
    async with running_daemon(node, pod_resources_interval_s=0.2) as daemon:
        await registered(node, 8)
        # An Allocate for a pod deleted before the kubelet listed it: straight to the plugin.
        device = sorted(node.sim.healthy_ids("nvidia.com/vgpu"))[0]
        async with grpc.aio.insecure_channel(f"unix:{node.plugin_socket()}") as channel:
            await dp_grpc.DevicePluginStub(channel).Allocate(
                dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=[device])]
                )
            )

        def unconfirmed() -> int:
            snap = daemon.poller.snapshot
            return 0 if snap is None else sum(g.slices_unconfirmed for g in snap.gpus)

        await eventually(lambda: unconfirmed() == 1, 10, "the slice shown as unconfirmed")
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        assert sum(g.slices_allocated for g in snapshot.gpus) == 0
        assert daemon.http is not None
        url = f"http://127.0.0.1:{daemon.http.port}/metrics"

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())

        found = [
            line
            for line in (await asyncio.to_thread(scrape)).splitlines()
            if line.startswith("vgpu_slices{")
        ]
        assert any('state="unconfirmed"' in line and line.endswith(" 1.0") for line in found)


async def test_a_fresh_node_and_a_kubelet_restart_log_at_info(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node.sim.checkpoint_path.unlink(missing_ok=True)
    async with running_daemon(node):
        await registered(node, 8)
        before = len(node.sim.registrations)
        await node.sim.restart()
        await node.sim.wait_for(lambda: len(node.sim.registrations) > before, timeout_s=10)
    checkpoint = [r for r in caplog.records if "device checkpoint unreadable" in r.getMessage()]
    assert checkpoint
    assert checkpoint[0].levelno == logging.INFO
    again = [r for r in caplog.records if "re-registering with the kubelet" in r.getMessage()]
    assert again
    assert all(r.levelno == logging.INFO for r in again)
