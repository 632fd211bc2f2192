"""The memory limits the driver enforces as /status, the `status` view and the metrics show them
(deviceplugin.usage.memorydoc, memorymetrics, statusview): per GPU its enforcement and why it is
polled; per container its request, who holds it to its limit and since when, to the
microsecond; the count of each action on a limit."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from deviceplugin.limitsview import ContainerMemoryLimit, GpuMemoryEnforcement, MemoryLimitsView
from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.statusview import render_status
from tests.unit.test_metrics import (
    NAMED_A,
    OVER_LIMIT,
    T0,
    UUID0,
    UUID1,
    GiB,
    exposed_values,
    make,
    sample_snapshot,
)
from tests.unit.test_statusview import doc_of

SET_AT = T0 - 3.25 + 0.000123  # a fraction of a second that must survive to the microsecond
VIEW = MemoryLimitsView(
    gpus=(
        GpuMemoryEnforcement(UUID0, "driver-dmem"),
        GpuMemoryEnforcement(UUID1, "poll", "unhealthy", "the GPU is unhealthy: Xid 79"),
    ),
    limits=(
        ContainerMemoryLimit(
            gpu_uuid=UUID0,
            cgroup="/kubepods/burstable/pod-a/cri-containerd-1",
            pod_uid="pod-a",
            container_id="1",
            grants=(NAMED_A.allocation_id,),
            mode="driver-dmem",
            soft_bytes=20 * GiB,
            hard_bytes=40 * GiB,
            set_at_s=SET_AT,
            driver_used_bytes=9 * GiB,
        ),
        # A set still in flight: the container is polled until it returns.
        ContainerMemoryLimit(
            gpu_uuid=UUID0,
            cgroup="/kubepods/burstable/pod-b/cri-containerd-2",
            pod_uid="pod-b",
            container_id="2",
            grants=(OVER_LIMIT.allocation_id,),
            mode="driver-dmem",
            soft_bytes=20 * GiB,
            hard_bytes=20 * GiB,
            set_at_s=None,
        ),
    ),
    actions=(("set", 3), ("cleared", 1), ("refused", 2), ("failed", 1)),
    served=True,
    why_not="",
)


def limited() -> NodeSnapshot:
    snapshot = sample_snapshot()
    containers = tuple(
        dataclasses.replace(c, memory_request_bytes=20 * GiB) if c == NAMED_A else c
        for c in snapshot.containers
    )
    return dataclasses.replace(snapshot, containers=containers, memory_limits=VIEW)


def by_key(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["allocation_id"], c["gpu_uuid"]): c for c in doc["containers"]}


def test_each_gpu_says_how_its_memory_is_enforced_and_why_it_is_polled() -> None:
    gpu0, gpu1 = doc_of(limited())["gpus"]
    assert (gpu0["memory_enforcement"], gpu0["memory_enforcement_cause"]) == ("driver-dmem", None)
    assert gpu1["memory_enforcement"] == "poll"
    assert gpu1["memory_enforcement_cause"] == "unhealthy"
    assert "Xid 79" in gpu1["memory_enforcement_reason"]


def test_a_container_has_its_request_limit_enforcer_and_set_time_to_the_microsecond() -> None:
    c = by_key(doc_of(limited()))[(NAMED_A.allocation_id, UUID0)]
    assert (c["memory_request_bytes"], c["memory_limit_bytes"]) == (20 * GiB, 40 * GiB)
    assert c["memory_enforced_by"] == "driver-dmem"
    assert c["memory_limit_set_at"] == "2024-05-01T11:59:56.750123Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", c["memory_limit_set_at"])
    assert c["memory_driver_used_bytes"] == 9 * GiB


def test_a_container_whose_set_is_in_flight_or_without_a_hook_is_polled() -> None:
    doc = by_key(doc_of(limited()))
    in_flight = doc[(OVER_LIMIT.allocation_id, UUID0)]
    assert in_flight["memory_enforced_by"] == "poll"
    assert in_flight["memory_limit_set_at"] is None
    assert in_flight["memory_driver_used_bytes"] is None
    # No request below its limit: its request is its limit.
    assert in_flight["memory_request_bytes"] == in_flight["memory_limit_bytes"]


def test_the_node_counts_every_action_on_a_limit_and_lists_each_cgroup() -> None:
    section = doc_of(limited())["memory_limits"]
    assert section["served"] is True
    assert section["actions"] == {"set": 3, "cleared": 1, "refused": 2, "failed": 1}
    assert [entry["cgroup"] for entry in section["limits"]] == [
        "/kubepods/burstable/pod-a/cri-containerd-1",
        "/kubepods/burstable/pod-b/cri-containerd-2",
    ]


def test_the_view_shows_each_gpus_enforcement_and_a_containers_request_and_driver() -> None:
    lines = render_status(doc_of(limited()))
    assert "  memory limits: driver-dmem" in lines
    assert "  memory limits: poll (unhealthy)" in lines
    named = next(line for line in lines if "team-a/trainer-0/main" in line)
    assert "req 20Gi" in named
    assert "driver" in named
    over = next(line for line in lines if "team-b/" in line)
    assert "driver" not in over


def test_the_view_of_a_daemon_that_does_not_say_shows_nothing_of_it() -> None:
    doc = doc_of(limited())
    for g in doc["gpus"]:
        del g["memory_enforcement"]
    assert not any("memory limits" in line for line in render_status(doc))


def test_the_metrics_carry_the_same_figures() -> None:
    metrics, _ = make(limited())
    values = exposed_values(metrics)

    def of(name: str, **labels: str) -> list[float]:
        return [v for got, v in values[name] if labels.items() <= got.items()]

    assert of("vgpu_gpu_memory_enforcement", gpu_uuid=UUID0, mode="driver-dmem") == [1.0]
    assert of("vgpu_gpu_memory_enforcement", gpu_uuid=UUID1, mode="poll", cause="unhealthy") == [
        1.0
    ]
    named = {"allocation_id": NAMED_A.allocation_id, "gpu_uuid": UUID0}
    assert of("vgpu_container_gpu_memory_request_bytes", **named) == [20 * GiB]
    assert of("vgpu_container_gpu_memory_enforced_by", **named, by="driver-dmem") == [1.0]
    assert of("vgpu_container_gpu_memory_limit_set_timestamp_seconds", **named) == [SET_AT]
    assert of("vgpu_container_gpu_memory_driver_used_bytes", **named) == [9 * GiB]
    over = {"allocation_id": OVER_LIMIT.allocation_id, "gpu_uuid": UUID0}
    assert of("vgpu_container_gpu_memory_enforced_by", **over, by="poll") == [1.0]
    for action, count in (("set", 3), ("cleared", 1), ("refused", 2), ("failed", 1)):
        assert of("vgpu_memory_limit_actions_total", action=action) == [count], action
    assert of("vgpu_memory_limit_hook_served") == [1.0]
