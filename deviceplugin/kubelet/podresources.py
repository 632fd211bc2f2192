"""Client of the kubelet's pod-resources API (v1): which container holds which device IDs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from deviceplugin.kubelet.proto import podres, podres_grpc


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


async def list_container_devices(socket: Path, *, timeout_s: float = 2.0) -> list[ContainerDevices]:
    """Every container's device IDs, per resource, from `List`. Raises grpc.aio.AioRpcError when
    the kubelet does not answer within the timeout."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        reply = await podres_grpc.PodResourcesListerStub(channel).List(
            podres.ListPodResourcesRequest(), timeout=timeout_s
        )
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
