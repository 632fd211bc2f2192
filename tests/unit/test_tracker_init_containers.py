"""A finished init container's allocation, which pod-resources never lists: named by its pod
(from the kubelet's checkpoint) while the pod holds its devices, released once they were reused."""

from __future__ import annotations

import json
import time
from pathlib import Path

from deviceplugin.kubelet.checkpoint import DeviceCheckpoint, parse_checkpoint
from deviceplugin.kubelet.podresources import ContainerDevices
from deviceplugin.model import AllocationRecord, allocation_id
from deviceplugin.plugin.tracker import AllocationTracker
from deviceplugin.state import AllocationBook

RESOURCE = "nvidia.com/gpu"
A, B, C = "GPU-a::0", "GPU-a::1", "GPU-a::2"
UID = "0a1b2c3d-0000-4000-8000-000000000001"


def _checkpoint(*entries: tuple[str, tuple[str, ...]]) -> DeviceCheckpoint:
    document = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": UID,
                    "ContainerName": name,
                    "ResourceName": RESOURCE,
                    "DeviceIDs": {"-1": list(ids)},
                }
                for name, ids in entries
            ]
        },
        "Checksum": 0,
    }
    return parse_checkpoint(json.dumps(document).encode(), RESOURCE)


class _PodResources:
    def __init__(self, containers: list[ContainerDevices]) -> None:
        self.containers = containers

    async def list_container_devices(self) -> list[ContainerDevices]:
        return self.containers

    async def close(self) -> None:
        return None


async def _status_after_refresh(
    init: tuple[str, ...], main: tuple[str, ...]
) -> list[AllocationRecord]:
    book = AllocationBook()
    # Both containers were allocated by this daemon a moment ago (the kubelet's Allocate calls).
    now = time.time()
    for ids in (init, main):
        book.allocated(AllocationRecord(allocation_id(ids), tuple(sorted(ids)), now))
    checkpoint = _checkpoint(("setup", init), ("main", main))
    tracker = AllocationTracker(
        book, Path("/nonexistent/pod-resources.sock"), RESOURCE, checkpoint=lambda: checkpoint
    )
    await tracker._client.close()
    tracker._client = _PodResources(  # type: ignore[assignment]
        [ContainerDevices("default", "with-init", "main", RESOURCE, main)]
    )
    await tracker.refresh()
    return sorted(book, key=lambda r: r.container)


async def test_init_container_devices_reused_by_the_app_container_are_released() -> None:
    records = await _status_after_refresh(init=(A,), main=(A, B))
    assert [(r.namespace, r.pod, r.container, r.slice_ids) for r in records] == [
        ("default", "with-init", "main", (A, B))
    ]


async def test_init_container_devices_still_held_are_named_by_pod_and_container() -> None:
    records = await _status_after_refresh(init=(A, C), main=(A, B))
    assert [
        (r.namespace, r.pod, r.container, r.slice_ids, r.listed, r.init_container) for r in records
    ] == [
        ("default", "with-init", "main", (A, B), True, False),
        ("default", "with-init", "setup", (A, C), True, True),
    ]
