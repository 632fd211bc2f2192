"""The DRA kubelet-plugin helper: everything between a DRA driver and the kubelet, so that the
driver owns no socket (as kubernetes' own kubeletplugin helper does for the drivers built on it).

It serves the registration socket the kubelet's plugin watcher finds in plugins_registry/, and
the driver's own socket with dra.v1 and dra.v1beta1 NodePrepareResources/NodeUnprepareResources
(and the optional dra-health stream); it follows the registration: a driver the kubelet has not
registered within `REGISTRATION_WARN_S` (a wrong --kubelet-root-dir: the kubelet never finds its
socket) is said so in a WARNING, again every `REGISTRATION_WARN_S`, and fails /healthz after
`UNREGISTERED_UNHEALTHY_S`.

The servicers only translate: protobuf in, `ClaimRef`s to the driver (a `Preparer`), its answers
back out. Both sockets are served by `kubelet.sockets` (owner-only, a stale socket replaced,
anything else refused) and removed on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
from deviceplugin.kubelet.sockets import remove_socket, serve_unix
from deviceplugin.state import until_set

log = logging.getLogger(__name__)

# The plugin service versions this helper serves, as the kubelet names them.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"
# A driver the kubelet has not registered this long is warned about (and every as long again);
# /healthz fails after UNREGISTERED_UNHEALTHY_S.
REGISTRATION_WARN_S = 30.0
UNREGISTERED_UNHEALTHY_S = 60.0


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


class KubeletPlugin:
    """A driver's service socket and its registration socket, served until `stop`, and its
    registration with the kubelet followed."""

    def __init__(
        self,
        preparer: Preparer,
        driver_name: str,
        service_socket: Path,
        registration_socket: Path,
        *,
        on_registered: Callable[[], None] = lambda: None,
        hint: str = "",
    ) -> None:
        self._on_registered = on_registered
        self.preparer = preparer
        self.driver_name = driver_name
        self.service_socket = service_socket
        self.registration_socket = registration_socket
        # What to check when the kubelet never asks for the driver's info (where its root is).
        self._hint = hint
        self.registration = RegistrationState()
        self._servers: list[grpc.aio.Server] = []
        # Since when (monotonic) the kubelet has not registered the driver; 0 while it has.
        self.unregistered_since_s = 0.0

    @property
    def registered(self) -> bool:
        return self.registration.registered

    async def start(self) -> None:
        """Serve both sockets (then `follow` the registration until the daemon stops, and
        `stop`)."""
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
        self._servers.append(service)
        await _serve(service, self.service_socket)
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(
            _RegistrationService(  # type: ignore[arg-type]
                self.driver_name, self.service_socket, self.registration, self._on_registered
            ),
            registration,
        )
        self._servers.append(registration)
        await _serve(registration, self.registration_socket)
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

    def unhealthy(self, now_mono_s: float) -> str:
        """Why /healthz fails on the registration's account ("" when it does not): the kubelet
        has not registered the driver for UNREGISTERED_UNHEALTHY_S."""
        since = self.unregistered_since_s
        if not self.registered and since > 0 and now_mono_s - since > UNREGISTERED_UNHEALTHY_S:
            return (
                f"the kubelet has not registered the DRA driver for {now_mono_s - since:.1f}s "
                f"(limit {UNREGISTERED_UNHEALTHY_S:g}s): {self._unregistered_hint()}"
            )
        return ""

    def _unregistered_hint(self) -> str:
        registration = self.registration
        socket = self.registration_socket
        if registration.error:
            return f"it refused the registration: {registration.error}"
        if registration.info_requests == 0:
            return f"it never asked for the driver's info at {socket}" + (
                f"; {self._hint}" if self._hint else ""
            )
        return f"it asked for the driver's info at {socket} but never confirmed the registration"

    async def follow(self, stop: asyncio.Event) -> None:
        """A WARNING every REGISTRATION_WARN_S while the kubelet has not registered the driver,
        and `unregistered_since_s` kept for /healthz and /status."""
        self.unregistered_since_s = time.monotonic()
        state = self.registration
        while not stop.is_set():
            await until_set(stop, state.changed, REGISTRATION_WARN_S)
            if stop.is_set():
                return
            if state.registered:
                self.unregistered_since_s = 0.0
                continue
            now = time.monotonic()
            if self.unregistered_since_s == 0.0:
                self.unregistered_since_s = now
            if now - self.unregistered_since_s >= REGISTRATION_WARN_S:
                log.warning(
                    "the kubelet has not registered the DRA driver for %.0fs; claims cannot be "
                    "prepared on this node driver=%s registration_socket=%s reason=%s",
                    now - self.unregistered_since_s,
                    self.driver_name,
                    self.registration_socket,
                    self._unregistered_hint(),
                )
