"""The kubelet's side of the device-plugin and pod-resources APIs, for the demo and black-box tests.

It follows the kubelet's device manager (pkg/kubelet/cm/devicemanager) so that a plugin which works
against it behaves the same against a real kubelet:

- start: remove stale files from the plugin directory except the checkpoint, serve `kubelet.sock`.
- Register: check the version and the extended resource name, dial the plugin back on
  `<dir>/<endpoint>` (10 s), ask for its options (the request's own options are ignored), then read
  ListAndWatch in the background. Every list replaces the previous one; when the stream ends, every
  device of that resource turns unhealthy and the stream is never reopened by the kubelet side.
- Admission: per container, the free healthy devices; GetPreferredAllocation when offered
  (advisory); one Allocate with one ContainerAllocateRequest; PreStartContainer when required
  (30 s). Grants are kept in memory and in the checkpoint file, so they survive a restart.
- pod-resources v1: List, GetAllocatableResources and Get.

Everything runs on one asyncio event loop with grpc.aio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import inspect
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from deviceplugin.kubelet.proto import (
    DEVICE_PLUGIN_VERSION,
    HEALTHY,
    KUBELET_SOCKET,
    UNHEALTHY,
    dp,
    dp_grpc,
    podres,
    podres_grpc,
)

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS: tuple[str, ...] = (DEVICE_PLUGIN_VERSION,)
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
DIAL_TIMEOUT_S = 10.0  # the kubelet's dial timeout for a plugin's socket
PRE_START_TIMEOUT_S = 30.0  # KubeletPreStartContainerRPCTimeoutInSecs
MAX_UNIX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"
CREATE_CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
NODE_WITHOUT_TOPOLOGY = -1  # the checkpoint's NUMA key for devices without topology

_NATIVE_RESOURCE_PREFIX = "kubernetes.io/"
_QUOTA_PREFIX = "requests."
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


class AdmissionError(Exception):
    """The kubelet refused a pod: `reason` as the pod status shows it, `message` its text."""

    def __init__(
        self, message: str, *, reason: str = UNEXPECTED_ADMISSION_ERROR, resource_name: str = ""
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.resource_name = resource_name


@dataclass(frozen=True, slots=True)
class RegistrationEvent:
    """One Register call as the kubelet saw it; `error` is empty when accepted."""

    time_s: float
    resource_name: str
    endpoint: str
    version: str
    accepted: bool
    error: str


@dataclass(frozen=True, slots=True)
class DeviceState:
    """One device from the latest ListAndWatch list."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass(frozen=True, slots=True)
class ContainerGrant:
    """What one container received: its devices and the plugin's Allocate answer for it."""

    name: str
    resource_name: str
    device_ids: tuple[str, ...]
    envs: dict[str, str]
    mounts: tuple[tuple[str, str, bool], ...]  # (container_path, host_path, read_only)
    devices: tuple[tuple[str, str, str], ...]  # (container_path, host_path, permissions)
    annotations: dict[str, str]
    cdi_devices: tuple[str, ...]
    preferred: tuple[str, ...]  # the GetPreferredAllocation answer; () when not asked


@dataclass(frozen=True, slots=True)
class PodGrant:
    """An admitted pod and its containers' grants, in the pod's container order."""

    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerGrant, ...]


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's IsExtendedResourceName: `domain/name`, not in kubernetes.io, quota-valid."""
    if "/" not in name or _NATIVE_RESOURCE_PREFIX in name or name.startswith(_QUOTA_PREFIX):
        return False
    parts = (_QUOTA_PREFIX + name).split("/")
    if len(parts) != 2:
        return False
    prefix, short = parts
    return (
        0 < len(prefix) <= 253
        and _DNS1123_SUBDOMAIN.fullmatch(prefix) is not None
        and 0 < len(short) <= 63
        and _QUALIFIED_NAME.fullmatch(short) is not None
    )


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


def _check_socket_path(path: Path) -> None:
    length = len(os.fsencode(path))
    if length > MAX_UNIX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"unix socket path {path} is {length} bytes; the limit is {MAX_UNIX_SOCKET_PATH_BYTES}"
        )


def _owner_only(path: Path) -> None:
    path.chmod(0o600)


def _join(directory: Path, name: str) -> Path:
    """Go's filepath.Join: `name` stays inside `directory` even when it starts with a slash."""
    return Path(os.path.normpath(f"{directory}/{name}"))


def _rpc_error_text(error: grpc.aio.AioRpcError) -> str:
    """An RPC error as the kubelet's Go client prints it."""
    code = "".join(part.capitalize() for part in error.code().name.split("_"))
    return f"rpc error: code = {code} desc = {error.details()}"


def _unexpected(cause: str) -> str:
    return f"Allocate failed due to {cause}, which is unexpected"


def _describe(predicate: Callable[[], bool]) -> str:
    try:
        source = " ".join(inspect.getsource(predicate).split())
    except (OSError, TypeError):
        return repr(predicate)
    return source[source.find("lambda") :] if "lambda" in source else source


def _grant_from_response(
    name: str,
    resource_name: str,
    device_ids: Sequence[str],
    response: dp.ContainerAllocateResponse,
    preferred: Sequence[str],
) -> ContainerGrant:
    return ContainerGrant(
        name=name,
        resource_name=resource_name,
        device_ids=tuple(device_ids),
        envs=dict(response.envs),
        mounts=tuple((m.container_path, m.host_path, m.read_only) for m in response.mounts),
        devices=tuple((d.container_path, d.host_path, d.permissions) for d in response.devices),
        annotations=dict(response.annotations),
        cdi_devices=tuple(c.name for c in response.cdi_devices),
        preferred=tuple(preferred),
    )


def _response_from_grant(grant: ContainerGrant) -> dp.ContainerAllocateResponse:
    return dp.ContainerAllocateResponse(
        envs=grant.envs,
        mounts=[dp.Mount(container_path=c, host_path=h, read_only=r) for c, h, r in grant.mounts],
        devices=[
            dp.DeviceSpec(container_path=c, host_path=h, permissions=p) for c, h, p in grant.devices
        ],
        annotations=grant.annotations,
        cdi_devices=[dp.CDIDevice(name=n) for n in grant.cdi_devices],
    )


@dataclass(eq=False)
class _Endpoint:
    """A registered plugin: the channel the kubelet dialled, its options and its stream."""

    resource_name: str
    endpoint: str
    socket_path: Path
    channel: Any  # grpc.aio.Channel
    stub: dp_grpc.DevicePluginAsyncStub
    options: dp.DevicePluginOptions
    task: asyncio.Task[None] | None = None
    stream_open: bool = False
    stopped: bool = False
    updates: int = 0


@dataclass
class _PodRecord:
    grant: PodGrant
    numa_nodes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # at allocation time


class KubeletSimulator:
    """A kubelet for one node: registration, device lists, admission and pod-resources."""

    def __init__(
        self,
        device_plugin_dir: Path,
        pod_resources_socket: Path | None = None,
        *,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        pre_start_timeout_s: float = PRE_START_TIMEOUT_S,
    ) -> None:
        self._dir = Path(device_plugin_dir).absolute()
        self._socket = self._dir / KUBELET_SOCKET
        self._pod_resources_socket = (
            Path(pod_resources_socket).absolute() if pod_resources_socket is not None else None
        )
        _check_socket_path(self._socket)
        if self._pod_resources_socket is not None:
            _check_socket_path(self._pod_resources_socket)
        self._dial_timeout_s = dial_timeout_s
        self._pre_start_timeout_s = pre_start_timeout_s
        self.registrations: list[RegistrationEvent] = []
        self._endpoints: dict[str, _Endpoint] = {}
        self._devices: dict[str, dict[str, DeviceState]] = {}
        self._healthy: dict[str, set[str]] = {}
        self._unhealthy: dict[str, set[str]] = {}
        self._pods: dict[tuple[str, str], _PodRecord] = {}
        self._servers: list[Any] = []  # grpc.aio.Server
        self._created_sockets: list[Path] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._admission = asyncio.Lock()
        self._running = False

    # --- life cycle ----------------------------------------------------------------------------

    @property
    def device_plugin_dir(self) -> Path:
        return self._dir

    @property
    def kubelet_socket(self) -> Path:
        return self._socket

    @property
    def pod_resources_socket(self) -> Path | None:
        return self._pod_resources_socket

    @property
    def checkpoint_path(self) -> Path:
        return self._dir / CHECKPOINT_FILE

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Read the checkpoint, clean the plugin directory, serve Registration and pod-resources."""
        if self._running:
            raise RuntimeError("kubelet simulator already running")
        self._dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._read_checkpoint()
        self._cleanup_plugin_directory()
        # Running from before the first socket exists: a plugin may register at once.
        self._running = True
        try:
            server = grpc.aio.server()
            dp_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
            await self._serve(server, self._socket)
            if self._pod_resources_socket is not None:
                self._pod_resources_socket.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
                self._pod_resources_socket.unlink(missing_ok=True)
                server = grpc.aio.server()
                podres_grpc.add_PodResourcesListerServicer_to_server(
                    _PodResourcesServicer(self), server
                )
                await self._serve(server, self._pod_resources_socket)
        except BaseException:
            self._running = False
            await self._stop_servers()
            raise
        logger.info(
            "kubelet started socket=%s pod_resources_socket=%s pods=%d",
            self._socket,
            self._pod_resources_socket,
            len(self._pods),
        )
        self._notify()

    async def stop(self) -> None:
        """Exit like the kubelet: servers closed, plugin streams cancelled, own sockets removed."""
        if not self._running:
            return
        self._running = False
        await self._stop_servers()
        for endpoint in list(self._endpoints.values()):
            await self._close_endpoint(endpoint)
        self._endpoints.clear()
        logger.info("kubelet stopped dir=%s", self._dir)
        self._notify()

    async def restart(self) -> None:
        """Stop, then start again: sockets are cleaned and recreated, the checkpoint is reloaded."""
        logger.info("kubelet restarting dir=%s", self._dir)
        await self.stop()
        await self.start()

    async def _serve(self, server: Any, socket_path: Path) -> None:
        self._servers.append(server)
        server.add_insecure_port(f"unix://{socket_path}")
        await server.start()
        self._created_sockets.append(socket_path)
        _owner_only(socket_path)

    async def _stop_servers(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(grace=None)
        sockets, self._created_sockets = self._created_sockets, []
        for path in sockets:
            path.unlink(missing_ok=True)

    def _cleanup_plugin_directory(self) -> None:
        """CleanupPluginDirectory: remove every non-directory entry except the checkpoint."""
        checkpoint = self.checkpoint_path
        for entry in os.scandir(self._dir):
            path = Path(entry.path)
            if path == checkpoint:
                continue
            try:
                if path.is_dir():
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.error("cannot remove stale file path=%s error=%s", path, e)
                continue
            logger.debug("removed stale file path=%s", path)

    # --- registration ----------------------------------------------------------------------------

    async def _register(self, request: dp.RegisterRequest) -> str:
        """Handle one Register call; the error text, or "" when the plugin was connected."""
        resource, endpoint_name, version = request.resource_name, request.endpoint, request.version
        logger.info(
            "registration request resource=%s endpoint=%s version=%s",
            resource,
            endpoint_name,
            version,
        )
        error = ""
        if version not in SUPPORTED_VERSIONS:
            supported = "[" + " ".join(f'"{v}"' for v in SUPPORTED_VERSIONS) + "]"
            error = (
                f'requested API version "{version}" is not supported by kubelet. '
                f"Supported version is {supported}"
            )
        elif not is_extended_resource_name(resource):
            error = f'the ResourceName "{resource}" is invalid'
        endpoint: _Endpoint | None = None
        if not error:
            endpoint, error = await self._connect(resource, endpoint_name)
        if endpoint is None:
            self._record(request, error)
            logger.info(
                "registration refused resource=%s endpoint=%s error=%r",
                resource,
                endpoint_name,
                error,
            )
            return error
        previous = self._endpoints.get(resource)
        self._endpoints[resource] = endpoint
        if previous is not None:
            await self._close_endpoint(previous)
        task = asyncio.create_task(self._consume(endpoint), name=f"list-and-watch {resource}")
        endpoint.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._record(request, "")
        logger.info(
            "registration accepted resource=%s endpoint=%s pre_start_required=%s "
            "get_preferred_allocation_available=%s replaced=%s",
            resource,
            endpoint_name,
            endpoint.options.pre_start_required,
            endpoint.options.get_preferred_allocation_available,
            previous is not None,
        )
        return ""

    async def _connect(self, resource: str, endpoint_name: str) -> tuple[_Endpoint | None, str]:
        """Dial the plugin back and read its options, as the kubelet's client Connect does."""
        socket_path = _join(self._dir, endpoint_name)
        if not endpoint_name:
            return None, "failed to dial device plugin: empty endpoint"
        try:
            _check_socket_path(socket_path)
        except ValueError as e:
            return None, f"failed to dial device plugin: {e}"
        channel = grpc.aio.insecure_channel(
            f"unix://{socket_path}", options=[("grpc.default_authority", "localhost")]
        )
        connected = False
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self._dial_timeout_s)
            except TimeoutError:
                return None, (
                    f"failed to dial device plugin: context deadline exceeded "
                    f"(no plugin serving {socket_path} within {self._dial_timeout_s:g}s)"
                )
            stub = cast("dp_grpc.DevicePluginAsyncStub", dp_grpc.DevicePluginStub(channel))
            try:
                options: dp.DevicePluginOptions = await stub.GetDevicePluginOptions(dp.Empty())
            except grpc.aio.AioRpcError as e:
                return None, f"failed to get device plugin options: {_rpc_error_text(e)}"
            if not self._running:
                return None, "kubelet is shutting down"
            connected = True
            return _Endpoint(resource, endpoint_name, socket_path, channel, stub, options), ""
        finally:
            if not connected:
                await channel.close()

    def _record(self, request: dp.RegisterRequest, error: str) -> None:
        self.registrations.append(
            RegistrationEvent(
                time_s=time.monotonic(),
                resource_name=request.resource_name,
                endpoint=request.endpoint,
                version=request.version,
                accepted=not error,
                error=error,
            )
        )
        self._notify()

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

    # --- observation -----------------------------------------------------------------------------

    def is_registered(self, resource_name: str) -> bool:
        """A plugin is connected for the resource and its ListAndWatch stream has delivered a list
        and is still open."""
        endpoint = self._endpoints.get(resource_name)
        return (
            self._running and endpoint is not None and not endpoint.stopped and endpoint.stream_open
        )

    def devices(self, resource_name: str) -> dict[str, DeviceState]:
        return dict(self._devices.get(resource_name, {}))

    def healthy_ids(self, resource_name: str) -> set[str]:
        return set(self._healthy.get(resource_name, set()))

    def unhealthy_ids(self, resource_name: str) -> set[str]:
        return set(self._unhealthy.get(resource_name, set()))

    def capacity(self, resource_name: str) -> int:
        """Node capacity as the kubelet reports it: healthy plus unhealthy devices."""
        return len(self._healthy.get(resource_name, ())) + len(
            self._unhealthy.get(resource_name, ())
        )

    def allocatable(self, resource_name: str) -> int:
        """Node allocatable as the kubelet reports it: the healthy devices."""
        return len(self._healthy.get(resource_name, ()))

    def allocated_ids(self, resource_name: str) -> set[str]:
        """Devices held by admitted pods' containers."""
        return {
            device_id
            for record in self._pods.values()
            for container in record.grant.containers
            if container.resource_name == resource_name
            for device_id in container.device_ids
        }

    def list_and_watch_updates(self, resource_name: str) -> int:
        """How many lists the current endpoint of the resource has delivered."""
        endpoint = self._endpoints.get(resource_name)
        return endpoint.updates if endpoint is not None else 0

    def options(self, resource_name: str) -> dp.DevicePluginOptions | None:
        """The options GetDevicePluginOptions returned for the current endpoint."""
        endpoint = self._endpoints.get(resource_name)
        if endpoint is None:
            return None
        copy = dp.DevicePluginOptions()
        copy.CopyFrom(endpoint.options)
        return copy

    def pods(self) -> list[PodGrant]:
        return [record.grant for record in self._pods.values()]

    def get_pod(self, namespace: str, name: str) -> PodGrant | None:
        record = self._pods.get((namespace, name))
        return record.grant if record is not None else None

    async def wait_for(
        self, predicate: Callable[[], bool], timeout_s: float = 5.0, what: str | None = None
    ) -> None:
        """Wait until `predicate()` holds, re-checking on every state change."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"timed out after {timeout_s:g}s waiting for {what or _describe(predicate)} "
                    f"({self._summary()})"
                )
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _summary(self) -> str:
        resources = sorted(set(self._endpoints) | set(self._healthy))
        parts = [
            f"{r}: registered={self.is_registered(r)} healthy={len(self._healthy.get(r, ()))} "
            f"unhealthy={len(self._unhealthy.get(r, ()))} updates={self.list_and_watch_updates(r)}"
            for r in resources
        ]
        return f"running={self._running}; " + ("; ".join(parts) or "no resources")

    # --- admission -------------------------------------------------------------------------------

    async def admit_pod(
        self,
        name: str,
        containers: Sequence[tuple[str, int | Mapping[str, int]]],
        resource_name: str = "nvidia.com/vgpu",
        namespace: str = "default",
    ) -> PodGrant:
        """Admit a pod whose containers each request `count` devices of `resource_name`, or
        `{resource: count, ...}` of several resources, then start them. As the kubelet does, each
        resource of a container is allocated by its own plugin, in resource name order, and the
        pod gets one grant per container and resource. All or nothing: on any failure nothing of
        the pod is kept."""
        if not self._running:
            raise RuntimeError("kubelet simulator is not running")
        names = [container for container, _ in containers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate container names in pod {namespace}/{name}: {names}")
        requests: list[tuple[str, str, int]] = []
        for container, request in containers:
            if isinstance(request, int):
                requests.append((container, resource_name, request))
            elif not request:
                requests.append((container, resource_name, 0))
            else:
                requests.extend((container, r, n) for r, n in sorted(request.items()))
        if any(count < 0 for _, _, count in requests):
            raise ValueError(f"negative device request in pod {namespace}/{name}: {containers}")
        async with self._admission:
            if (namespace, name) in self._pods:
                raise ValueError(f"pod {namespace}/{name} already exists")
            uid = str(uuid.uuid4())
            taken: list[str] = []
            grants: list[ContainerGrant] = []
            numa_nodes: dict[str, tuple[int, ...]] = {}
            try:
                for container, resource, count in requests:
                    if count == 0:
                        grants.append(
                            ContainerGrant(container, resource, (), {}, (), (), {}, (), ())
                        )
                        continue
                    grant = await self._allocate_container(
                        namespace=namespace,
                        pod=name,
                        container=container,
                        resource=resource,
                        count=count,
                        taken=taken,
                    )
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
    ) -> ContainerGrant:
        """devicesToAllocate, the preference and Allocate for one container."""
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
        if len(available) < count:
            raise AdmissionError(
                _unexpected(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {count}, Available: {len(available)}"
                ),
                resource_name=resource,
            )
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
        preferred: tuple[str, ...] = ()
        if endpoint.options.get_preferred_allocation_available:
            request = dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=[],
                        allocation_size=count,
                    )
                ]
            )
            try:
                answer: dp.PreferredAllocationResponse = await endpoint.stub.GetPreferredAllocation(
                    request
                )
            except grpc.aio.AioRpcError as e:
                raise AdmissionError(
                    _unexpected(
                        f"device plugin GetPreferredAllocation rpc failed with err: "
                        f"{_rpc_error_text(e)}"
                    ),
                    resource_name=resource,
                ) from e
            if answer.container_responses:
                preferred = tuple(answer.container_responses[0].deviceIDs)
            chosen, valid = choose_devices(available, preferred, count)
            if not valid:
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
        else:
            chosen = available[:count]
        taken.extend(chosen)
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

    # --- checkpoint ------------------------------------------------------------------------------

    def _write_checkpoint(self) -> None:
        """Write the checkpoint: the kubelet's PodDeviceEntries and RegisteredDevices, plus the
        pods' names and container order that the kubelet otherwise gets from the API server."""
        entries: list[dict[str, Any]] = []
        pods: list[dict[str, Any]] = []
        for record in self._pods.values():
            pod = record.grant
            pods.append(
                {
                    "Namespace": pod.namespace,
                    "Name": pod.name,
                    "UID": pod.uid,
                    "Containers": [
                        {
                            "Name": c.name,
                            "ResourceName": c.resource_name,
                            "DeviceIDs": list(c.device_ids),
                            "Preferred": list(c.preferred),
                        }
                        for c in pod.containers
                    ],
                }
            )
            for container in pod.containers:
                if not container.device_ids:
                    continue
                by_node: dict[str, list[str]] = {}
                for device_id in container.device_ids:
                    for node in record.numa_nodes.get(device_id) or (NODE_WITHOUT_TOPOLOGY,):
                        by_node.setdefault(str(node), []).append(device_id)
                entries.append(
                    {
                        "PodUID": pod.uid,
                        "ContainerName": container.name,
                        "ResourceName": container.resource_name,
                        "DeviceIDs": by_node,
                        "AllocResp": base64.b64encode(
                            _response_from_grant(container).SerializeToString(deterministic=True)
                        ).decode(),
                    }
                )
        data = {
            "PodDeviceEntries": entries,
            "RegisteredDevices": {r: sorted(ids) for r, ids in sorted(self._healthy.items())},
            "Pods": pods,
        }
        document = {"Data": data, "Checksum": _checksum(data)}
        path = self.checkpoint_path
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(document, indent=1))
        os.replace(temporary, path)

    def _read_checkpoint(self) -> None:
        """Reset the in-memory state to what a fresh kubelet knows: the checkpoint's pods, and its
        registered resources with no devices until their plugins register again."""
        self._endpoints.clear()
        self._devices.clear()
        self._healthy.clear()
        self._unhealthy.clear()
        self._pods.clear()
        path = self.checkpoint_path
        if not path.exists():
            return
        try:
            document = json.loads(path.read_text())
            data = document["Data"]
            if document.get("Checksum") != _checksum(data):
                raise ValueError("checksum mismatch")
            pods = _pods_from_checkpoint(data)
            registered = [str(r) for r in data["RegisteredDevices"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, DecodeError) as e:
            logger.warning(
                "continuing after failing to read the checkpoint path=%s error=%s", path, e
            )
            return
        self._pods = pods
        for resource in registered:
            self._healthy[resource] = set()
            self._unhealthy[resource] = set()
        logger.info(
            "checkpoint read path=%s pods=%d resources=%s", path, len(pods), sorted(registered)
        )


def _checksum(data: Any) -> int:
    return zlib.crc32(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def _pods_from_checkpoint(data: dict[str, Any]) -> dict[tuple[str, str], _PodRecord]:
    entries: dict[tuple[str, str, str], dict[str, Any]] = {
        (str(e["PodUID"]), str(e["ContainerName"]), str(e["ResourceName"])): e
        for e in data["PodDeviceEntries"]
    }
    records: dict[tuple[str, str], _PodRecord] = {}
    for pod in data["Pods"]:
        uid = str(pod["UID"])
        numa_nodes: dict[str, tuple[int, ...]] = {}
        containers: list[ContainerGrant] = []
        for container in pod["Containers"]:
            name, resource = str(container["Name"]), str(container["ResourceName"])
            device_ids = [str(d) for d in container["DeviceIDs"]]
            preferred = [str(d) for d in container["Preferred"]]
            entry = entries.get((uid, name, resource))
            if entry is None:
                if device_ids:
                    raise ValueError(f"no device entry for pod {uid} container {name}")
                containers.append(ContainerGrant(name, resource, (), {}, (), (), {}, (), ()))
                continue
            for node_text, ids in entry["DeviceIDs"].items():
                node = int(node_text)
                for device_id in ids:
                    if node != NODE_WITHOUT_TOPOLOGY:
                        numa_nodes[str(device_id)] = (*numa_nodes.get(str(device_id), ()), node)
            response = dp.ContainerAllocateResponse.FromString(
                base64.b64decode(entry["AllocResp"], validate=True)
            )
            containers.append(_grant_from_response(name, resource, device_ids, response, preferred))
        grant = PodGrant(str(pod["Namespace"]), str(pod["Name"]), uid, tuple(containers))
        records[(grant.namespace, grant.name)] = _PodRecord(grant, numa_nodes)
    return records


# --- gRPC servicers ------------------------------------------------------------------------------


class _RegistrationServicer(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletSimulator) -> None:
        self._kubelet = kubelet

    async def Register(  # noqa: N802
        self, request: dp.RegisterRequest, context: Any
    ) -> dp.Empty:
        error = await self._kubelet._register(request)
        if error:
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return dp.Empty()


class _PodResourcesServicer(podres_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: KubeletSimulator) -> None:
        self._kubelet = kubelet

    async def List(  # noqa: N802
        self, request: podres.ListPodResourcesRequest, context: Any
    ) -> podres.ListPodResourcesResponse:
        return podres.ListPodResourcesResponse(
            pod_resources=[self._pod(record) for record in self._kubelet._pods.values()]
        )

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
        if record is None:
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


# --- command line --------------------------------------------------------------------------------


LOG_LEVELS = ("debug", "info", "warning", "error")
_POD = re.compile(r"(?:([a-z0-9][-a-z0-9]*)/)?([a-z0-9][-a-z0-9.]*):(.+)")
_CONTAINER = re.compile(r"([a-z0-9][-a-z0-9]*)=(\d+)")


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod to admit from the command line: `--pod NAMESPACE/NAME:CONTAINER=N[,CONTAINER=N]`."""

    namespace: str
    name: str
    containers: tuple[tuple[str, int], ...]

    @property
    def devices(self) -> int:
        return sum(count for _, count in self.containers)


def parse_pod_request(text: str) -> PodRequest:
    """`default/train:trainer=2`, `train:trainer=2` (namespace default) or
    `ml/serve:api=1,sidecar=0`; ValueError naming the problem otherwise."""
    expected = "expected NAMESPACE/NAME:CONTAINER=N[,CONTAINER=N...], e.g. default/train:trainer=2"
    found = _POD.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"{text!r}: {expected}")
    containers = []
    for part in found.group(3).split(","):
        container = _CONTAINER.fullmatch(part.strip())
        if container is None:
            raise ValueError(f"{text!r}: container {part!r} is not CONTAINER=N ({expected})")
        containers.append((container.group(1), int(container.group(2))))
    names = [name for name, _ in containers]
    if len(set(names)) != len(names):
        raise ValueError(f"{text!r}: a container is named twice")
    return PodRequest(found.group(1) or "default", found.group(2), tuple(containers))


def _pod_argument(text: str) -> PodRequest:
    try:
        return parse_pod_request(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.lower()


async def _admit_when_registered(
    kubelet: KubeletSimulator,
    pods: Sequence[PodRequest],
    resource_name: str,
    stop: asyncio.Event,
    out: Any,
) -> None:
    """Admit `pods` in order once the plugin of `resource_name` lists enough healthy devices,
    and print what each container got."""
    needed = sum(pod.devices for pod in pods)
    announced = False
    while len(kubelet.healthy_ids(resource_name)) < needed:
        if not announced:
            print(f"waiting for {needed} healthy devices of {resource_name}", file=out, flush=True)
            announced = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
        if stop.is_set():
            return
    for pod in pods:
        try:
            grant = await kubelet.admit_pod(
                pod.name, pod.containers, resource_name=resource_name, namespace=pod.namespace
            )
        except AdmissionError as e:
            print(f"refused {pod.namespace}/{pod.name}: {e.reason}: {e.message}", file=out)
            continue
        for container in grant.containers:
            envs = " ".join(f"{k}={v}" for k, v in sorted(container.envs.items()))
            devices = ",".join(container.device_ids) or "none"
            print(
                f"admitted {pod.namespace}/{pod.name}/{container.name}: devices {devices}"
                + (f" env {envs}" if envs else ""),
                file=out,
                flush=True,
            )


async def _run(
    directory: Path,
    pod_resources_socket: Path | None,
    pods: Sequence[PodRequest] = (),
    resource_name: str = "nvidia.com/vgpu",
) -> None:
    kubelet = KubeletSimulator(directory, pod_resources_socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    await kubelet.start()
    try:
        if pods:
            await _admit_when_registered(kubelet, pods, resource_name, stop, sys.stdout)
        await stop.wait()
    finally:
        await kubelet.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deviceplugin.sim",
        description="Run the kubelet simulator until SIGINT or SIGTERM: the registration "
        "server in DIR, the pod-resources API, and the pods given with --pod, admitted once "
        "a plugin has registered enough devices.",
    )
    parser.add_argument(
        "--dir", type=Path, required=True, help="the device-plugin directory (kubelet.sock)"
    )
    parser.add_argument(
        "--pod-resources-socket", type=Path, default=None, help="serve pod-resources v1 here"
    )
    parser.add_argument(
        "--pod",
        dest="pods",
        action="append",
        type=_pod_argument,
        default=[],
        metavar="NAMESPACE/NAME:CONTAINER=N",
        help="admit this pod, each container asking for N devices (repeatable; several "
        "containers: c1=1,c2=2; the namespace defaults to default)",
    )
    parser.add_argument(
        "--resource",
        default="nvidia.com/vgpu",
        help="the resource --pod asks for (default: nvidia.com/vgpu)",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="info",
        metavar="|".join(LOG_LEVELS),
        help="the least severe lines written (default: info)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        asyncio.run(_run(args.dir, args.pod_resources_socket, args.pods, args.resource))
    except (ValueError, OSError) as e:
        logger.error("kubelet simulator failed error=%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
