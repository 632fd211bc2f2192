"""Per-device tags: a container holding slices of two resources has one `VGPU_ALLOCATION_ID`
(the kubelet keeps one value per env key across its Allocate answers) and one
`VGPU_ALLOCATION_ID_<UUID>` per device. A process on a device is charged by that device's key, so
the container's use there is held to the allocation that covers it; and a forged per-device key
is refused exactly like a forged `VGPU_ALLOCATION_ID`: from a host process, from another pod, and
from another container of the pod."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.allocation import device_env_suffix
from deviceplugin.kubelet.checkpoint import parse_checkpoint
from deviceplugin.model import DaemonHealth, NodeSnapshot, ProcessSample
from deviceplugin.usage.attribution import AttributionEvidence, SnapshotBuilder
from deviceplugin.usage.procfs import MAX_DEVICE_TAGS, tags_in
from deviceplugin.usage.procs import AllocationResolver
from deviceplugin.usage.tags import DeviceTags
from tests.security.test_attribution_attacks import (
    LAYOUTS,
    OTHER_POD_UID,
    POD_UID,
    Layout,
    cgroupfs,
    cid,
    kills,
    v2,
)
from tests.unit.test_attribution import INVENTORY, UUID0, UUID1, reading, record, sid

GiB = 1024**3
# One container holding a slice of GPU 0 (resource "a") and a slice of GPU 1 (resource "b"),
# 20 GiB each. The kubelet kept resource a's `VGPU_ALLOCATION_ID`.
ON0 = record(sid(UUID0, 0), namespace="ml", pod="victim", container="main")
ON1 = record(sid(UUID1, 0), namespace="ml", pod="victim", container="main")
# Another pod's container, with a slice of GPU 1.
THEIRS = record(sid(UUID1, 1), namespace="ml", pod="other", container="main")


def environ(default: str | None, **per_device: str) -> bytes:
    """An environment block: a secret, `VGPU_ALLOCATION_ID` and per-device keys by UUID."""
    env = b"PATH=/usr/bin\0TOKEN=s3cret\0"
    if default is not None:
        env += f"VGPU_ALLOCATION_ID={default}\0".encode()
    for uuid, value in per_device.items():
        env += f"VGPU_ALLOCATION_ID_{device_env_suffix(uuid)}={value}\0".encode()
    return env


def both_keys() -> bytes:
    """The merged environment of the two-resource container."""
    return environ(ON0.allocation_id, **{UUID0: ON0.allocation_id, UUID1: ON1.allocation_id})


class FakeProc:
    """A fake /proc tree: stat, environ and cgroup per PID."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, cgroup: str, env: bytes, ppid: int = 1) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True)
        rest = " ".join(["0"] * 17)
        (d / "stat").write_text(f"{pid} (python3) S {ppid} {rest} {1000 + pid} 0 0\n")
        (d / "environ").write_bytes(env)
        (d / "cgroup").write_text(cgroup)


# A second container of the victim's pod, with a slice of GPU 1.
SIDE = record(sid(UUID1, 2), namespace="ml", pod="victim", container="side")


def checkpoint_blob(*, side: bool = False) -> bytes:
    holders = [
        (POD_UID, "main", "example.com/a", ON0.slice_ids),
        (OTHER_POD_UID, "main", "example.com/b", THEIRS.slice_ids),
    ]
    holders.append((POD_UID, "side", "example.com/b", SIDE.slice_ids) if side else
                   (POD_UID, "main", "example.com/b", ON1.slice_ids))  # fmt: skip
    entries = [
        {
            "PodUID": pod,
            "ContainerName": container,
            "ResourceName": resource,
            "DeviceIDs": {"0": list(ids)},
            "AllocResp": "",
        }
        for pod, container, resource, ids in holders
    ]
    return json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 0}).encode()


def attributed(
    proc: FakeProc,
    gpu0: list[ProcessSample],
    gpu1: list[ProcessSample],
    *,
    containers: dict[str, tuple[str, str]] | None = None,
    side: bool = False,
) -> NodeSnapshot:
    """The snapshot of the whole attribution path; `containers` (container runtime ID -> (pod
    UID, name)) stands for the kubelet's container log links, where given."""
    resolver = AllocationResolver(proc.root, container_logs=None)
    tags = resolver.resolve(p.pid for p in [*gpu0, *gpu1])
    checkpoint = parse_checkpoint(checkpoint_blob(side=side), None)
    assert checkpoint.readable
    container_of: Callable[[int], tuple[str, str] | None]
    if containers is None:
        container_of = resolver.container_of
    else:

        def container_of(pid: int) -> tuple[str, str] | None:
            cgroup = resolver.cgroup_of(pid)
            found = [v for k, v in containers.items() if cgroup is not None and k in cgroup]
            return found[0] if found else None

    evidence = AttributionEvidence(
        checkpoint,
        resolver.pod_uid_of,
        cgroup_of=resolver.cgroup_of,
        container_of=container_of,
        containers_known=containers is not None,
    )
    snapshot, _ = SnapshotBuilder("n", 5.0).build(
        reading(gpu0=gpu0, gpu1=gpu1),
        INVENTORY,
        [ON0, SIDE, THEIRS] if side else [ON0, ON1, THEIRS],
        tags,
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=DaemonHealth(),
        previous_reading_s=9.0,
        evidence=evidence,
    )
    return snapshot


def charged(snapshot: NodeSnapshot) -> dict[tuple[str, str], list[int]]:
    return {
        (c.allocation_id, c.gpu_uuid): [p.pid for p in c.processes]
        for c in snapshot.containers
        if c.processes
    }


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_process_on_the_second_resources_gpu_is_held_to_that_allocations_limit(
    tmp_path: Path, layout: Layout
) -> None:
    path_of, lines = layout
    proc = FakeProc(tmp_path)
    proc.add(101, lines(path_of(POD_UID, "main")), both_keys())  # GPU 0: 5 of its 20 GiB
    proc.add(102, lines(path_of(POD_UID, "main")), both_keys())  # GPU 1: 25 of its 20 GiB
    snapshot = attributed(
        proc, [ProcessSample(101, 5 * GiB, 10.0)], [ProcessSample(102, 25 * GiB, 10.0)]
    )
    assert charged(snapshot) == {
        (ON0.allocation_id, UUID0): [101],
        (ON1.allocation_id, UUID1): [102],
    }
    on1 = next(c for c in snapshot.containers if c.gpu_uuid == UUID1)
    assert on1.memory_limit_bytes == 20 * GiB
    assert [(k.pid, k.allocation_id) for k in kills(snapshot)] == [(102, ON1.allocation_id)]
    assert snapshot.gpus[1].misattributed == ()


def test_a_child_with_a_cleared_environment_is_charged_by_its_parents_per_device_key(
    tmp_path: Path,
) -> None:
    proc = FakeProc(tmp_path)
    proc.add(101, v2(cgroupfs(POD_UID, "main")), both_keys())
    proc.add(102, v2(cgroupfs(POD_UID, "main")), b"", ppid=101)
    snapshot = attributed(proc, [], [ProcessSample(102, 25 * GiB, 10.0)])
    assert charged(snapshot) == {(ON1.allocation_id, UUID1): [102]}
    assert [k.pid for k in kills(snapshot)] == [102]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_forged_per_device_key_from_a_host_process_or_another_pod_is_refused(
    tmp_path: Path, layout: Layout
) -> None:
    path_of, lines = layout
    proc = FakeProc(tmp_path)
    forged = environ(None, **{UUID1: ON1.allocation_id})
    # The victim's own process: 19 of its 20 GiB on GPU 1.
    proc.add(101, lines(path_of(POD_UID, "main")), both_keys())
    proc.add(900, v2("/user.slice/user-1000.slice/session-1.scope"), forged)  # a host process
    proc.add(901, lines(path_of(OTHER_POD_UID, "main")), forged)  # another pod's container
    # Another pod whose `VGPU_ALLOCATION_ID` is its own, with a forged per-device key: the key
    # is its tag on GPU 1, and it is refused (never falls back to the pod's own ID).
    proc.add(
        902,
        lines(path_of(OTHER_POD_UID, "other")),
        environ(THEIRS.allocation_id, **{UUID1: ON1.allocation_id}),
    )
    snapshot = attributed(
        proc,
        [],
        [
            ProcessSample(101, 19 * GiB, 10.0),
            ProcessSample(900, 15 * GiB, 10.0),
            ProcessSample(901, 15 * GiB, 10.0),
            ProcessSample(902, 15 * GiB, 10.0),
        ],
    )
    assert charged(snapshot) == {(ON1.allocation_id, UUID1): [101]}
    assert [p.pid for p in snapshot.gpus[1].misattributed] == [900, 901, 902]
    assert kills(snapshot) == []


def test_a_forged_per_device_key_from_another_container_of_the_pod_is_refused(
    tmp_path: Path,
) -> None:
    proc = FakeProc(tmp_path)
    proc.add(101, v2(cgroupfs(POD_UID, "main")), both_keys())  # 19 of 20 GiB on GPU 1
    # A sidecar that copied the per-device key: refused where the kubelet's names are known.
    proc.add(102, v2(cgroupfs(POD_UID, "sidecar")), environ(None, **{UUID1: ON1.allocation_id}))
    containers = {cid("main"): (POD_UID, "main"), cid("sidecar"): (POD_UID, "sidecar")}
    snapshot = attributed(
        proc,
        [],
        [ProcessSample(101, 19 * GiB, 10.0), ProcessSample(102, 5 * GiB, 10.0)],
        containers=containers,
    )
    assert charged(snapshot) == {(ON1.allocation_id, UUID1): [101]}
    assert [p.pid for p in snapshot.gpus[1].misattributed] == [102]
    assert kills(snapshot) == []


@pytest.mark.parametrize(
    "env",
    [
        environ(ON0.allocation_id),  # made before per-device keys
        environ(ON0.allocation_id, **{UUID1: ON0.allocation_id}),  # its other allocation named
    ],
    ids=["no-per-device-key", "own-other-allocation"],
)
def test_a_claim_of_the_containers_other_allocation_is_charged_to_the_one_on_that_gpu(
    tmp_path: Path, env: bytes
) -> None:
    """A container cannot move its use on one device to its other allocation, which has no limit
    there: the tag stands, and is charged to the container's allocation on that device."""
    proc = FakeProc(tmp_path)
    proc.add(102, v2(cgroupfs(POD_UID, "main")), env)  # GPU 1: 25 of its 20 GiB
    snapshot = attributed(proc, [], [ProcessSample(102, 25 * GiB, 10.0)])
    assert charged(snapshot) == {(ON1.allocation_id, UUID1): [102]}
    assert [(k.pid, k.allocation_id) for k in kills(snapshot)] == [(102, ON1.allocation_id)]


@pytest.mark.parametrize("gpu0_only", [True, False], ids=["tag-on-gpu0-only", "tags-on-both-gpus"])
def test_an_unclaimed_process_of_a_two_resource_container_is_charged_on_its_gpu(
    tmp_path: Path, gpu0_only: bool
) -> None:
    """The container-cgroup rule for a process that carries no tag (its environment cleared,
    no tagged ancestor): in a container holding two allocations it is charged to the one on
    its GPU."""
    proc = FakeProc(tmp_path)
    proc.add(101, v2(cgroupfs(POD_UID, "main")), both_keys())  # GPU 0
    proc.add(102, v2(cgroupfs(POD_UID, "main")), both_keys())  # GPU 1, when on both
    proc.add(103, v2(cgroupfs(POD_UID, "main")), b"")  # GPU 1: 25 of its 20 GiB with 102's
    gpu1 = [ProcessSample(103, 25 * GiB, 10.0)]
    if not gpu0_only:
        gpu1.insert(0, ProcessSample(102, 0, 10.0))
    snapshot = attributed(proc, [ProcessSample(101, GiB, 10.0)], gpu1)
    assert charged(snapshot)[(ON1.allocation_id, UUID1)] == [p.pid for p in gpu1]
    assert snapshot.gpus[1].unattributed_pods == ()
    assert [(k.pid, k.allocation_id) for k in kills(snapshot)] == [(103, ON1.allocation_id)]


def test_a_claim_is_never_moved_to_another_containers_allocation(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    # The main container holds GPU 0 only; its pod's other container holds a slice of GPU 1.
    proc.add(102, v2(cgroupfs(POD_UID, "main")), environ(ON0.allocation_id))
    proc.add(103, v2(cgroupfs(POD_UID, "side")), environ(SIDE.allocation_id))
    snapshot = attributed(
        proc,
        [],
        [ProcessSample(102, 25 * GiB, 10.0), ProcessSample(103, 1 * GiB, 10.0)],
        side=True,
    )
    assert charged(snapshot) == {
        (ON0.allocation_id, UUID1): [102],
        (SIDE.allocation_id, UUID1): [103],
    }
    assert kills(snapshot) == []


def test_only_allocation_ids_are_kept_from_an_environment_and_at_most_a_bounded_number() -> None:
    valid = ON1.allocation_id
    env = (
        both_keys()
        + b"VGPU_ALLOCATION_ID_GPU_X=s3cret-token\0"  # not an allocation ID: None, not the value
        + b"VGPU_ALLOCATION_ID_lower=" + valid.encode() + b"\0"  # no device's suffix
        + b"VGPU_ALLOCATION_ID_=" + valid.encode() + b"\0"
        + b"VGPU_ALLOCATION_ID_" + b"A" * 200 + b"=" + valid.encode() + b"\0"
    )  # fmt: skip
    present, tag = tags_in(env)
    assert present
    assert isinstance(tag, DeviceTags)
    assert tag.default == ON0.allocation_id
    assert dict(tag.devices) == {
        device_env_suffix(UUID0): ON0.allocation_id,
        device_env_suffix(UUID1): valid,
        "GPU_X": None,
    }
    assert "s3cret" not in repr(tag)
    assert tag.on(device_env_suffix(UUID1)) == valid
    assert tag.on("GPU_X") is None  # an invalid per-device value tags nothing
    assert tag.on("MIG_OTHER") == ON0.allocation_id

    many = b"".join(
        f"VGPU_ALLOCATION_ID_D{n}={valid}\0".encode() for n in range(MAX_DEVICE_TAGS + 50)
    )
    _, bounded = tags_in(many)
    assert isinstance(bounded, DeviceTags)
    assert len(bounded.devices) == MAX_DEVICE_TAGS
    assert bounded.default is None

    # Without per-device keys the tag is the plain ID, as before.
    assert tags_in(environ(valid)) == (True, valid)
    assert tags_in(b"PATH=/bin\0") == (False, None)
