"""The DevicePlugin gRPC service (kubelet API v1beta1).

It speaks protobuf and hands every decision to the pure modules (slicing, allocation). It never
calls the GPU backend: Allocate and GetPreferredAllocation answer from the inventory in memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc

from deviceplugin.allocation import build_container_allocation
from deviceplugin.config import Config, MigStrategy
from deviceplugin.errors import AllocationError
from deviceplugin.kubelet.proto import HEALTHY, UNHEALTHY, dp, dp_grpc
from deviceplugin.logs import brief, brief_list
from deviceplugin.memlimits.cdihook import AllocationSpecs
from deviceplugin.model import AllocationRecord, ContainerAllocation, Inventory
from deviceplugin.mpsnamespaces import (
    NO_NAMESPACES,
    ContainerNamespaces,
    NamespaceRefusedError,
    provision_all,
)
from deviceplugin.preferred import preferred_allocation
from deviceplugin.state import AllocationBook, Published

log = logging.getLogger(__name__)

# An error answered to the kubelet is cut to this many characters (a request naming 100k unknown
# IDs would otherwise get them all back).
MAX_ABORT_CHARS = 2000


def device_list(inventory: Inventory) -> dp.ListAndWatchResponse:
    """The full device list the kubelet gets on every change."""
    devices = []
    for s in inventory.slices:
        topology = (
            dp.TopologyInfo(nodes=[dp.NUMANode(ID=s.numa_node)])
            if s.numa_node is not None
            else None
        )
        devices.append(
            dp.Device(ID=s.device_id, health=HEALTHY if s.healthy else UNHEALTHY, topology=topology)
        )
    return dp.ListAndWatchResponse(devices=devices)


def allocate_response(allocation: ContainerAllocation) -> dp.ContainerAllocateResponse:
    return dp.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[
            dp.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        devices=[
            dp.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in allocation.devices
        ],
        annotations=dict(allocation.annotations),
        cdi_devices=[dp.CDIDevice(name=name) for name in allocation.cdi_devices],
    )


class DevicePluginService(dp_grpc.DevicePluginServicer):
    """One instance per daemon; it outlives gRPC server restarts.

    `on_stream_end(generation)` is called when a ListAndWatch stream opened under registration
    `generation` ends while the daemon is not stopping: the kubelet never re-opens a stream, so
    the life cycle registers again.
    """

    def __init__(
        self,
        config: Config,
        inventory: Published[Inventory],
        book: AllocationBook,
        *,
        generation: Callable[[], int] = lambda: 0,
        on_stream_end: Callable[[int], None] = lambda generation: None,
        clock: Callable[[], float] = time.time,
        on_allocate_duration: Callable[[float], None] = lambda seconds: None,
        on_allocated: Callable[[], None] = lambda: None,
        resource_name: str = "",
        hook_specs: AllocationSpecs | None = None,
        mps_namespaces: ContainerNamespaces = NO_NAMESPACES,
    ) -> None:
        self._config = config
        # The CDI specs that carry each allocation's memory-limit hook (docs/design.md §15).
        self._hook_specs = hook_specs
        # Under MPS v3, each container's namespace, made before Allocate answers.
        self._mps_namespaces = mps_namespaces
        self._resource_name = resource_name
        self._inventory = inventory
        self._book = book
        self._generation = generation
        self._on_stream_end = on_stream_end
        self._clock = clock
        self._on_allocate_duration = on_allocate_duration
        self._on_allocated = on_allocated
        self.stopping = False
        self.open_streams = 0
        # The registration generation of the last ListAndWatch stream the kubelet opened.
        self.opened_generation = -1
        # Device lists sent on any stream, in all (the daemon starts its enforcer after the first).
        self.lists_sent = 0

    def reconfigure(self, config: Config) -> None:
        """Answer with `config`'s allocation settings from the next call on (a live reload)."""
        self._config = config

    async def GetDevicePluginOptions(  # noqa: N802 (the kubelet's method name)
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(  # noqa: N802
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        generation = self._generation()
        # The kubelet opens one stream right after it accepts a registration: the first stream of
        # a registration is the kubelet's. Another (a debugging grpcurl) may come and go freely.
        kubelets = self.opened_generation != generation
        self.opened_generation = generation
        self.open_streams += 1
        log.info("ListAndWatch stream opened generation=%d kubelet=%s", generation, kubelets)
        sent_version = -1
        try:
            while True:
                inventory, version = self._inventory.value, self._inventory.version
                if version != sent_version:
                    sent_version = version
                    healthy = sum(1 for s in inventory.slices if s.healthy)
                    log.info(
                        "sending device list devices=%d healthy=%d generation=%d",
                        len(inventory.slices),
                        healthy,
                        generation,
                    )
                    yield device_list(inventory)
                    self.lists_sent += 1  # gRPC asks for the next one once this one is sent
                await self._inventory.wait_change(sent_version)
        finally:
            self.open_streams -= 1
            if not self.stopping and kubelets:
                log.warning("ListAndWatch stream ended generation=%d", generation)
                self._on_stream_end(generation)
            elif not self.stopping:
                log.info(
                    "a ListAndWatch stream other than the kubelet's ended generation=%d", generation
                )

    async def GetPreferredAllocation(  # noqa: N802
        self, request: dp.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        inventory = self._inventory.value
        responses = []
        for i, req in enumerate(request.container_requests):
            try:
                ids = preferred_allocation(
                    inventory,
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                    self._config.allocation.policy,
                )
            except AllocationError as e:
                log.warning(
                    "preferred allocation refused container_request=%d error=%s", i, brief(str(e))
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"container request {i}: {brief(str(e), MAX_ABORT_CHARS)}",
                )
            responses.append(dp.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return dp.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(  # noqa: N802
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> dp.AllocateResponse:
        started = time.perf_counter()
        inventory = self._inventory.value
        allocations: list[ContainerAllocation] = []
        for i, req in enumerate(request.container_requests):
            try:
                allocations.append(
                    build_container_allocation(
                        list(req.devices_ids),
                        inventory,
                        self._config.allocation,
                        self._config.mps,
                        several_resources=self._config.mig.strategy == MigStrategy.MIXED,
                        limit_per_slice=self._config.memory_limits.limit_per_slice(
                            self._resource_name or self._config.resource_name
                        ),
                    )
                )
            except AllocationError as e:
                log.warning(
                    "allocate refused container_request=%d devices=%s error=%s",
                    i,
                    brief_list(req.devices_ids),
                    brief(str(e)),
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"container request {i}: {brief(str(e), MAX_ABORT_CHARS)}",
                )
        allocations = await self._with_mps_namespaces(allocations, inventory, context)
        now = self._clock()
        for allocation in allocations:
            self._book.allocated(
                AllocationRecord(
                    allocation.allocation_id,
                    allocation.slice_ids,
                    now,
                    resource_name=self._resource_name,
                    grants=allocation.grants,
                )
            )
            log.info(
                "allocated allocation_id=%s slices=%s gpus=%s",
                allocation.allocation_id,
                brief_list(allocation.slice_ids),
                brief_list(allocation.gpu_uuids),
            )
        # What each container was granted is kept before it gets it (deviceplugin.grants), and
        # the spec of the hook that sets its memory limits written.
        allocations = await self._with_limit_hooks(allocations, context)
        await self._book.kept()
        response = dp.AllocateResponse(
            container_responses=[allocate_response(a) for a in allocations]
        )
        self._on_allocate_duration(time.perf_counter() - started)
        self._on_allocated()
        return response

    async def _with_limit_hooks(
        self, allocations: list[ContainerAllocation], context: grpc.aio.ServicerContext
    ) -> list[ContainerAllocation]:
        """Each allocation on a GPU whose driver enforces memory with the CDI device of its
        memory-limit hook, its spec written first (off the event loop). A spec that cannot be
        written fails the call: the limit would not be applied."""
        specs = self._hook_specs
        if specs is None:
            return allocations
        hooked: list[ContainerAllocation] = []
        for a in allocations:
            try:
                name = await asyncio.to_thread(specs.write, a.allocation_id, a.gpu_uuids)
            except OSError as e:
                log.error(
                    "allocate failed: the memory-limit hook's CDI spec cannot be written "
                    "allocation_id=%s cdi_dir=%s error=%s",
                    a.allocation_id,
                    specs.cdi_dir,
                    e,
                )
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"the CDI spec of allocation {a.allocation_id}'s memory-limit hook cannot be "
                    f"written in {specs.cdi_dir}: {e}",
                )
            hooked.append(a if name is None else replace(a, cdi_devices=(*a.cdi_devices, name)))
        return hooked

    async def _with_mps_namespaces(
        self,
        allocations: list[ContainerAllocation],
        inventory: Inventory,
        context: grpc.aio.ServicerContext,
    ) -> list[ContainerAllocation]:
        """Under MPS v3, each container's answer with its own namespace (deviceplugin.
        mpsnamespaces); a container that cannot have one is refused, with the whole call."""
        config = self._config
        try:
            return await provision_all(
                allocations, self._mps_namespaces, inventory, config.allocation, config.mps
            )
        except NamespaceRefusedError as e:
            log.warning("allocate refused: no MPS namespace error=%s", brief(str(e)))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, brief(str(e), MAX_ABORT_CHARS))
            raise  # abort raises; for the type checker

    async def PreStartContainer(  # noqa: N802
        self, request: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreStartContainerResponse:
        # Nothing to prepare before a start (the options say so); answer for any caller that asks
        # anyway, refusing IDs this node never advertised.
        inventory = self._inventory.value
        unknown = [d for d in request.devices_ids if d not in inventory.by_id]
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown device IDs: " + ", ".join(repr(d) for d in unknown),
            )
        return dp.PreStartContainerResponse()
