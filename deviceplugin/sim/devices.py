"""Per-resource endpoints and the ListAndWatch consumer: every list replaces the previous one and
sets the healthy and unhealthy devices; when the stream ends, every device of that resource turns
unhealthy and the kubelet side never reopens it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from deviceplugin.kubelet.proto import (
    UNHEALTHY,
    dp,
)
from deviceplugin.sim.checkpoint import CheckpointedState
from deviceplugin.sim.records import (
    DeviceState,
    _Endpoint,
    _rpc_error_text,
)

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator


class DeviceLists(CheckpointedState):
    """Reading each registered plugin's ListAndWatch stream into the device state."""

    async def _close_endpoint(self, endpoint: _Endpoint) -> None:
        endpoint.stopped = True
        endpoint.stream_open = False
        task = endpoint.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await endpoint.channel.close()

    async def _consume(self, endpoint: _Endpoint) -> None:
        """Read ListAndWatch until it ends; then the resource's devices all turn unhealthy."""
        reason = "stream closed by the plugin"
        try:
            async for response in endpoint.stub.ListAndWatch(dp.Empty()):
                self._receive_list(endpoint, response)
        except grpc.aio.AioRpcError as e:
            reason = _rpc_error_text(e)
        except Exception:
            logger.exception("ListAndWatch reader failed resource=%s", endpoint.resource_name)
            reason = "reader failed"
        finally:
            endpoint.stream_open = False
        if endpoint.stopped:
            return
        endpoint.stopped = True
        logger.warning(
            "ListAndWatch ended unexpectedly resource=%s endpoint=%s reason=%r",
            endpoint.resource_name,
            endpoint.endpoint,
            reason,
        )
        if self._endpoints.get(endpoint.resource_name) is endpoint:
            self._mark_resource_unhealthy(endpoint.resource_name)
        await endpoint.channel.close()
        self._notify()

    def _receive_list(self, endpoint: _Endpoint, response: dp.ListAndWatchResponse) -> None:
        resource = endpoint.resource_name
        if endpoint.stopped or self._endpoints.get(resource) is not endpoint:
            return
        devices = {
            d.ID: DeviceState(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
            for d in response.devices
        }
        healthy = {i for i, d in devices.items() if d.healthy}
        changed = devices != self._devices.get(resource) or not endpoint.stream_open
        self._devices[resource] = devices
        self._healthy[resource] = healthy
        self._unhealthy[resource] = set(devices) - healthy
        endpoint.updates += 1
        endpoint.stream_open = True
        self._write_checkpoint()
        logger.log(
            logging.INFO if changed else logging.DEBUG,
            "device list received resource=%s update=%d total=%d healthy=%d unhealthy=%s",
            resource,
            endpoint.updates,
            len(devices),
            len(healthy),
            sorted(self._unhealthy[resource]),
        )
        self._notify()

    async def break_stream(self, resource_name: str) -> None:
        """End the resource's ListAndWatch stream from the kubelet's side, as a broken connection
        does. Like the kubelet, mark its devices unhealthy and never re-open the stream: getting
        back into service is up to the plugin, by registering again."""
        endpoint = self._endpoints[resource_name]
        await self._close_endpoint(endpoint)
        self._mark_resource_unhealthy(resource_name)
        logger.warning("ListAndWatch stream broken resource=%s", resource_name)
        self._notify()

    def _mark_resource_unhealthy(self, resource: str) -> None:
        healthy = self._healthy.get(resource, set())
        self._unhealthy[resource] = self._unhealthy.get(resource, set()) | healthy
        self._healthy[resource] = set()
        self._devices[resource] = {
            i: DeviceState(i, UNHEALTHY, d.numa_nodes)
            for i, d in self._devices.get(resource, {}).items()
        }
        logger.warning("all devices marked unhealthy resource=%s count=%d", resource, len(healthy))
