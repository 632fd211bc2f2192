"""A kubelet killed outright and started again at once, as the plugin sees it: the old kubelet can
end the plugin's stream while its socket still takes connections, and the new one replaces that
socket file at any moment, often under the same inode number. Registered with the new kubelet,
the plugin is registered and healthy at once; only a kubelet that takes it back and drops it
again keeps it unhealthy until a stream has been held for a while."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deviceplugin._proto.deviceplugin.v1beta1.api_pb2 import RegisterRequest
from deviceplugin._proto.deviceplugin.v1beta1.api_pb2_grpc import RegistrationStub
from deviceplugin.localgrpc import local_channel
from tests.blackbox.daemon_harness import (
    RESOURCE,
    Node,
    eventually,
    plugins,
    registered,
    running_daemon,
)


async def test_a_new_kubelet_that_replaces_the_old_ones_socket_mid_registration_is_a_restart(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        await eventually(lambda: daemon.health().registered, 10, "registered")
        lifecycle = plugins(daemon).lifecycle

        # The same kubelet drops the stream and takes the plugin back: that is a failing
        # stream, and health says so until one has been held for a while.
        before = lifecycle.stats.registrations
        await node.sim.break_stream(RESOURCE)
        await eventually(
            lambda: lifecycle.stats.registrations > before and node.sim.is_registered(RESOURCE),
            10,
            "registered again with the same kubelet",
        )
        await asyncio.sleep(0.3)
        assert not daemon.health().registered, "a kubelet that dropped the stream took it back"

        # Now the kubelet ends the stream and is killed; a new one replaces its socket between
        # the plugin's look at kubelet.sock and its Register call, which the new one accepts.
        register_once = lifecycle._register_once
        swapped = asyncio.Event()

        async def kubelet_replaced_first(timeout_s: float) -> str | None:
            if not swapped.is_set():
                swapped.set()
                await node.sim.stop()
                # Its start-up cleanup has run already: the socket the plugin names in this
                # call was served after it.
                monkeypatch.setattr(node.sim, "_cleanup_plugin_directory", lambda: None)
                await node.sim.start()
            return await register_once(timeout_s)

        monkeypatch.setattr(lifecycle, "_register_once", kubelet_replaced_first)
        before = lifecycle.stats.registrations
        await node.sim.break_stream(RESOURCE)
        await eventually(swapped.is_set, 10, "a Register call")
        # Tens of milliseconds; 10 s of probation when the new kubelet is taken for the old.
        await eventually(
            lambda: daemon.health().registered and node.sim.is_registered(RESOURCE),
            3,
            "registered with the new kubelet and healthy",
        )
        await asyncio.sleep(0.3)
        assert daemon.health().registered
        # One registration, the one the new kubelet accepted: nothing to do again.
        assert lifecycle.stats.registrations == before + 1


async def test_registration_with_a_restarted_kubelet_is_not_failed_by_an_earlier_channels_backoff(
    node: Node,
) -> None:
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        lifecycle = plugins(daemon).lifecycle
        await node.sim.stop()
        # A channel with the plugin's settings that failed to reach the missing kubelet.sock: its
        # subchannel waits out gRPC's reconnect backoff, as a Register channel closed while the
        # kubelet was down may for a moment after its close.
        kubelet_socket = node.plugin_dir / "kubelet.sock"
        stale = local_channel(kubelet_socket)
        try:
            with pytest.raises(grpc.aio.AioRpcError, match="No such file"):
                await RegistrationStub(stale).Register(RegisterRequest(), timeout=2.0)
            failures = lifecycle.stats.registration_failures
            await node.sim.start()
            await registered(node, 8)
            # The new kubelet took the first Register call made to it.
            assert lifecycle.stats.registration_failures == failures
        finally:
            await stale.close()
