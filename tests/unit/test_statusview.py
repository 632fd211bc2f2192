"""The /status document and its terminal view, from hand-built snapshots."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from deviceplugin.model import SOURCE_DRA, ContainerUsage, MpsStatus, NodeSnapshot
from deviceplugin.usage.statusdoc import snapshot_to_json
from deviceplugin.usage.statusview import (
    container_name,
    memory_bar,
    render_status,
    share_bar,
)
from tests.unit.test_metrics import (
    LONG_POD,
    NAMED_A,
    OVER_LIMIT,
    T0,
    UNNAMED,
    UUID0,
    UUID1,
    GiB,
    sample_snapshot,
)


def doc_of(snapshot: NodeSnapshot) -> dict[str, Any]:
    """The document as the command line gets it: through JSON text."""
    loaded: dict[str, Any] = json.loads(json.dumps(snapshot_to_json(snapshot)))
    return loaded


# --- the document ----------------------------------------------------------------------------


def test_document_round_trips_through_json() -> None:
    doc = snapshot_to_json(sample_snapshot())
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text) == doc


def test_document_key_order_is_stable() -> None:
    doc = snapshot_to_json(sample_snapshot())
    assert list(doc) == [
        "node",
        "kubelet_api",
        "taken_at",
        "taken_at_s",
        "stale",
        "health",
        "gpus",
        "containers",
        "allocations",
        "enforcement",
        "memory_limits",
    ]
    assert json.dumps(doc) == json.dumps(snapshot_to_json(sample_snapshot()))


def test_document_header() -> None:
    doc = doc_of(sample_snapshot(stale=True))
    assert doc["node"] == "node-a"
    assert doc["taken_at"] == "2024-05-01T12:00:00Z"
    assert doc["taken_at_s"] == T0
    assert doc["stale"] is True
    assert doc["health"]["registered"] is True
    assert doc["health"]["registrations_total"] == 3
    assert doc["health"]["last_poll_success"] == "2024-05-01T12:00:00Z"


def test_document_gpus() -> None:
    gpu0, gpu1 = doc_of(sample_snapshot())["gpus"]
    assert gpu0["uuid"] == UUID0
    assert gpu0["index"] == 0
    assert gpu0["model"] == "NVIDIA A100-SXM4-80GB"
    assert gpu0["healthy"] is True
    assert gpu0["memory_total_bytes"] == 80 * GiB
    assert gpu0["memory_used_bytes"] == 37 * GiB
    assert gpu0["sm_utilization_ratio"] == pytest.approx(0.8)
    assert gpu0["slices"] == {
        "total": 4,
        "allocated": 4,
        "free": 0,
        "unhealthy": 0,
        "unconfirmed": 0,
    }
    assert gpu0["unattributed"] == [
        {"pid": 900, "used_memory_bytes": 512 * 1024**2, "sm_util_percent": 3.0}
    ]
    assert gpu1["uuid"] == UUID1
    assert gpu1["healthy"] is False
    assert gpu1["health_reason"].startswith("Xid 79")
    assert gpu1["memory_used_bytes"] is None
    assert gpu1["sm_utilization_ratio"] is None
    assert gpu1["slices"] == {
        "total": 4,
        "allocated": 2,
        "free": 0,
        "unhealthy": 2,
        "unconfirmed": 0,
    }
    assert [p["pid"] for p in gpu1["unattributed"]] == [901, 902]


def test_document_containers_carry_every_field() -> None:
    containers = doc_of(sample_snapshot())["containers"]
    by_id = {(c["allocation_id"], c["gpu_uuid"]): c for c in containers}
    over = by_id[(OVER_LIMIT.allocation_id, UUID0)]
    fields = {f.name for f in dataclasses.fields(ContainerUsage)}
    assert fields <= set(over)
    assert over["throttled"] is True
    assert over["duty_cycle_ratio"] == pytest.approx(0.6)
    assert over["throttled_seconds_total"] == 12.5
    assert over["pod"] == LONG_POD
    assert [p["pid"] for p in over["processes"]] == [4200, 4201]
    named = by_id[(NAMED_A.allocation_id, UUID0)]
    assert named["throttled"] is False
    assert named["duty_cycle_ratio"] is None
    unnamed = by_id[(UNNAMED, UUID1)]
    assert (unnamed["namespace"], unnamed["pod"], unnamed["container"]) == ("", "", "")


def test_document_allocations_and_enforcement() -> None:
    doc = doc_of(sample_snapshot())
    first = doc["allocations"][0]
    assert first["allocation_id"] == NAMED_A.allocation_id
    assert first["slice_ids"] == [f"{UUID0}::0", f"{UUID0}::1"]
    assert first["allocated_at"] == "2024-05-01T11:50:00Z"
    kinds = {(e["kind"], e["action"]): e["count"] for e in doc["enforcement"]}
    assert kinds == {("memory", "kill"): 2, ("compute", "throttle"): 7, ("memory", "monitor"): 1}


def test_non_finite_figures_become_null() -> None:
    odd = dataclasses.replace(NAMED_A, sm_utilization_ratio=math.nan, duty_cycle_ratio=math.inf)
    doc = snapshot_to_json(sample_snapshot(containers=(odd,)))
    json.dumps(doc, allow_nan=False)
    assert doc["containers"][0]["sm_utilization_ratio"] is None


# --- bars ------------------------------------------------------------------------------------


def test_memory_bar_under_limit() -> None:
    assert memory_bar(5, 10, 10) == "[#####.....]"
    assert memory_bar(0, 10, 4) == "[....]"


def test_memory_bar_marks_over_limit() -> None:
    bar = memory_bar(25, 20, 10)
    assert bar == "[########!!]"
    # Even a hair over the limit shows.
    assert "!" in memory_bar(20 * GiB + 1, 20 * GiB, 10)


def test_share_bar_marks_the_share() -> None:
    assert share_bar(0.3, 0.5, 10) == "[###..|....]"
    assert share_bar(0.8, 0.5, 10) == "[#####|##..]"
    assert share_bar(None, None, 4) == "[....]"
    assert share_bar(1.7, 1.0, 4) == "[####]"


# --- the view --------------------------------------------------------------------------------


def many_containers(n: int) -> tuple[ContainerUsage, ...]:
    return tuple(
        dataclasses.replace(
            NAMED_A,
            allocation_id=f"{i:016x}",
            gpu_uuid=(UUID0, UUID1)[i % 2],
            gpu_index=i % 2,
            namespace="a-namespace-with-a-long-name-" * (i % 3 + 1),
            pod=f"{LONG_POD}-{i}",
            container="container-" * (i % 4 + 1),
            memory_used_bytes=(i % 7) * 7 * GiB,
            duty_cycle_ratio=0.25 if i % 5 == 0 else None,
        )
        for i in range(n)
    )


@pytest.mark.parametrize("width", [80, 100, 132, 200])
def test_every_line_fits_the_width(width: int) -> None:
    doc = doc_of(sample_snapshot(containers=many_containers(64)))
    lines = render_status(doc, width=width)
    assert len(lines) > 64 * 2
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert any(len(line) == width for line in lines)  # long names were cut, not dropped


def test_narrow_width_is_still_respected() -> None:
    lines = render_status(doc_of(sample_snapshot()), width=30)
    assert all(len(line) <= 30 for line in lines)


def test_long_names_are_cut_with_an_ellipsis_keeping_the_container() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    over = next(line for line in lines if "team-b/" in line)
    assert "…" in over
    assert "/server" in over


def test_view_shows_gpus_with_usage_and_slices() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    text = "\n".join(lines)
    assert lines[0].startswith("node node-a")
    assert "2024-05-01T12:00:00Z" in lines[0]
    gpu0 = next(line for line in lines if line.startswith("GPU 0"))
    assert "NVIDIA A100-SXM4-80GB" in gpu0
    assert "healthy" in gpu0
    assert "slices: 4 used, 0 free, 0 unhealthy" in gpu0
    gpu1 = next(line for line in lines if line.startswith("GPU 1"))
    assert "UNHEALTHY" in gpu1
    assert "Xid 79" in text
    assert "37Gi/80Gi" in text
    assert "?/80Gi" in text  # unknown memory use on the lost GPU


def test_view_over_limit_marker() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    i = next(i for i, line in enumerate(lines) if "team-b/" in line)
    usage = lines[i + 1]
    assert "25Gi/20Gi" in usage
    assert "!" in usage
    named = next(i for i, line in enumerate(lines) if "team-a/trainer-0/main" in line)
    assert "!" not in lines[named + 1]


def test_view_throttled_marker() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    over = next(line for line in lines if "team-b/" in line)
    assert "THROTTLED duty=60%" in over
    named = next(line for line in lines if "team-a/trainer-0/main" in line)
    assert "THROTTLED" not in named


def test_view_unnamed_container_shows_its_allocation_id() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    assert any(UNNAMED in line for line in lines)
    assert container_name({"allocation_id": UNNAMED}).startswith(f"allocation {UNNAMED}")


def test_view_claim_pod_known_before_its_container_reads_as_such() -> None:
    # A DRA claim names its pod at prepare; pod-resources names the container a moment later.
    named_pod = {"allocation_id": UNNAMED, "namespace": "default", "pod": "trainer"}
    named_pod["container"] = ""
    assert container_name(named_pod) == "default/trainer (container not named yet)"
    assert container_name(named_pod | {"container": "main"}) == "default/trainer/main"


def test_view_unattributed_per_gpu() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    stray = [line.strip() for line in lines if "unattributed" in line]
    assert stray == ["unattributed: 1 process, 512Mi", "unattributed: 2 processes, 1Gi"]


def test_view_containers_sit_under_their_gpu() -> None:
    lines = render_status(doc_of(sample_snapshot()))
    gpu1 = next(i for i, line in enumerate(lines) if line.startswith("GPU 1"))
    assert any(UNNAMED in line for line in lines[gpu1:])
    assert not any("team-a/trainer-0" in line for line in lines[gpu1:])


def test_view_flags_stale_and_unregistered() -> None:
    fresh = render_status(doc_of(sample_snapshot()))
    assert "fresh" in fresh[0]
    assert "kubelet registered" in fresh[1]
    doc = doc_of(sample_snapshot(stale=True))
    doc["health"]["registered"] = False
    doc["health"]["pod_resources_ok"] = False
    stale = render_status(doc)
    assert "STALE" in stale[0]
    assert "kubelet NOT REGISTERED" in stale[1]
    assert "pod-resources DOWN" in stale[1]


def test_an_idle_poll_is_in_the_document_and_the_view() -> None:
    busy = doc_of(sample_snapshot())
    assert busy["health"]["polling_idle"] is False
    assert "idle" not in render_status(busy)[1]
    base = sample_snapshot()
    health = dataclasses.replace(base.health, poll_interval_s=5.0, polling_idle=True)
    idle = doc_of(dataclasses.replace(base, health=health))
    assert (idle["health"]["polling_idle"], idle["health"]["poll_interval_s"]) == (True, 5.0)
    assert "idle (polled every 5s)" in render_status(idle)[1]


def test_mps_state_in_the_document_and_the_view() -> None:
    off = doc_of(sample_snapshot())
    assert off["health"]["mps"] is None
    assert "MPS" not in render_status(off)[1]
    base = sample_snapshot()
    health = dataclasses.replace(
        base.health, mps=MpsStatus(up=True, pid=42, restarts_total=2, pipe_directory="/p")
    )
    doc = doc_of(dataclasses.replace(base, health=health))
    assert doc["health"]["mps"] == {
        "up": True,
        "pid": 42,
        "restarts_total": 2,
        "pipe_directory": "/p",
        "error": "",
        "protocol": 2,
        "drains_total": 0,
        "undrained_total": 0,
        "wedges_total": 0,
        "canary_error": "",
        "drift_total": {},
        "root_clients": [],
        "namespaces": [],
    }
    assert "MPS v2 up" in render_status(doc)[1]
    doc["health"]["mps"]["up"] = False
    assert "MPS v2 DOWN" in render_status(doc)[1]


def test_view_of_an_empty_node() -> None:
    snapshot = NodeSnapshot(taken_at_s=T0, node_name="empty")
    lines = render_status(doc_of(snapshot))
    assert lines[0].startswith("node empty")
    assert "enforcement actions: none" in lines


def test_view_tolerates_missing_fields() -> None:
    # A document from a daemon of another version: no crash, still within the width.
    lines = render_status({"gpus": [{"index": 0}], "containers": [{"gpu_uuid": "x"}]})
    assert all(len(line) <= 80 for line in lines)
    assert any(line.startswith("GPU 0  ?") for line in lines)
    assert "containers on GPUs not in this snapshot: 1" in lines


def test_view_shows_the_entitlement_next_to_the_share() -> None:
    """A container held at 33% of a 25% share is within what work-conserving sharing lets it
    use; the view says so, instead of 33%/25% looking like enforcement failing."""
    snapshot = sample_snapshot()
    containers = tuple(
        dataclasses.replace(c, entitlement_ratio=0.33)
        if c.allocation_id == OVER_LIMIT.allocation_id
        else c
        for c in snapshot.containers
    )
    doc = doc_of(dataclasses.replace(snapshot, containers=containers))
    over = next(c for c in doc["containers"] if c["allocation_id"] == OVER_LIMIT.allocation_id)
    assert over["entitlement_ratio"] == pytest.approx(0.33)
    lines = render_status(doc)
    line = next(line for line in lines if "team-b/" in line)
    assert "share 25%, may use 33%" in line
    assert "THROTTLED duty=60%" in line
    named = next(line for line in lines if "team-a/trainer-0/main" in line)
    assert "may use" not in named  # not decided yet: nothing claimed


def mig_snapshot() -> NodeSnapshot:
    """The sample node with GPU 0 in MIG mode: two MIG devices, a container on one."""
    base = sample_snapshot()
    parent = base.gpus[0]
    devices = []
    for gi, profile in ((1, "3g.40gb"), (2, "1g.10gb")):
        info = dataclasses.replace(
            parent.info,
            uuid=f"MIG-00000000-0000-4000-8000-00000000000{gi}",
            memory_total_bytes=40 * GiB,
            parent_uuid=parent.info.uuid,
            mig_profile=profile,
            gpu_instance_id=gi,
            compute_instance_id=0,
        )
        devices.append(
            dataclasses.replace(
                parent,
                reading=dataclasses.replace(parent.reading, info=info, sm_util_percent=None),
                sm_utilization_ratio=None,
            )
        )
    on_mig = dataclasses.replace(NAMED_A, gpu_uuid=devices[0].info.uuid, pod="on-mig")
    parent_in_mig = dataclasses.replace(
        parent, reading=dataclasses.replace(parent.reading, info=dataclasses.replace(
            parent.info, mig_enabled=True))
    )  # fmt: skip
    # MIG devices listed before their parent: the view still groups them under it.
    gpus = (*devices, parent_in_mig, *base.gpus[1:])
    return dataclasses.replace(base, gpus=gpus, containers=(on_mig,))


def test_mig_devices_name_their_parent_and_say_compute_is_not_enforced() -> None:
    doc = doc_of(mig_snapshot())
    device = next(g for g in doc["gpus"] if g["mig_profile"] == "3g.40gb")
    assert device["parent_gpu_uuid"] == UUID0
    assert (device["gpu_instance_id"], device["compute_instance_id"]) == (1, 0)
    assert device["compute_enforced"] is False
    assert next(g for g in doc["gpus"] if g["uuid"] == UUID1)["compute_enforced"] is True
    (container,) = doc["containers"]
    assert container["compute_enforced"] is False
    assert container["sm_utilization_ratio"] is None


def test_the_view_groups_mig_devices_under_their_gpu() -> None:
    lines = render_status(doc_of(mig_snapshot()), width=100)
    starts = [i for i, line in enumerate(lines) if line.startswith(("GPU ", "  MIG "))]
    headings = [lines[i].split("  GI")[0] for i in starts]
    headings = [h.split("  ")[0] if h.startswith("GPU") else h for h in headings]
    assert headings == ["GPU 0", "  MIG 3g.40gb", "  MIG 1g.10gb", "GPU 1"]
    mig_block = "\n".join(lines[starts[1] : starts[3]])
    assert "compute: not measurable per MIG device (NVML), not enforced" in mig_block
    assert "default/on-mig" in mig_block or "on-mig" in mig_block


def test_the_header_counts_gpus_and_mig_devices_apart() -> None:
    snapshot = mig_snapshot()
    full = [g for g in snapshot.gpus if not g.info.is_mig_device]
    mig = [g for g in snapshot.gpus if g.info.is_mig_device]
    assert len(mig) == 2
    assert len(full) == 2
    healthy = sum(1 for g in full if g.reading.healthy)
    header = "\n".join(render_status(doc_of(snapshot), width=120)[:3])
    assert f"GPUs {healthy}/2 healthy" in header
    assert "MIG devices 2/2 healthy" in header


def test_view_names_the_dra_claim_a_container_holds() -> None:
    snapshot = sample_snapshot()
    claimed = tuple(
        dataclasses.replace(a, source=SOURCE_DRA, claim="team-a/gpu-15")
        if a.allocation_id == NAMED_A.allocation_id
        else a
        for a in snapshot.allocations
    )
    lines = render_status(doc_of(dataclasses.replace(snapshot, allocations=claimed)))
    named = next(line for line in lines if "team-a/trainer-0/main" in line)
    assert "claim team-a/gpu-15" in named
    assert "slices" not in named
    # A device-plugin allocation still shows its slice count.
    assert "1 slice" in next(line for line in lines if "team-b/" in line)
