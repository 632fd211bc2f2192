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

The parts live in their own modules: `records` (what it keeps), `state` (observation),
`checkpoint`, `devices` (ListAndWatch), `registration`, `admission`, `podresources` and `cli`. This
module composes them into `KubeletSimulator` and owns its life cycle. Every part logs under this
module's name, `deviceplugin.sim.kubelet`, so one filter on it still catches the whole simulator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.kubelet.proto import (
    dp_grpc,
    podres_grpc,
)
from deviceplugin.kubelet.sockets import remove_socket, serve_unix
from deviceplugin.sim.admission import Admission, choose_devices
from deviceplugin.sim.podresources import _PodResourcesServicer
from deviceplugin.sim.records import (
    CHECKPOINT_FILE,
    CREATE_CONTAINER_CONFIG_ERROR,
    DIAL_TIMEOUT_S,
    PRE_START_TIMEOUT_S,
    SUPPORTED_VERSIONS,
    AdmissionError,
    ContainerGrant,
    DeviceState,
    PodGrant,
    RegistrationEvent,
)
from deviceplugin.sim.registration import (
    Registration,
    _RegistrationServicer,
    is_extended_resource_name,
)

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator

__all__ = [
    "CHECKPOINT_FILE",
    "CREATE_CONTAINER_CONFIG_ERROR",
    "DIAL_TIMEOUT_S",
    "PRE_START_TIMEOUT_S",
    "SUPPORTED_VERSIONS",
    "AdmissionError",
    "ContainerGrant",
    "DeviceState",
    "KubeletSimulator",
    "PodGrant",
    "RegistrationEvent",
    "choose_devices",
    "is_extended_resource_name",
]


class KubeletSimulator(Registration, Admission):
    """A kubelet for one node: registration, device lists, admission and pod-resources."""

    async def start(
        self, *, pods_synced: bool = True, cleanup_races_registration: bool = False
    ) -> None:
        """Read the checkpoint, clean the plugin directory, serve Registration and pod-resources.

        `pods_synced=False`: like a kubelet that has not yet had its pods from the API server,
        pod-resources lists no pod (its checkpoint still names them) until `sync_pods()`.
        `cleanup_races_registration=True`: the start-up cleanup of the plugin directory runs
        when the first Register arrives, before the kubelet dials the plugin back: the worst
        interleaving of a restart, in which a plugin's Register reaches the new kubelet just
        after its cleanup removed the socket that Register names."""
        if self._running:
            raise RuntimeError("kubelet simulator already running")
        self._dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._read_checkpoint()
        self._pods_synced = pods_synced
        if cleanup_races_registration:
            self._cleanup_pending = self._cleanup_plugin_directory
        else:
            self._cleanup_plugin_directory()
        # Running from before the first socket exists: a plugin may register at once.
        self._running = True
        try:
            server = grpc.aio.server()
            dp_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
            await self._serve(server, self._socket)
            if self._pod_resources_socket is not None:
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
        self._cleanup_pending = None
        await self._stop_servers()
        for endpoint in list(self._endpoints.values()):
            await self._close_endpoint(endpoint)
        self._endpoints.clear()
        logger.info("kubelet stopped dir=%s", self._dir)
        self._notify()

    async def restart(
        self, *, pods_synced: bool = True, cleanup_races_registration: bool = False
    ) -> None:
        """Stop, then start again: sockets are cleaned and recreated, the checkpoint is reloaded.
        The keywords are `start`'s."""
        logger.info("kubelet restarting dir=%s", self._dir)
        await self.stop()
        await self.start(
            pods_synced=pods_synced, cleanup_races_registration=cleanup_races_registration
        )

    def sync_pods(self) -> None:
        """The kubelet has its pods from the API server: pod-resources lists them again."""
        self._pods_synced = True
        logger.info("pods synced from the API server pods=%d", len(self._pods))
        self._notify()

    async def _serve(self, server: Any, socket_path: Path) -> None:
        self._servers.append(server)
        await serve_unix(server, socket_path)
        self._created_sockets.append(socket_path)

    async def _stop_servers(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(grace=None)
        sockets, self._created_sockets = self._created_sockets, []
        for path in sockets:
            with contextlib.suppress(OSError):
                remove_socket(path)

    def _cleanup_plugin_directory(self) -> None:
        """CleanupPluginDirectory: remove every non-directory entry except the checkpoint."""
        checkpoint = self.checkpoint_path
        for entry in os.scandir(self._dir):
            path = Path(entry.path)
            # (Its own socket exists here only when the cleanup runs late, racing a Register.)
            if path in (checkpoint, self._socket):
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


if __name__ == "__main__":
    from deviceplugin.sim.cli import main

    sys.exit(main())
