"""The registration server on kubelet.sock: the version and extended-resource-name checks, the
dial-back to the plugin's endpoint, its options, and the start of its ListAndWatch reader."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, cast

import grpc

from deviceplugin.kubelet.proto import (
    dp,
    dp_grpc,
)
from deviceplugin.sim.devices import DeviceLists
from deviceplugin.sim.records import (
    SUPPORTED_VERSIONS,
    RegistrationEvent,
    _check_socket_path,
    _Endpoint,
    _rpc_error_text,
)

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator

_NATIVE_RESOURCE_PREFIX = "kubernetes.io/"
_QUOTA_PREFIX = "requests."
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


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


def _join(directory: Path, name: str) -> Path:
    """Go's filepath.Join: `name` stays inside `directory` even when it starts with a slash."""
    return Path(os.path.normpath(f"{directory}/{name}"))


class Registration(DeviceLists):
    """Register calls, as the kubelet's device manager handles them."""

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
        cleanup, self._cleanup_pending = self._cleanup_pending, None
        if cleanup is not None:
            logger.info("start-up cleanup of the plugin directory, racing a registration")
            cleanup()
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


class _RegistrationServicer(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: Registration) -> None:
        self._kubelet = kubelet

    async def Register(  # noqa: N802
        self, request: dp.RegisterRequest, context: Any
    ) -> dp.Empty:
        error = await self._kubelet._register(request)
        if error:
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return dp.Empty()
