"""The DRA kubelet plugin's gRPC side: the registration socket the kubelet's plugin watcher
finds in plugins_registry/, and the driver's own socket serving dra.v1 and dra.v1beta1
NodePrepareResources/NodeUnprepareResources (and the optional dra-health stream).

The servicers only translate: protobuf in, `ClaimRef`s to the driver, its answers back out. Both
sockets are owner-only and removed on stop; a stale socket from a daemon killed outright is
replaced at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from deviceplugin._proto.dra.v1 import api_pb2 as dra_v1
from deviceplugin._proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from deviceplugin._proto.dra.v1beta1 import api_pb2 as dra_v1beta1
from deviceplugin._proto.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from deviceplugin._proto.drahealth.v1alpha1 import api_pb2 as health_pb
from deviceplugin._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from deviceplugin._proto.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplugin._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from deviceplugin.dra.settings import PLUGIN_TYPE, SUPPORTED_VERSIONS
from deviceplugin.kubelet.sockets import remove_socket, serve_unix

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str = ""


@dataclass(frozen=True, slots=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class HealthReport:
    """One device's health for the dra-health stream."""

    pool_name: str
    device_name: str
    healthy: bool
    message: str = ""
    updated_s: int = 0


class Preparer(Protocol):
    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...
    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]: ...
    def watch_health(self) -> AsyncIterator[list[HealthReport]]: ...


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


class _DraService:
    """NodePrepareResources/NodeUnprepareResources for one API version (`pb`: its messages)."""

    def __init__(self, preparer: Preparer, pb: Any, version: str) -> None:
        self._preparer = preparer
        self._pb = pb
        self._version = version

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        pb = self._pb
        results = await self._preparer.prepare(_refs(request))
        response = pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            answer = response.claims[uid]
            if result.error:
                answer.error = result.error
                continue
            for d in result.devices:
                device = answer.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                # dra.v1beta1 has no share_id: the kubelet speaking it reads the share from
                # the claim's status.
                if d.share_id and "share_id" in pb.Device.DESCRIPTOR.fields_by_name:
                    device.share_id = d.share_id
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        pb = self._pb
        errors = await self._preparer.unprepare(_refs(request))
        response = pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        return response


class _HealthService:
    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    async def NodeWatchResources(  # noqa: N802
        self, request: Any, context: Any
    ) -> AsyncIterator[Any]:
        async for reports in self._preparer.watch_health():
            response = health_pb.NodeWatchResourcesResponse()
            for r in reports:
                response.devices.add(
                    device=health_pb.DeviceIdentifier(
                        pool_name=r.pool_name, device_name=r.device_name
                    ),
                    health=health_pb.HEALTHY if r.healthy else health_pb.UNHEALTHY,
                    last_updated_time=r.updated_s,
                    message=r.message,
                )
            yield response


@dataclass
class RegistrationState:
    """What the kubelet last said about our registration."""

    registered: bool = False
    error: str = ""
    info_requests: int = 0
    notifications: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _RegistrationService:
    def __init__(
        self,
        driver_name: str,
        endpoint: Path,
        state: RegistrationState,
        on_registered: Callable[[], None],
    ) -> None:
        self._driver = driver_name
        self._endpoint = endpoint
        self._state = state
        self._on_registered = on_registered

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._state.info_requests += 1
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._driver,
            endpoint=str(self._endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self._state
        state.notifications += 1
        state.registered = bool(request.plugin_registered)
        state.error = request.error
        if state.registered:
            log.info("registered with the kubelet driver=%s", self._driver)
            # A kubelet that starts removes its node's ResourceSlices: publish again.
            self._on_registered()
        else:
            log.error(
                "the kubelet refused the registration driver=%s error=%s",
                self._driver,
                request.error,
            )
        state.changed.set()
        state.changed = asyncio.Event()
        return reg_pb.RegistrationStatusResponse()


async def _serve(server: grpc.aio.Server, path: Path) -> None:
    if not await serve_unix(server, path):
        raise FileNotFoundError(f"{path} was removed as soon as it was made")


class PluginServers:
    """The driver's service socket and its registration socket, served until `stop`."""

    def __init__(
        self,
        preparer: Preparer,
        driver_name: str,
        service_socket: Path,
        registration_socket: Path,
        on_registered: Callable[[], None] = lambda: None,
    ) -> None:
        self._on_registered = on_registered
        self.preparer = preparer
        self.driver_name = driver_name
        self.service_socket = service_socket
        self.registration_socket = registration_socket
        self.registration = RegistrationState()
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> None:
        service = grpc.aio.server()
        dra_v1_grpc.add_DRAPluginServicer_to_server(
            _DraService(self.preparer, dra_v1, "v1"),  # type: ignore[arg-type]
            service,
        )
        dra_v1beta1_grpc.add_DRAPluginServicer_to_server(
            _DraService(self.preparer, dra_v1beta1, "v1beta1"),  # type: ignore[arg-type]
            service,
        )
        health_grpc.add_DRAResourceHealthServicer_to_server(
            _HealthService(self.preparer),  # type: ignore[arg-type]
            service,
        )
        # The service socket first: the kubelet dials it as soon as it has our registration.
        await _serve(service, self.service_socket)
        self._servers.append(service)
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(
            _RegistrationService(  # type: ignore[arg-type]
                self.driver_name, self.service_socket, self.registration, self._on_registered
            ),
            registration,
        )
        await _serve(registration, self.registration_socket)
        self._servers.append(registration)
        log.info(
            "serving the DRA plugin driver=%s socket=%s registration=%s",
            self.driver_name,
            self.service_socket,
            self.registration_socket,
        )

    async def stop(self) -> None:
        # The registration socket first: the kubelet stops sending work to a plugin it sees go.
        for server in reversed(self._servers):
            await server.stop(grace=1.0)
        self._servers.clear()
        for path in (self.registration_socket, self.service_socket):
            with contextlib.suppress(OSError):
                remove_socket(path)
