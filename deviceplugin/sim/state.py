"""The kubelet simulator's state and what a test or the demo observes of it: registrations,
device lists, health, pods, and `wait_for` a condition on them."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deviceplugin.kubelet.proto import (
    KUBELET_SOCKET,
    dp,
)
from deviceplugin.sim.records import (
    CHECKPOINT_FILE,
    DIAL_TIMEOUT_S,
    PRE_START_TIMEOUT_S,
    DeviceState,
    PodGrant,
    RegistrationEvent,
    _check_socket_path,
    _Endpoint,
    _PodRecord,
)
from deviceplugin.sim.runoptions import RunOptions, merge_run_options


def _describe(predicate: Callable[[], bool]) -> str:
    try:
        source = " ".join(inspect.getsource(predicate).split())
    except (OSError, TypeError):
        return repr(predicate)
    return source[source.find("lambda") :] if "lambda" in source else source


class KubeletState:
    """The state every part of the simulator shares, and the read-only views of it."""

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
        # Whether pod-resources lists the pods: a started kubelet lists none until it has had
        # them from the API server.
        self._pods_synced = True
        # The start-up cleanup, when it is to run at the first Register (see `start`).
        self._cleanup_pending: Callable[[], None] | None = None

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

    def container_run_options(self, namespace: str, pod: str, container: str) -> RunOptions:
        """The container's Allocate answers of every resource, merged as the kubelet merges
        them before it creates the container (see `runoptions`)."""
        record = self._pods.get((namespace, pod))
        if record is None:
            raise KeyError(f"pod {namespace}/{pod} not found")
        grants = [c for c in record.grant.containers if c.name == container and c.device_ids]
        return merge_run_options(grants)

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
