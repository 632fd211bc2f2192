"""What the kubelet simulator keeps and hands out: the records of registrations, devices and
grants, the admission error, and the limits it shares with the kubelet."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.kubelet.proto import (
    DEVICE_PLUGIN_VERSION,
    HEALTHY,
    dp,
    dp_grpc,
)

SUPPORTED_VERSIONS: tuple[str, ...] = (DEVICE_PLUGIN_VERSION,)
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
DIAL_TIMEOUT_S = 10.0  # the kubelet's dial timeout for a plugin's socket
PRE_START_TIMEOUT_S = 30.0  # KubeletPreStartContainerRPCTimeoutInSecs
MAX_UNIX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"
CREATE_CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
NODE_WITHOUT_TOPOLOGY = -1  # the checkpoint's NUMA key for devices without topology


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
    # An init container's: in the checkpoint, not listed by pod-resources, and its devices
    # reused by the pod's later containers.
    init: bool = False


@dataclass(frozen=True, slots=True)
class PodGrant:
    """An admitted pod and its containers' grants, in the pod's container order."""

    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerGrant, ...]


def _check_socket_path(path: Path) -> None:
    length = len(os.fsencode(path))
    if length > MAX_UNIX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"unix socket path {path} is {length} bytes; the limit is {MAX_UNIX_SOCKET_PATH_BYTES}"
        )


def _rpc_error_text(error: grpc.aio.AioRpcError) -> str:
    """An RPC error as the kubelet's Go client prints it."""
    code = "".join(part.capitalize() for part in error.code().name.split("_"))
    return f"rpc error: code = {code} desc = {error.details()}"


def _grant_from_response(
    name: str,
    resource_name: str,
    device_ids: Sequence[str],
    response: dp.ContainerAllocateResponse,
    preferred: Sequence[str],
    *,
    init: bool = False,
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
        init=init,
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
