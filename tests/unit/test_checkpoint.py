"""Unit tests for deviceplugin.kubelet.checkpoint: the kubelet's device checkpoint, parsed, read."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from deviceplugin.kubelet.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointReader,
    DeviceCheckpoint,
    parse_checkpoint,
)
from deviceplugin.model import SliceId, allocation_id
from deviceplugin.owners import normalize_pod_uid

RESOURCE = "nvidia.com/vgpu"
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
POD_A = "0f1e2d3c-aaaa-bbbb-cccc-0123456789ab"
POD_B = "9a8b7c6d-1111-2222-3333-444455556666"


def sid(uuid: str, n: int) -> str:
    return str(SliceId(uuid, n))


def entry(
    pod: str,
    container: str,
    device_ids: object,
    resource: str = RESOURCE,
) -> dict[str, object]:
    return {
        "PodUID": pod,
        "ContainerName": container,
        "ResourceName": resource,
        "DeviceIDs": device_ids,
        "AllocResp": "CgA=",
    }


def document(*entries: dict[str, object]) -> bytes:
    data = {"PodDeviceEntries": list(entries), "RegisteredDevices": {RESOURCE: []}}
    return json.dumps({"Data": data, "Checksum": 12345}).encode()


A_IDS = [sid(UUID0, 0), sid(UUID0, 1)]
B_IDS = [sid(UUID0, 2), sid(UUID1, 0)]


def test_current_format_maps_allocations_to_pods_and_containers() -> None:
    blob = document(
        entry(POD_A, "worker", {"0": A_IDS}),
        # Devices on two NUMA nodes, and one listed under both (several affinities).
        entry(POD_B, "server", {"0": [B_IDS[0]], "1": [B_IDS[1], B_IDS[0]]}),
    )
    cp = parse_checkpoint(blob, RESOURCE)
    assert cp.readable
    assert cp.reason == ""
    a, b = allocation_id(A_IDS), allocation_id(B_IDS)
    assert cp.owners == {a: {POD_A}, b: {POD_B}}
    assert cp.pod_of(a) == ((POD_A, "worker"),)
    assert cp.pod_of(b) == ((POD_B, "server"),)
    assert cp.pod_of("0123456789abcdef") == ()
    assert cp.pod_allocations == {POD_A: {a}, POD_B: {b}}
    assert cp.pod_gpu_allocations == {
        (POD_A, UUID0): {a},
        (POD_B, UUID0): {b},
        (POD_B, UUID1): {b},
    }
    by_container = {e.container: e for e in cp.entries}
    assert by_container["server"].device_ids == tuple(sorted(B_IDS))
    assert by_container["server"].gpu_uuids == {UUID0, UUID1}


def test_devices_without_topology_are_under_node_minus_one() -> None:
    cp = parse_checkpoint(document(entry(POD_A, "c", {"-1": A_IDS})), RESOURCE)
    assert cp.owners == {allocation_id(A_IDS): {POD_A}}


def test_old_flat_list_format() -> None:
    cp = parse_checkpoint(document(entry(POD_A, "worker", A_IDS)), RESOURCE)
    assert cp.readable
    assert cp.owners == {allocation_id(A_IDS): {POD_A}}
    assert cp.pod_gpu_allocations == {(POD_A, UUID0): {allocation_id(A_IDS)}}


def test_only_our_resource_and_entries_with_devices_count() -> None:
    blob = document(
        entry(POD_A, "worker", {"0": A_IDS}),
        entry(POD_A, "side", {"0": ["GPU-x"]}, resource="nvidia.com/gpu"),
        entry(POD_B, "empty", {}),
        entry(POD_B, "null", None),
        entry(POD_B, "null-node", {"0": None}),
    )
    cp = parse_checkpoint(blob, RESOURCE)
    assert [e.container for e in cp.entries] == ["worker"]
    assert cp.pod_allocations == {POD_A: {allocation_id(A_IDS)}}


def test_pod_uids_are_normalised() -> None:
    cp = parse_checkpoint(document(entry(POD_A.upper().replace("-", "_"), "c", A_IDS)), RESOURCE)
    assert cp.owners == {allocation_id(A_IDS): {POD_A}}
    assert normalize_pod_uid(" AB_CD ") == "ab-cd"


def test_an_allocation_reused_by_a_later_container_of_the_same_pod() -> None:
    """The kubelet hands an init container's devices on to a later container of its pod."""
    blob = document(entry(POD_A, "init", A_IDS), entry(POD_A, "main", {"0": A_IDS}))
    cp = parse_checkpoint(blob, RESOURCE)
    a = allocation_id(A_IDS)
    assert cp.owners == {a: {POD_A}}
    assert cp.pod_of(a) == ((POD_A, "init"), (POD_A, "main"))
    assert cp.pod_gpu_allocations == {(POD_A, UUID0): {a}}


def test_device_ids_that_are_not_slices_count_in_the_id_but_name_no_gpu() -> None:
    ids = ["odd-device", sid(UUID1, 3)]
    cp = parse_checkpoint(document(entry(POD_A, "c", ids)), RESOURCE)
    assert cp.owners == {allocation_id(ids): {POD_A}}
    assert cp.pod_gpu_allocations == {(POD_A, UUID1): {allocation_id(ids)}}


def test_no_entries_is_readable_and_empty() -> None:
    for blob in (document(), b'{"Data": {"PodDeviceEntries": null}, "Checksum": 0}'):
        cp = parse_checkpoint(blob, RESOURCE)
        assert cp.readable
        assert cp.entries == ()


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "not JSON"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'{"Data": {"PodDeviceEntries": [', "not JSON"),  # a torn write
        (b"[]", "not a JSON object"),
        (b'{"Checksum": 1}', "no Data object"),
        (b'{"Data": {"PodDeviceEntries": {}}}', "not a list"),
        (b'{"Data": {"PodDeviceEntries": [7]}}', r"\[0\] is not an object"),
        (document({"ContainerName": "c", "ResourceName": RESOURCE, "DeviceIDs": []}), "PodUID"),
        (document(entry(POD_A, "c", A_IDS) | {"ContainerName": 3}), "ContainerName"),
        (document(entry("", "c", A_IDS)), "PodUID is empty"),
        (document(entry(POD_A, "c", "GPU-0::0")), "neither a map nor a list"),
        (document(entry(POD_A, "c", {"0": "GPU-0::0"})), "other than device IDs"),
        (document(entry(POD_A, "c", [1, 2])), "other than device IDs"),
    ],
)
def test_malformed_checkpoints_are_empty_with_a_reason(blob: bytes, reason: str) -> None:
    cp = parse_checkpoint(blob, RESOURCE)
    assert not cp.readable
    assert cp.entries == ()
    assert cp.owners == {}
    assert cp.pod_gpu_allocations == {}
    assert re.search(reason, cp.reason), cp.reason


def test_an_unreadable_checkpoint_says_why() -> None:
    assert DeviceCheckpoint.unreadable("").reason == "unreadable"
    assert not DeviceCheckpoint().readable


# ---------------------------------------------------------------------------------------------
# CheckpointReader


def write(path: Path, blob: bytes) -> None:
    """Replace the file the way the kubelet does: a temporary file renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(blob)
    os.replace(temporary, path)


def test_reader_parses_only_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    write(path, document(entry(POD_A, "worker", A_IDS)))
    reader = CheckpointReader(path, RESOURCE)
    first = reader.read()
    assert first.owners == {allocation_id(A_IDS): {POD_A}}
    assert reader.read() is first
    assert reader.parses == 1

    write(path, document(entry(POD_A, "worker", A_IDS), entry(POD_B, "server", B_IDS)))
    second = reader.read()
    assert reader.parses == 2
    assert second.owners.keys() == {allocation_id(A_IDS), allocation_id(B_IDS)}
    assert reader.read() is second


def test_reader_sees_a_rewrite_in_place_of_the_same_size(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    path.write_bytes(document(entry(POD_A, "worker", A_IDS)))
    reader = CheckpointReader(path, RESOURCE)
    assert reader.read().owners == {allocation_id(A_IDS): {POD_A}}
    path.write_bytes(document(entry(POD_B, "worker", A_IDS)))  # same length, same inode
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert reader.read().owners == {allocation_id(A_IDS): {POD_B}}


def test_reader_missing_file_then_created_then_removed(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    reader = CheckpointReader(path, RESOURCE)
    missing = reader.read()
    assert not missing.readable
    assert "no checkpoint" in missing.reason
    assert str(path) in missing.reason
    write(path, document(entry(POD_A, "worker", A_IDS)))
    assert reader.read().readable
    path.unlink()
    assert not reader.read().readable
    write(path, document(entry(POD_A, "worker", A_IDS)))
    assert reader.read().readable
    assert reader.parses == 2


def test_reader_malformed_file_is_kept_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    write(path, b"garbage")
    reader = CheckpointReader(path, RESOURCE)
    assert "not JSON" in reader.read().reason
    assert "not JSON" in reader.read().reason
    assert reader.parses == 1
    write(path, document(entry(POD_A, "worker", A_IDS)))
    assert reader.read().readable


def test_reader_unreadable_file_is_retried(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    path.mkdir()  # not the kubelet's file: refused
    reader = CheckpointReader(path, RESOURCE)
    assert "not a regular file" in reader.read().reason
    path.rmdir()
    write(path, document(entry(POD_A, "worker", A_IDS)))
    assert reader.read().readable


def test_reader_refuses_an_oversized_file(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    write(path, document(entry(POD_A, "worker", A_IDS)))
    reader = CheckpointReader(path, RESOURCE, max_bytes=16)
    assert "more than 16" in reader.read().reason
    assert reader.parses == 0
