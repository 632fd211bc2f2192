"""The device checkpoint the simulated kubelet writes on every change and reads at start, so that
grants survive a restart: the kubelet's PodDeviceEntries and RegisteredDevices, with a checksum."""

from __future__ import annotations

import base64
import json
import logging
import zlib
from typing import Any

from google.protobuf.message import DecodeError

from deviceplugin.kubelet.proto import (
    dp,
)
from deviceplugin.sim.records import (
    NODE_WITHOUT_TOPOLOGY,
    ContainerGrant,
    PodGrant,
    _grant_from_response,
    _PodRecord,
    _response_from_grant,
)
from deviceplugin.sim.state import KubeletState
from deviceplugin.statefiles import write_file

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator


class CheckpointedState(KubeletState):
    """The state, written to and read back from the checkpoint file."""

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
                            "Init": c.init,
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
        content = json.dumps(document, indent=1).encode()
        write_file(path.parent, path.name, content, mode=0o644, sync=False, create=False)

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
            init = bool(container.get("Init", False))
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
            containers.append(
                _grant_from_response(name, resource, device_ids, response, preferred, init=init)
            )
        grant = PodGrant(str(pod["Namespace"]), str(pod["Name"]), uid, tuple(containers))
        records[(grant.namespace, grant.name)] = _PodRecord(grant, numa_nodes)
    return records
