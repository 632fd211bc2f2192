"""Pod admission: per container and resource, the free healthy devices, GetPreferredAllocation
when offered (advisory), one Allocate, and PreStartContainer when required; pod deletion."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace

import grpc

from deviceplugin.kubelet.proto import (
    dp,
)
from deviceplugin.sim.checkpoint import CheckpointedState
from deviceplugin.sim.records import (
    CREATE_CONTAINER_CONFIG_ERROR,
    AdmissionError,
    ContainerGrant,
    PodGrant,
    _Endpoint,
    _grant_from_response,
    _PodRecord,
    _rpc_error_text,
)

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator


def choose_devices(
    available: Sequence[str], preferred: Sequence[str], size: int
) -> tuple[list[str], bool]:
    """The kubelet's use of an advisory preference: take the preferred IDs that are available, in
    the plugin's order, then fill up from `available` in its order. The flag says whether the
    preference was exactly `size` distinct available IDs."""
    free = set(available)
    chosen: list[str] = []
    for device_id in preferred:
        if len(chosen) == size:
            break
        if device_id in free and device_id not in chosen:
            chosen.append(device_id)
    for device_id in available:
        if len(chosen) == size:
            break
        if device_id not in chosen:
            chosen.append(device_id)
    valid = len(preferred) == size and len(set(preferred)) == size and set(preferred) <= free
    return chosen, valid


def _unexpected(cause: str) -> str:
    return f"Allocate failed due to {cause}, which is unexpected"


class Admission(CheckpointedState):
    """Admitting and deleting pods."""

    async def admit_pod(
        self,
        name: str,
        containers: Sequence[tuple[str, int | Mapping[str, int]]],
        resource_name: str = "nvidia.com/vgpu",
        namespace: str = "default",
        init_containers: Sequence[tuple[str, int]] = (),
    ) -> PodGrant:
        """Admit a pod whose containers each request `count` devices of `resource_name`, or
        `{resource: count, ...}` of several resources, then start them. As the kubelet does, each
        resource of a container is allocated by its own plugin, in resource name order, and the
        pod gets one grant per container and resource. All or nothing: on any failure nothing of
        the pod is kept. `init_containers` ask for `resource_name` before them, as the kubelet's
        allocation does: their devices stay the pod's, and a later container takes them first
        (devicesToReuse); pod-resources does not list them, the checkpoint does."""
        if not self._running:
            raise RuntimeError("kubelet simulator is not running")
        names = [container for container, _ in (*init_containers, *containers)]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate container names in pod {namespace}/{name}: {names}")
        requests: list[tuple[str, str, int, bool]] = [
            (container, resource_name, count, True) for container, count in init_containers
        ]
        for container, request in containers:
            if isinstance(request, int):
                requests.append((container, resource_name, request, False))
            elif not request:
                requests.append((container, resource_name, 0, False))
            else:
                requests.extend((container, r, n, False) for r, n in sorted(request.items()))
        if any(count < 0 for _, _, count, _ in requests):
            raise ValueError(f"negative device request in pod {namespace}/{name}: {containers}")
        async with self._admission:
            if (namespace, name) in self._pods:
                raise ValueError(f"pod {namespace}/{name} already exists")
            uid = str(uuid.uuid4())
            taken: list[str] = []
            grants: list[ContainerGrant] = []
            numa_nodes: dict[str, tuple[int, ...]] = {}
            reusable: dict[str, list[str]] = {}  # the init containers' devices, by resource
            try:
                for container, resource, count, init in requests:
                    if count == 0:
                        grants.append(
                            ContainerGrant(
                                container, resource, (), {}, (), (), {}, (), (), init=init
                            )
                        )
                        continue
                    reuse = reusable.setdefault(resource, [])
                    grant = await self._allocate_container(
                        namespace=namespace,
                        pod=name,
                        container=container,
                        resource=resource,
                        count=count,
                        taken=taken,
                        reuse=reuse[:count],
                    )
                    if init:
                        grant = replace(grant, init=True)
                        reuse.extend(d for d in grant.device_ids if d not in reuse)
                    else:
                        reuse[:] = [d for d in reuse if d not in grant.device_ids]
                    grants.append(grant)
                    known = self._devices.get(resource, {})
                    for device_id in grant.device_ids:
                        state = known.get(device_id)
                        numa_nodes[device_id] = state.numa_nodes if state is not None else ()
                for grant in grants:
                    if grant.device_ids:
                        await self._pre_start(namespace, name, grant)
            except AdmissionError as e:
                logger.info(
                    "pod rejected namespace=%s pod=%s reason=%s message=%r",
                    namespace,
                    name,
                    e.reason,
                    e.message,
                )
                raise
            pod = PodGrant(namespace, name, uid, tuple(grants))
            self._pods[(namespace, name)] = _PodRecord(pod, numa_nodes)
            self._write_checkpoint()
        logger.info(
            "pod admitted namespace=%s pod=%s uid=%s devices=%s",
            namespace,
            name,
            uid,
            {f"{g.name}/{g.resource_name}": list(g.device_ids) for g in grants},
        )
        self._notify()
        return pod

    async def _allocate_container(
        self,
        *,
        namespace: str,
        pod: str,
        container: str,
        resource: str,
        count: int,
        taken: list[str],
        reuse: Sequence[str] = (),
    ) -> ContainerGrant:
        """devicesToAllocate, the preference and Allocate for one container."""
        available = self._available(resource, count, taken, reuse)
        endpoint = self._endpoint(resource)
        preferred: tuple[str, ...] = ()
        if endpoint.options.get_preferred_allocation_available:
            preferred, chosen = await _preferred_choice(
                endpoint, resource, available, reuse, count, who=(namespace, pod, container)
            )
        else:
            chosen = [*reuse, *available[: count - len(reuse)]]
        taken.extend(d for d in chosen if d not in taken)
        request_ids = list(chosen)
        try:
            response: dp.AllocateResponse = await endpoint.stub.Allocate(
                dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=request_ids)]
                )
            )
        except grpc.aio.AioRpcError as e:
            raise AdmissionError(_unexpected(_rpc_error_text(e)), resource_name=resource) from e
        if not response.container_responses:
            raise AdmissionError(
                _unexpected(f"no containers return in allocation response {response}"),
                resource_name=resource,
            )
        return _grant_from_response(
            container, resource, request_ids, response.container_responses[0], preferred
        )

    def _available(
        self, resource: str, count: int, taken: Sequence[str], reuse: Sequence[str]
    ) -> list[str]:
        """The healthy devices of `resource` no container holds and none of this pod took, as
        the kubelet's devicesToAllocate finds them; its error when too few are left."""
        healthy = self._healthy.get(resource)
        if healthy is None:
            raise AdmissionError(
                _unexpected(f"cannot allocate unregistered device {resource}"),
                resource_name=resource,
            )
        if not healthy:
            raise AdmissionError(
                _unexpected(
                    f"no healthy devices present; cannot allocate unhealthy devices {resource}"
                ),
                resource_name=resource,
            )
        in_use = self.allocated_ids(resource) | set(taken)
        available = sorted(healthy - in_use)
        if len(available) < count - len(reuse):
            raise AdmissionError(
                _unexpected(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {count - len(reuse)}, Available: {len(available)}"
                ),
                resource_name=resource,
            )
        return available

    def _endpoint(self, resource: str) -> _Endpoint:
        """The running endpoint of `resource`'s plugin; the kubelet's error when there is none."""
        endpoint = self._endpoints.get(resource)
        if endpoint is None:
            raise AdmissionError(
                _unexpected(f"unknown Device Plugin {resource}"), resource_name=resource
            )
        if endpoint.stopped:
            raise AdmissionError(
                _unexpected(f"endpoint {endpoint.socket_path} has been stopped"),
                resource_name=resource,
            )
        return endpoint

    async def _pre_start(self, namespace: str, pod: str, grant: ContainerGrant) -> None:
        endpoint = self._endpoints.get(grant.resource_name)
        if endpoint is None or endpoint.stopped:
            raise AdmissionError(
                f"endpoint not found in cache for a registered resource: {grant.resource_name}",
                reason=CREATE_CONTAINER_CONFIG_ERROR,
                resource_name=grant.resource_name,
            )
        if not endpoint.options.pre_start_required:
            return
        try:
            await endpoint.stub.PreStartContainer(
                dp.PreStartContainerRequest(devices_ids=list(grant.device_ids)),
                timeout=self._pre_start_timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            raise AdmissionError(
                f"device plugin PreStartContainer rpc failed with err: {_rpc_error_text(e)}",
                reason=CREATE_CONTAINER_CONFIG_ERROR,
                resource_name=grant.resource_name,
            ) from e
        logger.debug("PreStartContainer done pod=%s/%s container=%s", namespace, pod, grant.name)

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Remove a pod; its devices are free again."""
        async with self._admission:
            record = self._pods.pop((namespace, name), None)
            if record is None:
                raise KeyError(f"pod {namespace}/{name} not found")
            self._write_checkpoint()
        logger.info("pod deleted namespace=%s pod=%s uid=%s", namespace, name, record.grant.uid)
        self._notify()


async def _preferred_choice(
    endpoint: _Endpoint,
    resource: str,
    available: Sequence[str],
    reuse: Sequence[str],
    count: int,
    *,
    who: tuple[str, str, str],
) -> tuple[tuple[str, ...], list[str]]:
    """GetPreferredAllocation asked, and the plugin's preference used as the kubelet does
    (`choose_devices`; the devices to reuse always in): (the preference, the devices chosen)."""
    request = dp.PreferredAllocationRequest(
        container_requests=[
            dp.ContainerPreferredAllocationRequest(
                available_deviceIDs=sorted({*available, *reuse}),
                must_include_deviceIDs=list(reuse),
                allocation_size=count,
            )
        ]
    )
    try:
        answer: dp.PreferredAllocationResponse = await endpoint.stub.GetPreferredAllocation(request)
    except grpc.aio.AioRpcError as e:
        raise AdmissionError(
            _unexpected(
                f"device plugin GetPreferredAllocation rpc failed with err: {_rpc_error_text(e)}"
            ),
            resource_name=resource,
        ) from e
    preferred: tuple[str, ...] = ()
    if answer.container_responses:
        preferred = tuple(answer.container_responses[0].deviceIDs)
    chosen, valid = choose_devices(sorted({*available, *reuse}), preferred, count)
    if not set(reuse) <= set(chosen):
        rest = [d for d in chosen if d not in reuse]
        chosen, valid = [*reuse, *rest[: count - len(reuse)]], False
    if not valid:
        namespace, pod, container = who
        logger.warning(
            "preferred allocation not usable as is, filling from available "
            "resource=%s pod=%s/%s container=%s size=%d preferred=%s chosen=%s",
            resource,
            namespace,
            pod,
            container,
            count,
            list(preferred),
            chosen,
        )
    return preferred, chosen
