"""The one client of the kubelet's pod-resources API (v1), for both frontends: which container
holds which device IDs (device plugins' entries), and which containers use which resource claim
(the DRA entries, `KubeletPodResourcesDynamicResources`, beta and on in 1.36)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from deviceplugin.kubelet.proto import podres, podres_grpc
from deviceplugin.localgrpc import local_channel


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Asks `List` over one channel, kept from one call to the next: a refresh every few seconds
    then costs one request, not a new connection. A call that fails closes the channel, so the
    next one connects afresh (to a kubelet that restarted and made its socket again) instead of
    waiting out gRPC's reconnect backoff. Use from one event loop."""

    def __init__(self, socket: Path, *, timeout_s: float = 2.0) -> None:
        self.socket = socket
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: podres_grpc.PodResourcesListerStub | None = None
        self.channels_opened = 0

    async def list_container_devices(self) -> list[ContainerDevices]:
        """Every container's device IDs, per resource. Raises grpc.aio.AioRpcError when the
        kubelet does not answer within the timeout."""
        return _merged(await self._list())

    async def claim_users(self, driver_name: str) -> dict[tuple[str, str], list[tuple[str, str]]]:
        """(claim namespace, claim name) -> [(pod, container)] for every claim with a device of
        `driver_name`. Raises grpc.aio.AioRpcError when the kubelet does not answer."""
        return _claim_users(await self._list(), driver_name)

    async def _list(self) -> podres.ListPodResourcesResponse:
        if self._channel is None or self._stub is None:
            self._channel = local_channel(self.socket)
            self._stub = podres_grpc.PodResourcesListerStub(self._channel)
            self.channels_opened += 1
        try:
            reply: podres.ListPodResourcesResponse = await self._stub.List(
                podres.ListPodResourcesRequest(), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError:
            await self.close()
            raise
        return reply

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


def _merged(reply: podres.ListPodResourcesResponse) -> list[ContainerDevices]:
    # The kubelet reports a container's devices in several entries (one per device and NUMA
    # node), so merge them per container and resource.
    merged: dict[tuple[str, str, str, str], list[str]] = {}
    for pod in reply.pod_resources:
        for container in pod.containers:
            for dev in container.devices:
                key = (pod.namespace, pod.name, container.name, dev.resource_name)
                merged.setdefault(key, []).extend(dev.device_ids)
    return [
        ContainerDevices(namespace, pod_name, container, resource, tuple(ids))
        for (namespace, pod_name, container, resource), ids in merged.items()
        if ids
    ]


def _claim_users(
    reply: podres.ListPodResourcesResponse, driver_name: str
) -> dict[tuple[str, str], list[tuple[str, str]]]:
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pod in reply.pod_resources:
        for container in pod.containers:
            for dynamic in container.dynamic_resources:
                if any(r.driver_name == driver_name for r in dynamic.claim_resources):
                    key = (dynamic.claim_namespace or pod.namespace, dynamic.claim_name)
                    found.setdefault(key, []).append((pod.name, container.name))
    return {key: sorted(set(users)) for key, users in found.items()}
