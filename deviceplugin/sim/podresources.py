"""The pod-resources v1 server of the simulated kubelet: List, GetAllocatableResources and Get."""

from __future__ import annotations

from typing import Any

import grpc

from deviceplugin.kubelet.proto import (
    podres,
    podres_grpc,
)
from deviceplugin.sim.records import (
    _PodRecord,
)
from deviceplugin.sim.state import KubeletState


class _PodResourcesServicer(podres_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: KubeletState) -> None:
        self._kubelet = kubelet

    async def List(  # noqa: N802
        self, request: podres.ListPodResourcesRequest, context: Any
    ) -> podres.ListPodResourcesResponse:
        # The kubelet lists the pods its pod manager knows: none, after a restart, until it has
        # had them from the API server (its device checkpoint still names them).
        pods = self._kubelet._pods.values() if self._kubelet._pods_synced else ()
        return podres.ListPodResourcesResponse(pod_resources=[self._pod(record) for record in pods])

    async def GetAllocatableResources(  # noqa: N802
        self, request: podres.AllocatableResourcesRequest, context: Any
    ) -> podres.AllocatableResourcesResponse:
        kubelet = self._kubelet
        devices: list[podres.ContainerDevices] = []
        for resource in sorted(kubelet._healthy):
            known = kubelet._devices.get(resource, {})
            for device_id in sorted(kubelet._healthy[resource]):
                state = known.get(device_id)
                nodes = state.numa_nodes if state is not None else ()
                devices.extend(_container_devices(resource, device_id, nodes))
        return podres.AllocatableResourcesResponse(devices=devices)

    async def Get(  # noqa: N802
        self, request: podres.GetPodResourcesRequest, context: Any
    ) -> podres.GetPodResourcesResponse:
        record = self._kubelet._pods.get((request.pod_namespace, request.pod_name))
        if record is None or not self._kubelet._pods_synced:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        assert record is not None
        return podres.GetPodResourcesResponse(pod_resources=self._pod(record))

    @staticmethod
    def _pod(record: _PodRecord) -> podres.PodResources:
        """One entry per container, with the devices of every resource it holds."""
        pod = record.grant
        by_container: dict[str, list[podres.ContainerDevices]] = {}
        for container in pod.containers:
            if container.init:
                continue  # the kubelet lists a pod's regular containers only
            devices = by_container.setdefault(container.name, [])
            devices.extend(
                entry
                for device_id in container.device_ids
                for entry in _container_devices(
                    container.resource_name, device_id, record.numa_nodes.get(device_id, ())
                )
            )
        return podres.PodResources(
            name=pod.name,
            namespace=pod.namespace,
            containers=[
                podres.ContainerResources(name=name, devices=devices)
                for name, devices in by_container.items()
            ],
        )


def _container_devices(
    resource: str, device_id: str, numa_nodes: tuple[int, ...]
) -> list[podres.ContainerDevices]:
    """One entry per device and NUMA node, or one without topology, as the kubelet reports them."""
    if not numa_nodes:
        return [podres.ContainerDevices(resource_name=resource, device_ids=[device_id])]
    return [
        podres.ContainerDevices(
            resource_name=resource,
            device_ids=[device_id],
            topology=podres.TopologyInfo(nodes=[podres.NUMANode(ID=node)]),
        )
        for node in numa_nodes
    ]
