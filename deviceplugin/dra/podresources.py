"""Which containers use which claim, from the kubelet's pod-resources API (its DRA entries,
`KubeletPodResourcesDynamicResources`, beta and on in 1.36): the container names of a prepared
claim's allocation."""

from __future__ import annotations

from pathlib import Path

from deviceplugin._proto.podresources.v1 import api_pb2 as podres
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as podres_grpc
from deviceplugin.localgrpc import local_channel


async def claim_containers(
    socket: Path, driver_name: str, *, timeout_s: float = 2.0
) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(claim namespace, claim name) -> [(pod, container)] for every claim with a device of
    `driver_name`. Raises grpc.aio.AioRpcError when the kubelet does not answer."""
    async with local_channel(socket) as channel:
        stub = podres_grpc.PodResourcesListerStub(channel)
        reply = await stub.List(podres.ListPodResourcesRequest(), timeout=timeout_s)
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pod in reply.pod_resources:
        for container in pod.containers:
            for dynamic in container.dynamic_resources:
                if any(r.driver_name == driver_name for r in dynamic.claim_resources):
                    key = (dynamic.claim_namespace or pod.namespace, dynamic.claim_name)
                    found.setdefault(key, []).append((pod.name, container.name))
    return {key: sorted(set(users)) for key, users in found.items()}
