"""The kubelet's device-manager checkpoint: which pod holds which allocation of our resource.

The kubelet records every device it hands a container in `<device-plugin-dir>/
kubelet_internal_checkpoint`, a JSON document it writes before the container starts and rewrites
when pods come and go:

    {"Data": {"PodDeviceEntries": [{"PodUID": ..., "ContainerName": ..., "ResourceName": ...,
                                    "DeviceIDs": {"<NUMA node>": [<device ID>, ...], ...},
                                    "AllocResp": "<base64 protobuf>"}, ...],
              "RegisteredDevices": {"<resource>": [<device ID>, ...], ...}},
     "Checksum": <uint32>}

Kubelets up to 1.19 wrote `DeviceIDs` as a flat list; both forms are read. A device without NUMA
affinity is listed under node -1, and a device with several nodes under each of them. The
checksum is the FNV-32a of the kubelet's Go-specific dump of `Data`: it cannot be recomputed
here, so it is not checked; a file that does not parse is refused whole instead. `AllocResp` and
`RegisteredDevices` are not needed and not decoded.

From the entries of our resource this gives, per allocation ID (`model.allocation_id` of the
container's device IDs), the pod (and container) that holds it: evidence that a process's
claimed `VGPU_ALLOCATION_ID` is its own (see `usage.attribute`). The file is the kubelet's and
writable by root only, so a process in a pod cannot forge it.

`parse_checkpoint` is pure; `CheckpointReader` reads the file and parses it again only when it
has changed. Neither raises: a missing, unreadable or malformed file gives an empty checkpoint
whose `reason` says why, and the caller then has no evidence (today's attribution).

The read is bounded (`safefs.read_bounded`'s reader, shared with the DRA checkpoint): the file
is opened without following a symbolic link and without blocking (a FIFO or a device planted at
its path is refused, never read), it must be a regular file of at most `MAX_CHECKPOINT_BYTES`,
and no more than that is ever read. Parsing keeps only what is used:
`AllocResp` and `RegisteredDevices` are dropped as each object is decoded, so a large checkpoint
costs about its own size in memory, once per change.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from deviceplugin.model import SliceId, allocation_id
from deviceplugin.owners import AllocationOwners, OwnerEntry, normalize_pod_uid
from deviceplugin.safefs import RefusedFileError, open_regular, read_open

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
# A checkpoint larger than this is refused unread; a kubelet's is a few hundred bytes to a few
# kilobytes per container (110 pods of 10 containers each stay under 8 MiB).
MAX_CHECKPOINT_BYTES = 16 << 20
# Keys of the document that are never used here: dropped as soon as their object is decoded.
_UNUSED_KEYS = frozenset({"AllocResp", "RegisteredDevices"})


# The checkpoint's entries and what they say: the owners of the allocations of our resources.
CheckpointEntry = OwnerEntry
DeviceCheckpoint = AllocationOwners


class CheckpointError(ValueError):
    """The checkpoint's content is not what the kubelet writes."""


def _device_ids(value: object, where: str) -> list[str]:
    """The device IDs of an entry: a map of NUMA node -> IDs (current), or a list (<= 1.19)."""
    if value is None:
        return []
    if isinstance(value, list):
        lists: list[object] = [value]
    elif isinstance(value, dict):
        lists = list(value.values())
    else:
        raise CheckpointError(f"{where}.DeviceIDs is neither a map nor a list")
    ids: list[str] = []
    for ids_of_node in lists:
        if ids_of_node is None:
            continue
        if not isinstance(ids_of_node, list) or not all(isinstance(d, str) for d in ids_of_node):
            raise CheckpointError(f"{where}.DeviceIDs holds something other than device IDs")
        ids.extend(ids_of_node)
    return ids


def _text(entry: Mapping[str, object], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}.{key} is not a string")
    return value


def _entries(
    document: object, resource_names: Collection[str] | None
) -> tuple[CheckpointEntry, ...]:
    if not isinstance(document, dict):
        raise CheckpointError("not a JSON object")
    data = document.get("Data")
    if not isinstance(data, dict):
        raise CheckpointError("no Data object")
    raw = data.get("PodDeviceEntries")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise CheckpointError("Data.PodDeviceEntries is not a list")
    entries: list[CheckpointEntry] = []
    for i, entry in enumerate(raw):
        where = f"Data.PodDeviceEntries[{i}]"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where} is not an object")
        pod_uid = normalize_pod_uid(_text(entry, "PodUID", where))
        container = _text(entry, "ContainerName", where)
        resource = _text(entry, "ResourceName", where)
        device_ids = _device_ids(entry.get("DeviceIDs"), where)
        if not pod_uid:
            raise CheckpointError(f"{where}.PodUID is empty")
        if (resource_names is not None and resource not in resource_names) or not device_ids:
            continue
        distinct = tuple(sorted(set(device_ids)))
        gpus: set[str] = set()
        for device_id in distinct:
            try:
                gpus.add(SliceId.parse(device_id).gpu_uuid)
            except ValueError:
                continue  # not one of our slice IDs: it still counts in the allocation ID
        entries.append(
            CheckpointEntry(
                pod_uid, container, allocation_id(distinct), distinct, frozenset(gpus), resource
            )
        )
    return tuple(entries)


def parse_checkpoint(
    blob: bytes | bytearray, resource_name: str | Collection[str] | None
) -> DeviceCheckpoint:
    """The entries of `resource_name` (one name, or several: a node serving MIG profiles has a
    resource per profile; None: every resource) in a checkpoint file's content. Never raises: a
    document that is not the kubelet's gives an empty checkpoint with the reason."""
    names = (resource_name,) if isinstance(resource_name, str) else resource_name
    try:
        document = json.loads(blob, object_pairs_hook=_used_keys)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return DeviceCheckpoint.unreadable(f"not JSON: {e}")
    try:
        return DeviceCheckpoint.of(_entries(document, names))
    except CheckpointError as e:
        return DeviceCheckpoint.unreadable(f"malformed: {e}")


def _used_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    return {k: v for k, v in pairs if k not in _UNUSED_KEYS}


class CheckpointReader:
    """Reads the checkpoint at `path` for `resource_name` (None: every resource's entries),
    parsing it again only when its
    identity (inode, size, modification and change times) differs from the last read; one stat
    per call otherwise. A file over `max_bytes` is refused unread. `parses` counts the files
    parsed. Never raises."""

    def __init__(
        self,
        path: Path,
        resource_name: str | Callable[[], Collection[str]] | None,
        *,
        max_bytes: int = MAX_CHECKPOINT_BYTES,
    ) -> None:
        self.path = path
        # One resource name, the names currently served (they change with the MIG layout), or
        # every resource.
        self._resources: Callable[[], Collection[str]] | None = (
            (lambda: frozenset((resource_name,)))
            if isinstance(resource_name, str)
            else resource_name
        )
        self._max_bytes = max_bytes
        self._key: tuple[object, ...] | None = None
        self._latest = DeviceCheckpoint.unreadable("not read yet")
        self.parses = 0

    def read(self) -> DeviceCheckpoint:
        try:
            fd, st = open_regular(self.path)
        except FileNotFoundError:
            return self._keep(None, DeviceCheckpoint.unreadable(f"no checkpoint at {self.path}"))
        except RefusedFileError as e:
            reason = (
                f"{self.path} is a symbolic link, not the kubelet's file"
                if e.errno == errno.ELOOP
                else str(e.strerror)
            )
            return self._keep(None, DeviceCheckpoint.unreadable(reason))
        except OSError as e:
            reason = f"cannot open {self.path}: {e.strerror or e}"
            return self._keep(None, DeviceCheckpoint.unreadable(reason))
        try:
            return self._read_open(fd, st)
        finally:
            os.close(fd)

    def _read_open(self, fd: int, st: os.stat_result) -> DeviceCheckpoint:
        resources = None if self._resources is None else frozenset(self._resources())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, resources)
        if key == self._key:
            return self._latest
        try:
            blob = read_open(fd, st, self.path, self._max_bytes)
        except RefusedFileError as e:
            # Remembered only when the stat already said so: a file that grew while it was
            # read is tried again on the next call.
            too_large_at_stat = st.st_size > self._max_bytes
            return self._keep(
                key if too_large_at_stat else None, DeviceCheckpoint.unreadable(str(e.strerror))
            )
        except OSError as e:
            # Not remembered: a file that could not be read is tried again on the next call.
            return self._keep(None, DeviceCheckpoint.unreadable(f"cannot read {self.path}: {e}"))
        self.parses += 1
        return self._keep(key, parse_checkpoint(blob, resources))

    def _keep(
        self, key: tuple[object, ...] | None, checkpoint: DeviceCheckpoint
    ) -> DeviceCheckpoint:
        self._key = key
        self._latest = checkpoint
        return checkpoint
