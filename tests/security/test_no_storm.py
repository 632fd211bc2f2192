"""No registration storm, whatever breaks ListAndWatch; and a stream opened by anyone but the
kubelet (a debugging grpcurl) comes and goes without a re-registration."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

import deviceplugin.plugin.lifecycle as lifecycle_module
import deviceplugin.plugin.server as server_module
from deviceplugin.kubelet.proto import dp, dp_grpc
from deviceplugin.model import Inventory
from tests.blackbox.daemon_harness import Node, eventually, plugins, registered, running_daemon


async def test_a_debugging_stream_that_ends_triggers_no_reregistration(node: Node) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        await eventually(
            lambda: plugins(daemon).service.open_streams == 1, 5, "the kubelet's stream"
        )
        before = plugins(daemon).lifecycle.stats.registrations
        for _ in range(3):
            async with grpc.aio.insecure_channel(f"unix:{node.plugin_socket()}") as channel:
                stream = dp_grpc.DevicePluginStub(channel).ListAndWatch(dp.Empty())
                first = await stream.read()
                assert isinstance(first, dp.ListAndWatchResponse)
                assert len(first.devices) == 8
                stream.cancel()
        await asyncio.sleep(0.5)
        assert plugins(daemon).lifecycle.stats.registrations == before
        assert plugins(daemon).lifecycle.registered
        assert node.sim.is_registered("nvidia.com/vgpu")


async def test_a_listandwatch_that_always_fails_backs_off_and_fails_health(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle_module, "STABLE_STREAM_S", 0.5)
    real_device_list = server_module.device_list
    broken = True

    def device_list(inventory: Inventory) -> dp.ListAndWatchResponse:
        if broken:
            raise ValueError("Value out of range: 9223372036854775808")  # as protobuf says
        return real_device_list(inventory)

    monkeypatch.setattr(server_module, "device_list", device_list)
    async with running_daemon(node) as daemon:
        await eventually(
            lambda: plugins(daemon).lifecycle.stats.registrations >= 1, 10, "a registration"
        )
        started = time.monotonic()
        await asyncio.sleep(2.0)
        elapsed = time.monotonic() - started
        made = plugins(daemon).lifecycle.stats.registrations
        # Backing off from 0.1 s and doubling: a handful in 2 s, not hundreds.
        assert made <= 6, f"{made} registrations in {elapsed:.1f}s"
        health = daemon.health()
        assert not health.registered
        # Counted from the first failure, not from the latest short-lived registration.
        assert health.unregistered_since_s > 0
        assert time.monotonic() - health.unregistered_since_s > 1.5
        # Fixed: a stream is held again, and health follows once it has been for a while.
        broken = False
        await eventually(lambda: daemon.health().registered, 15, "registered and holding")
        assert node.sim.is_registered("nvidia.com/vgpu")
