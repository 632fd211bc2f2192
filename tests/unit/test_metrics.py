"""The exporter's metrics (docs/design.md §5, a contract) from hand-built snapshots, on a
private registry.

`sample_snapshot` is shared with the status-view and HTTP tests.
"""

from __future__ import annotations

import dataclasses
import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    DeviceGrant,
    DraDevice,
    EnforcementCount,
    GpuInfo,
    GpuReading,
    GpuUsage,
    MpsStatus,
    NodeSnapshot,
    ProcessSample,
)
from deviceplugin.usage.metrics import DURATION_BUCKETS_S, DaemonMetrics, healthz

GiB = 1024**3
MiB = 1024**2
NODE = "node-a"
T0 = 1_714_564_800.0  # wall clock of the sample snapshot
UUID0 = "GPU-00000000-0000-4000-8000-000000000000"
UUID1 = "GPU-00000000-0000-4000-8000-000000000001"
UNNAMED = "0123456789abcdef"
LONG_POD = "inference-server-with-a-really-quite-long-generated-name-7f9c6d5b4-x2k9z"

NAMED_A = ContainerUsage(
    allocation_id="aaaaaaaaaaaaaaaa",
    gpu_uuid=UUID0,
    gpu_index=0,
    slices=2,
    memory_used_bytes=10 * GiB,
    memory_limit_bytes=40 * GiB,
    sm_utilization_ratio=0.45,
    compute_share_ratio=0.5,
    processes=(ProcessSample(4100, 10 * GiB, 45.0),),
    namespace="team-a",
    pod="trainer-0",
    container="main",
)
OVER_LIMIT = ContainerUsage(
    allocation_id="bbbbbbbbbbbbbbbb",
    gpu_uuid=UUID0,
    gpu_index=0,
    slices=1,
    memory_used_bytes=25 * GiB,
    memory_limit_bytes=20 * GiB,
    sm_utilization_ratio=0.3,
    compute_share_ratio=0.25,
    processes=(ProcessSample(4200, 20 * GiB, 20.0), ProcessSample(4201, 5 * GiB, 10.0)),
    namespace="team-b",
    pod=LONG_POD,
    container="server",
    duty_cycle_ratio=0.6,
    throttled_seconds_total=12.5,
)
# Spans both GPUs: one entry per GPU. Its SM figure is past 1 (per-process figures can sum over
# 100 %): the exporter keeps ratios within 0..1.
SPANNING = tuple(
    ContainerUsage(
        allocation_id="cccccccccccccccc",
        gpu_uuid=uuid,
        gpu_index=i,
        slices=1,
        memory_used_bytes=1 * GiB,
        memory_limit_bytes=20 * GiB,
        sm_utilization_ratio=1.3,
        compute_share_ratio=0.25,
        namespace="team-c",
        pod="spread-0",
        container="worker",
    )
    for i, uuid in enumerate((UUID0, UUID1))
)
UNNAMED_C = ContainerUsage(
    allocation_id=UNNAMED,
    gpu_uuid=UUID1,
    gpu_index=1,
    slices=1,
    memory_used_bytes=0,
    memory_limit_bytes=20 * GiB,
    sm_utilization_ratio=0.0,
    compute_share_ratio=0.25,
)
CONTAINERS = (NAMED_A, OVER_LIMIT, *SPANNING, UNNAMED_C)


def sample_snapshot(
    *,
    stale: bool = False,
    containers: tuple[ContainerUsage, ...] = CONTAINERS,
    health: DaemonHealth | None = None,
    allocations: tuple[AllocationRecord, ...] | None = None,
) -> NodeSnapshot:
    """2 GPUs (one healthy and busy, one lost), named, unnamed, over-limit, throttled and spanning
    containers, stray processes and enforcement counts."""
    gpu0 = GpuInfo(UUID0, 0, "NVIDIA A100-SXM4-80GB", 80 * GiB, 0, 0, "00000000:07:00.0")
    gpu1 = GpuInfo(UUID1, 1, "NVIDIA A100-SXM4-80GB", 80 * GiB, 1)
    gpus = (
        GpuUsage(
            GpuReading(gpu0, True, "", 37 * GiB, 81.0),
            sm_utilization_ratio=0.8,
            slices_total=4,
            slices_allocated=4,
            unattributed=(ProcessSample(900, 512 * MiB, 3.0),),
        ),
        GpuUsage(
            GpuReading(
                gpu1,
                False,
                "Xid 79: GPU has fallen off the bus",
                None,
                None,
                unhealthy_transitions=1,
                xid_errors=((13, 4), (79, 1)),
            ),
            sm_utilization_ratio=None,
            slices_total=4,
            slices_allocated=2,
            slices_unhealthy=2,
            unattributed=(ProcessSample(901, None), ProcessSample(902, 1 * GiB, None)),
        ),
    )
    allocations = allocations or (
        AllocationRecord(NAMED_A.allocation_id, (f"{UUID0}::0", f"{UUID0}::1"), T0 - 600),
        AllocationRecord(OVER_LIMIT.allocation_id, (f"{UUID0}::2",), T0 - 300),
        AllocationRecord(UNNAMED, (f"{UUID1}::0",), T0 - 1),
    )
    enforcement = (
        EnforcementCount(
            OVER_LIMIT.allocation_id, UUID0, "memory", "kill", 2, "team-b", LONG_POD, "server"
        ),
        EnforcementCount(
            OVER_LIMIT.allocation_id, UUID0, "compute", "throttle", 7, "team-b", LONG_POD, "server"
        ),
        EnforcementCount(UNNAMED, UUID1, "memory", "monitor", 1),
    )
    return NodeSnapshot(
        taken_at_s=T0,
        node_name=NODE,
        gpus=gpus,
        containers=containers,
        allocations=allocations,
        stale=stale,
        health=health
        or DaemonHealth(
            registered=True,
            registrations_total=3,
            registration_failures_total=1,
            last_poll_success_s=T0,
            pod_resources_ok=True,
        ),
        enforcement=enforcement,
        signals_not_sent=(("moved", 1), ("permission_denied", 2)),
    )


DRA_GPU = GpuInfo(
    "GPU-00000000-0000-4000-8000-0000000000d0", 0, "NVIDIA A100-PCIE-40GB", 40 * GiB, 0
)
DRA_MIG_PARENT = GpuInfo(
    "GPU-00000000-0000-4000-8000-0000000000d1", 1, "NVIDIA A100-SXM4-80GB", 80 * GiB, 1,
    mig_enabled=True,
)  # fmt: skip
DRA_MIG = GpuInfo(
    "MIG-00000000-0000-4000-8000-0000000000d2", 1, "NVIDIA A100-SXM4-80GB 3g.40gb", 40 * GiB, 1,
    parent_uuid=DRA_MIG_PARENT.uuid, mig_profile="3g.40gb", gpu_instance_id=1,
    compute_instance_id=0, mig_index=0,
)  # fmt: skip
# Two claims on the A100 (15Gi and 30% of it, 25Gi and 25%): its memory is all claimed.
DRA_CLAIMS = (
    AllocationRecord(
        "c1a1c1a1c1a1c1a1", (), T0 - 60, "ml", "p15", "main",
        grants=(DeviceGrant(DRA_GPU.uuid, 15 * GiB, 0.3),), source=SOURCE_DRA, claim="ml/p15-gpu",
    ),
    AllocationRecord(
        "c2a2c2a2c2a2c2a2", (), T0 - 30, "ml", "p25", "main",
        grants=(DeviceGrant(DRA_GPU.uuid, 25 * GiB, 0.25),), source=SOURCE_DRA, claim="ml/p25-gpu",
    ),
)  # fmt: skip


def dra_sample_snapshot() -> NodeSnapshot:
    """DRA mode: an A100 whose memory two claims consumed, and a MIG device of another GPU (in
    MIG mode, so no device itself) that no claim holds."""
    gpus = (
        GpuUsage(
            GpuReading(DRA_GPU, True, "", 30 * GiB, 50.0),
            sm_utilization_ratio=0.5,
            dra=DraDevice("gpu-0", 40 * GiB, 0, 0.55, 0.45, 2, True),
        ),
        GpuUsage(GpuReading(DRA_MIG_PARENT), sm_utilization_ratio=None),
        GpuUsage(
            GpuReading(DRA_MIG),
            sm_utilization_ratio=None,
            dra=DraDevice("gpu-1-mig-1-0", 0, 40 * GiB, 0.0, 1.0, 0, False),
        ),
    )
    containers = tuple(
        ContainerUsage(
            a.allocation_id, DRA_GPU.uuid, 0, 1, 10 * GiB, a.grants[0].memory_limit_bytes, 0.25,
            a.grants[0].compute_share_ratio, namespace=a.namespace, pod=a.pod,
            container=a.container,
        )
        for a in DRA_CLAIMS
    )  # fmt: skip
    return NodeSnapshot(
        taken_at_s=T0,
        node_name=NODE,
        gpus=gpus,
        containers=containers,
        allocations=DRA_CLAIMS,
        health=DaemonHealth(registered=True, last_poll_success_s=T0, pod_resources_ok=True),
        kubelet_api=SOURCE_DRA,
    )


class Holder:
    """The latest snapshot, swapped whole, as the poll loop does."""

    def __init__(self, snapshot: NodeSnapshot | None) -> None:
        self.snapshot = snapshot
        self.reads = 0

    def get(self) -> NodeSnapshot | None:
        self.reads += 1
        return self.snapshot


def make(snapshot: NodeSnapshot | None) -> tuple[DaemonMetrics, Holder]:
    holder = Holder(snapshot)
    return DaemonMetrics(NODE, holder.get, version="1.2.3", clock=lambda: T0 + 0.75), holder


GPU = {
    "node",
    "gpu_uuid",
    "gpu_index",
    "parent_gpu_uuid",
    "mig_profile",
    "gpu_instance_id",
    "compute_instance_id",
}
NO_MIG = dict.fromkeys(
    ("parent_gpu_uuid", "mig_profile", "gpu_instance_id", "compute_instance_id"), ""
)
CONTAINER = {"node", "namespace", "pod", "container", "gpu_uuid", "allocation_id"}
NODE_ONLY = {"node"}

# Every series the exporter writes, by exposed sample name, with exactly its label names.
EXPECTED_LABELS: dict[str, set[str]] = {
    # docs/design.md §5
    "vgpu_gpu_info": GPU | {"model", "minor", "numa_node", "pci_bus_id"},
    "vgpu_gpu_healthy": GPU,
    "vgpu_gpu_memory_total_bytes": GPU,
    "vgpu_gpu_memory_used_bytes": GPU,
    "vgpu_gpu_utilization_ratio": GPU,
    "vgpu_slices": GPU | {"state"},
    "vgpu_container_gpu_memory_used_bytes": CONTAINER,
    "vgpu_container_gpu_memory_limit_bytes": CONTAINER,
    "vgpu_container_sm_utilization_ratio": CONTAINER,
    "vgpu_container_compute_share_ratio": CONTAINER,
    "vgpu_container_throttled_seconds_total": CONTAINER,
    "vgpu_enforcement_actions_total": CONTAINER | {"kind", "action"},
    "vgpu_enforcement_signals_not_sent_total": NODE_ONLY | {"reason"},
    "vgpu_allocation_info": (CONTAINER - {"gpu_uuid"}) | {"source", "claim"},
    "vgpu_allocate_duration_seconds_bucket": NODE_ONLY | {"le"},
    "vgpu_allocate_duration_seconds_sum": NODE_ONLY,
    "vgpu_allocate_duration_seconds_count": NODE_ONLY,
    "vgpu_poll_duration_seconds_bucket": NODE_ONLY | {"le"},
    "vgpu_poll_duration_seconds_sum": NODE_ONLY,
    "vgpu_poll_duration_seconds_count": NODE_ONLY,
    "vgpu_kubelet_registrations_total": NODE_ONLY,
    # the daemon's own health
    "vgpu_gpu_unhealthy_transitions_total": GPU,
    "vgpu_gpu_xid_errors_total": GPU | {"xid"},
    "vgpu_gpu_unattributed_processes": GPU,
    "vgpu_gpu_misattributed_processes": GPU,
    "vgpu_gpu_unattributed_memory_bytes": GPU,
    "vgpu_snapshot_stale": NODE_ONLY,
    "vgpu_snapshot_age_seconds": NODE_ONLY,
    "vgpu_last_successful_poll_timestamp_seconds": NODE_ONLY,
    "vgpu_kubelet_registered": NODE_ONLY,
    "vgpu_kubelet_registration_failures_total": NODE_ONLY,
    "vgpu_pod_resources_up": NODE_ONLY,
    "vgpu_build_info": NODE_ONLY | {"version"},
}
# prometheus_client's own creation-time series of each histogram.
CREATED = {"vgpu_allocate_duration_seconds_created", "vgpu_poll_duration_seconds_created"}


def exposed(metrics: DaemonMetrics) -> dict[str, list[dict[str, str]]]:
    """Every sample of the text exposition, parsed back, as name -> label sets."""
    payload, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(payload.decode()):
        assert family.documentation, f"{family.name} has no HELP text"
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return samples


def exposed_values(metrics: DaemonMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    payload, _ = metrics.render()
    values: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(payload.decode()):
        for sample in family.samples:
            values.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return values


def container_labels(c: ContainerUsage) -> dict[str, str]:
    return {
        "node": NODE,
        "namespace": c.namespace,
        "pod": c.pod,
        "container": c.container,
        "gpu_uuid": c.gpu_uuid,
        "allocation_id": c.allocation_id,
    }


def gpu_labels(uuid: str, index: int) -> dict[str, str]:
    return {"node": NODE, "gpu_uuid": uuid, "gpu_index": str(index)} | NO_MIG


# --- names and labels ------------------------------------------------------------------------


def test_every_series_has_exactly_the_contract_labels() -> None:
    metrics, _ = make(sample_snapshot())
    samples = exposed(metrics)
    assert set(samples) - CREATED == set(EXPECTED_LABELS)
    for name, label_sets in samples.items():
        if name in CREATED:
            continue
        for labels in label_sets:
            assert set(labels) == EXPECTED_LABELS[name], name
            assert labels["node"] == NODE


def test_signals_the_enforcer_did_not_send_are_counted_by_reason() -> None:
    metrics, _ = make(sample_snapshot())
    not_sent = exposed_values(metrics)["vgpu_enforcement_signals_not_sent_total"]
    assert sorted((labels["reason"], value) for labels, value in not_sent) == [
        ("moved", 1.0),
        ("permission_denied", 2.0),
    ]


def test_series_are_unique() -> None:
    metrics, _ = make(sample_snapshot())
    for name, label_sets in exposed(metrics).items():
        keys = [tuple(sorted(labels.items())) for labels in label_sets]
        assert len(keys) == len(set(keys)), name


def test_ratios_stay_within_0_and_1() -> None:
    metrics, _ = make(sample_snapshot())
    values = exposed_values(metrics)
    ratios = [name for name in values if name.endswith("_ratio")]
    assert len(ratios) == 3
    for name in ratios:
        for _, value in values[name]:
            assert 0.0 <= value <= 1.0, name
    # 1.3 from the backend is exposed as 1.
    spanning = container_labels(SPANNING[0])
    assert metrics.registry.get_sample_value("vgpu_container_sm_utilization_ratio", spanning) == 1


def test_help_texts_name_their_units() -> None:
    metrics, _ = make(sample_snapshot())
    payload, _ = metrics.render()
    for family in text_string_to_metric_families(payload.decode()):
        doc = family.documentation
        if family.name.endswith("_bytes"):
            assert "bytes" in doc, family.name
        elif family.name.endswith("_seconds"):
            assert "seconds" in doc, family.name
        elif family.name.endswith("_ratio"):
            assert "0..1" in doc, family.name


# --- values ----------------------------------------------------------------------------------


def test_gpu_series() -> None:
    metrics, _ = make(sample_snapshot())
    r = metrics.registry
    g0, g1 = gpu_labels(UUID0, 0), gpu_labels(UUID1, 1)
    info0 = g0 | {
        "model": "NVIDIA A100-SXM4-80GB",
        "minor": "0",
        "numa_node": "0",
        "pci_bus_id": "00000000:07:00.0",
    }
    info1 = g1 | {"model": "NVIDIA A100-SXM4-80GB", "minor": "1", "numa_node": "", "pci_bus_id": ""}
    assert r.get_sample_value("vgpu_gpu_info", info0) == 1
    assert r.get_sample_value("vgpu_gpu_info", info1) == 1
    assert r.get_sample_value("vgpu_gpu_healthy", g0) == 1
    assert r.get_sample_value("vgpu_gpu_healthy", g1) == 0
    assert r.get_sample_value("vgpu_gpu_memory_total_bytes", g1) == 80 * GiB
    assert r.get_sample_value("vgpu_gpu_memory_used_bytes", g0) == 37 * GiB
    assert r.get_sample_value("vgpu_gpu_utilization_ratio", g0) == pytest.approx(0.8)
    # Unknown on the lost GPU: no sample rather than a made-up zero.
    assert r.get_sample_value("vgpu_gpu_memory_used_bytes", g1) is None
    assert r.get_sample_value("vgpu_gpu_utilization_ratio", g1) is None


@pytest.mark.parametrize(
    ("uuid", "index", "allocated", "free", "unhealthy"),
    [(UUID0, 0, 4, 0, 0), (UUID1, 1, 2, 0, 2)],
)
def test_slices_by_state(uuid: str, index: int, allocated: int, free: int, unhealthy: int) -> None:
    metrics, _ = make(sample_snapshot())
    g = gpu_labels(uuid, index)
    for state, want in (("allocated", allocated), ("free", free), ("unhealthy", unhealthy)):
        assert metrics.registry.get_sample_value("vgpu_slices", g | {"state": state}) == want


def test_unattributed_processes_per_gpu() -> None:
    metrics, _ = make(sample_snapshot())
    r = metrics.registry
    assert r.get_sample_value("vgpu_gpu_unattributed_processes", gpu_labels(UUID0, 0)) == 1
    assert r.get_sample_value("vgpu_gpu_unattributed_memory_bytes", gpu_labels(UUID0, 0)) == (
        512 * MiB
    )
    # A process whose memory the driver did not report counts as a process, not as memory.
    assert r.get_sample_value("vgpu_gpu_unattributed_processes", gpu_labels(UUID1, 1)) == 2
    assert r.get_sample_value("vgpu_gpu_unattributed_memory_bytes", gpu_labels(UUID1, 1)) == GiB


def test_container_series() -> None:
    metrics, _ = make(sample_snapshot())
    r = metrics.registry
    over = container_labels(OVER_LIMIT)
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", over) == 25 * GiB
    assert r.get_sample_value("vgpu_container_gpu_memory_limit_bytes", over) == 20 * GiB
    assert r.get_sample_value("vgpu_container_sm_utilization_ratio", over) == pytest.approx(0.3)
    assert r.get_sample_value("vgpu_container_compute_share_ratio", over) == pytest.approx(0.25)
    assert r.get_sample_value("vgpu_container_throttled_seconds_total", over) == 12.5
    a = container_labels(NAMED_A)
    assert r.get_sample_value("vgpu_container_throttled_seconds_total", a) == 0


def test_unnamed_container_is_known_by_its_allocation_id() -> None:
    metrics, _ = make(sample_snapshot())
    labels = container_labels(UNNAMED_C)
    assert labels["namespace"] == labels["pod"] == labels["container"] == ""
    r = metrics.registry
    assert r.get_sample_value("vgpu_container_gpu_memory_limit_bytes", labels) == 20 * GiB


def test_a_container_on_two_gpus_has_a_series_per_gpu() -> None:
    metrics, _ = make(sample_snapshot())
    for c in SPANNING:
        labels = container_labels(c)
        assert metrics.registry.get_sample_value("vgpu_container_gpu_memory_used_bytes", labels)


def test_enforcement_counts_carry_container_labels() -> None:
    metrics, _ = make(sample_snapshot())
    r = metrics.registry
    over = container_labels(OVER_LIMIT)
    kill = over | {"kind": "memory", "action": "kill"}
    throttle = over | {"kind": "compute", "action": "throttle"}
    monitor = container_labels(UNNAMED_C) | {"kind": "memory", "action": "monitor"}
    assert r.get_sample_value("vgpu_enforcement_actions_total", kill) == 2
    assert r.get_sample_value("vgpu_enforcement_actions_total", throttle) == 7
    assert r.get_sample_value("vgpu_enforcement_actions_total", monitor) == 1


def allocation_labels(a: AllocationRecord) -> dict[str, str]:
    return {
        "node": NODE,
        "namespace": a.namespace,
        "pod": a.pod,
        "container": a.container,
        "allocation_id": a.allocation_id,
        "source": a.source,
        "claim": a.claim,
    }


PLUGIN_ALLOCATION = AllocationRecord(
    NAMED_A.allocation_id,
    (f"{UUID0}::0", f"{UUID0}::1"),
    T0 - 600,
    namespace="team-a",
    pod="trainer-0",
    container="main",
)
DRA_ALLOCATION = AllocationRecord(
    "dddddddddddddddd",
    (),
    T0 - 60,
    namespace="team-d",
    pod="claimant-0",
    container="main,sidecar",
    grants=(DeviceGrant(UUID1, 10 * GiB, 0.25),),
    source=SOURCE_DRA,
    claim="team-d/gpu-claim",
)


def test_each_allocation_has_an_info_series_naming_its_source_and_claim() -> None:
    metrics, _ = make(sample_snapshot(allocations=(PLUGIN_ALLOCATION, DRA_ALLOCATION)))
    info = exposed_values(metrics)["vgpu_allocation_info"]
    assert info == [
        (allocation_labels(PLUGIN_ALLOCATION), 1.0),
        (allocation_labels(DRA_ALLOCATION), 1.0),
    ]
    plugin, dra = (labels for labels, _ in info)
    assert (plugin["source"], plugin["claim"]) == ("device-plugin", "")
    assert (dra["source"], dra["claim"]) == ("dra", "team-d/gpu-claim")


def test_a_released_allocation_drops_its_info_series_on_the_next_scrape() -> None:
    metrics, holder = make(sample_snapshot(allocations=(PLUGIN_ALLOCATION, DRA_ALLOCATION)))
    r = metrics.registry
    assert r.get_sample_value("vgpu_allocation_info", allocation_labels(DRA_ALLOCATION)) == 1
    holder.snapshot = sample_snapshot(allocations=(PLUGIN_ALLOCATION,))
    assert r.get_sample_value("vgpu_allocation_info", allocation_labels(DRA_ALLOCATION)) is None
    assert r.get_sample_value("vgpu_allocation_info", allocation_labels(PLUGIN_ALLOCATION)) == 1
    ids = {labels["allocation_id"] for labels in exposed(metrics)["vgpu_allocation_info"]}
    assert ids == {PLUGIN_ALLOCATION.allocation_id}


def test_daemon_health_series() -> None:
    metrics, _ = make(sample_snapshot())
    r = metrics.registry
    n = {"node": NODE}
    assert r.get_sample_value("vgpu_kubelet_registrations_total", n) == 3
    assert r.get_sample_value("vgpu_kubelet_registration_failures_total", n) == 1
    assert r.get_sample_value("vgpu_kubelet_registered", n) == 1
    assert r.get_sample_value("vgpu_pod_resources_up", n) == 1
    assert r.get_sample_value("vgpu_snapshot_stale", n) == 0
    assert r.get_sample_value("vgpu_last_successful_poll_timestamp_seconds", n) == T0
    assert r.get_sample_value("vgpu_snapshot_age_seconds", n) == pytest.approx(0.75)
    assert r.get_sample_value("vgpu_build_info", n | {"version": "1.2.3"}) == 1


def test_stale_snapshot_is_flagged() -> None:
    down = DaemonHealth(registered=False, unregistered_since_s=5.0, pod_resources_ok=False)
    metrics, _ = make(sample_snapshot(stale=True, health=down))
    r = metrics.registry
    n = {"node": NODE}
    assert r.get_sample_value("vgpu_snapshot_stale", n) == 1
    assert r.get_sample_value("vgpu_kubelet_registered", n) == 0
    assert r.get_sample_value("vgpu_pod_resources_up", n) == 0
    assert r.get_sample_value("vgpu_last_successful_poll_timestamp_seconds", n) == 0


# --- scrape life cycle -----------------------------------------------------------------------


def test_before_the_first_snapshot_only_build_info_and_histograms() -> None:
    metrics, _ = make(None)
    names = set(exposed(metrics)) - CREATED
    assert names == {
        "vgpu_build_info",
        *(
            f"{h}_{suffix}"
            for h in ("vgpu_allocate_duration_seconds", "vgpu_poll_duration_seconds")
            for suffix in ("bucket", "sum", "count")
        ),
    }
    assert (
        metrics.registry.get_sample_value("vgpu_poll_duration_seconds_count", {"node": NODE}) == 0
    )


def test_a_removed_container_drops_its_series_on_the_next_scrape() -> None:
    metrics, holder = make(sample_snapshot())
    labels = container_labels(OVER_LIMIT)
    assert metrics.registry.get_sample_value("vgpu_container_gpu_memory_used_bytes", labels)
    holder.snapshot = sample_snapshot(containers=(NAMED_A, UNNAMED_C))
    for name, label_sets in exposed(metrics).items():
        if name.startswith("vgpu_container_"):
            assert OVER_LIMIT.allocation_id not in {s["allocation_id"] for s in label_sets}
            assert len(label_sets) == 2, name
    r = metrics.registry
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", labels) is None
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", container_labels(NAMED_A))


def test_a_container_named_later_moves_to_its_named_series() -> None:
    metrics, holder = make(sample_snapshot(containers=(UNNAMED_C,)))
    named = dataclasses.replace(UNNAMED_C, namespace="ns", pod="p", container="c")
    holder.snapshot = sample_snapshot(containers=(named,))
    r = metrics.registry
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", container_labels(named)) == 0
    unnamed = container_labels(UNNAMED_C)
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", unnamed) is None


def test_each_scrape_reads_the_snapshot_once() -> None:
    metrics, holder = make(sample_snapshot())
    metrics.render()
    assert holder.reads == 1
    metrics.render()
    assert holder.reads == 2


def test_histograms_observe() -> None:
    metrics, _ = make(None)
    metrics.observe_allocate(0.003)
    metrics.observe_allocate(0.2)
    metrics.observe_poll(0.0004)
    r = metrics.registry
    n = {"node": NODE}

    def bucket(name: str, le: float) -> float | None:
        return r.get_sample_value(f"{name}_bucket", n | {"le": str(le)})

    assert bucket("vgpu_allocate_duration_seconds", 0.0025) == 0
    assert bucket("vgpu_allocate_duration_seconds", 0.005) == 1
    assert bucket("vgpu_allocate_duration_seconds", 0.25) == 2
    assert r.get_sample_value("vgpu_allocate_duration_seconds_bucket", n | {"le": "+Inf"}) == 2
    assert r.get_sample_value("vgpu_allocate_duration_seconds_count", n) == 2
    assert r.get_sample_value("vgpu_allocate_duration_seconds_sum", n) == pytest.approx(0.203)
    assert bucket("vgpu_poll_duration_seconds", 0.0005) == 1
    assert r.get_sample_value("vgpu_poll_duration_seconds_count", n) == 1
    assert DURATION_BUCKETS_S[0] < 0.001 < DURATION_BUCKETS_S[-1]


def test_registry_is_private() -> None:
    first, _ = make(sample_snapshot())
    second, _ = make(sample_snapshot())  # no clash: each owns its registry
    first.observe_poll(0.01)
    n = {"node": NODE}
    assert second.registry.get_sample_value("vgpu_poll_duration_seconds_count", n) == 0
    default = prometheus_client.REGISTRY
    assert default.get_sample_value("vgpu_poll_duration_seconds_count", n) is None
    assert default.get_sample_value("vgpu_build_info", n | {"version": "1.2.3"}) is None


def test_nan_ratio_is_exposed_as_zero() -> None:
    odd = dataclasses.replace(NAMED_A, sm_utilization_ratio=math.nan)
    metrics, _ = make(sample_snapshot(containers=(odd,)))
    labels = container_labels(odd)
    assert metrics.registry.get_sample_value("vgpu_container_sm_utilization_ratio", labels) == 0


# --- healthz ---------------------------------------------------------------------------------

MONO = 10_000.0


@pytest.mark.parametrize(
    ("snapshot", "ok", "reason"),
    [
        pytest.param(None, False, "no poll yet", id="no-snapshot"),
        pytest.param(sample_snapshot(), True, "ok", id="fresh"),
        pytest.param(
            sample_snapshot(health=DaemonHealth(registered=True, last_poll_success_s=T0 - 30)),
            False,
            "last successful poll 31.0s ago",
            id="poll-stale",
        ),
        pytest.param(
            sample_snapshot(health=DaemonHealth(registered=True, last_poll_success_s=0)),
            False,
            "no successful poll yet",
            id="never-polled",
        ),
        pytest.param(
            sample_snapshot(
                health=DaemonHealth(
                    registered=False, unregistered_since_s=MONO - 120, last_poll_success_s=T0
                )
            ),
            False,
            "not registered with the kubelet for 120.0s",
            id="unregistered-too-long",
        ),
        pytest.param(
            sample_snapshot(
                health=DaemonHealth(
                    registered=False, unregistered_since_s=MONO - 5, last_poll_success_s=T0
                )
            ),
            True,
            "ok",
            id="unregistered-briefly",
        ),
        pytest.param(
            sample_snapshot(stale=True, health=DaemonHealth(True, 0, 1, 0, T0 - 2, 1, True)),
            True,
            "ok",
            id="one-failed-poll",
        ),
        pytest.param(
            sample_snapshot(health=DaemonHealth(True, 0, 1, 0, T0, 0, True, MpsStatus(up=True))),
            True,
            "ok",
            id="mps-up",
        ),
        pytest.param(
            sample_snapshot(
                health=DaemonHealth(
                    True, 0, 1, 0, T0, 0, True, MpsStatus(down_since_s=MONO - 5, error="x")
                )
            ),
            True,
            "ok",
            id="mps-down-briefly",
        ),
        pytest.param(
            sample_snapshot(
                health=DaemonHealth(
                    True, 0, 1, 0, T0, 0, True, MpsStatus(down_since_s=MONO - 45, error="gone")
                )
            ),
            False,
            "MPS control daemon down for 45.0s (limit 30s): gone",
            id="mps-down-too-long",
        ),
    ],
)
def test_healthz(snapshot: NodeSnapshot | None, ok: bool, reason: str) -> None:
    got_ok, got_reason = healthz(
        snapshot,
        now_mono_s=MONO,
        now_wall_s=T0 + 1,
        poll_stale_after_s=10,
        unregistered_after_s=60,
    )
    assert got_ok is ok
    assert got_reason.startswith(reason)


def test_health_counters_per_gpu_and_xid() -> None:
    metrics = DaemonMetrics("node-a", sample_snapshot, version="test")
    value = metrics.registry.get_sample_value
    gpu1 = {"node": "node-a", "gpu_uuid": UUID1, "gpu_index": "1"} | NO_MIG
    gpu0 = {"node": "node-a", "gpu_uuid": UUID0, "gpu_index": "0"} | NO_MIG
    assert value("vgpu_gpu_unhealthy_transitions_total", gpu1) == 1
    assert value("vgpu_gpu_unhealthy_transitions_total", gpu0) == 0
    assert value("vgpu_gpu_xid_errors_total", {**gpu1, "xid": "79"}) == 1
    assert value("vgpu_gpu_xid_errors_total", {**gpu1, "xid": "13"}) == 4
    assert value("vgpu_gpu_xid_errors_total", {**gpu0, "xid": "13"}) is None


def test_mps_series_only_when_mps_is_on() -> None:
    off = DaemonMetrics("node-a", sample_snapshot, version="test")
    assert off.registry.get_sample_value("vgpu_mps_daemon_up", {"node": "node-a"}) is None
    health = DaemonHealth(True, 0, 1, 0, T0, 0, True, MpsStatus(up=False, restarts_total=3))
    on = DaemonMetrics("node-a", lambda: sample_snapshot(health=health), version="test")
    value = on.registry.get_sample_value
    assert value("vgpu_mps_daemon_up", {"node": "node-a"}) == 0
    assert value("vgpu_mps_daemon_restarts_total", {"node": "node-a"}) == 3


def test_a_mig_device_is_a_gpu_series_naming_its_parent_and_has_no_utilisation() -> None:
    base = sample_snapshot()
    parent = base.gpus[0].info
    mig_info = dataclasses.replace(
        parent,
        uuid="MIG-00000000-0000-4000-8000-000000000009",
        name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        memory_total_bytes=40 * GiB,
        parent_uuid=parent.uuid,
        mig_profile="3g.40gb",
        gpu_instance_id=2,
        compute_instance_id=0,
    )
    mig_gpu = dataclasses.replace(
        base.gpus[0],
        reading=dataclasses.replace(base.gpus[0].reading, info=mig_info, sm_util_percent=None),
        sm_utilization_ratio=None,
    )
    on_mig = dataclasses.replace(CONTAINERS[0], gpu_uuid=mig_info.uuid)
    snapshot = dataclasses.replace(
        base, gpus=(*base.gpus, mig_gpu), containers=(*base.containers, on_mig)
    )
    r = make(snapshot)[0].registry
    g = gpu_labels(mig_info.uuid, parent.index) | {
        "parent_gpu_uuid": parent.uuid,
        "mig_profile": "3g.40gb",
        "gpu_instance_id": "2",
        "compute_instance_id": "0",
    }
    info = g | {
        "model": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        "minor": str(parent.minor),
        "numa_node": "" if parent.numa_node is None else str(parent.numa_node),
        "pci_bus_id": parent.pci_bus_id or "",
    }
    assert r.get_sample_value("vgpu_slices", g | {"state": "free"}) is not None
    assert r.get_sample_value("vgpu_gpu_info", info) == 1
    assert r.get_sample_value("vgpu_gpu_memory_total_bytes", g) == 40 * GiB
    assert r.get_sample_value("vgpu_gpu_utilization_ratio", g) is None
    labels = container_labels(on_mig)
    assert r.get_sample_value("vgpu_container_gpu_memory_used_bytes", labels) is not None
    assert r.get_sample_value("vgpu_container_sm_utilization_ratio", labels) is None


# --- DRA mode --------------------------------------------------------------------------------

DRA_DEVICE = GPU | {"device"}
DRA_SERIES = {
    "vgpu_dra_device_memory_claimed_bytes",
    "vgpu_dra_device_memory_free_bytes",
    "vgpu_dra_device_compute_claimed_ratio",
    "vgpu_dra_device_compute_free_ratio",
    "vgpu_dra_device_claims",
    "vgpu_dra_device_full",
}


def test_dra_mode_speaks_devices_and_claims_not_slices() -> None:
    metrics, _ = make(dra_sample_snapshot())
    samples = exposed(metrics)
    assert "vgpu_slices" not in samples  # no slice, so no "0 free" on a half-empty GPU
    for name in DRA_SERIES:
        assert [set(labels) for labels in samples[name]] == [DRA_DEVICE, DRA_DEVICE], name
    r = metrics.registry
    gpu0 = {"node": NODE, "gpu_uuid": DRA_GPU.uuid, "gpu_index": "0", **NO_MIG, "device": "gpu-0"}
    assert r.get_sample_value("vgpu_dra_device_memory_claimed_bytes", gpu0) == 40 * GiB
    assert r.get_sample_value("vgpu_dra_device_memory_free_bytes", gpu0) == 0
    assert r.get_sample_value("vgpu_dra_device_compute_claimed_ratio", gpu0) == 0.55
    assert r.get_sample_value("vgpu_dra_device_compute_free_ratio", gpu0) == 0.45
    assert r.get_sample_value("vgpu_dra_device_claims", gpu0) == 2
    assert r.get_sample_value("vgpu_dra_device_full", gpu0) == 1
    mig = {
        "node": NODE,
        "gpu_uuid": DRA_MIG.uuid,
        "gpu_index": "1",
        "parent_gpu_uuid": DRA_MIG_PARENT.uuid,
        "mig_profile": "3g.40gb",
        "gpu_instance_id": "1",
        "compute_instance_id": "0",
        "device": "gpu-1-mig-1-0",
    }
    assert r.get_sample_value("vgpu_dra_device_memory_free_bytes", mig) == 40 * GiB
    assert r.get_sample_value("vgpu_dra_device_full", mig) == 0
    # The containers' series are those of device-plugin mode, with the claims' grants.
    limits = {
        labels["pod"]: value
        for labels, value in exposed_values(metrics)["vgpu_container_gpu_memory_limit_bytes"]
    }
    assert limits == {"p15": 15 * GiB, "p25": 25 * GiB}


def test_device_plugin_mode_has_no_dra_series() -> None:
    metrics, _ = make(sample_snapshot())
    assert not DRA_SERIES & set(exposed(metrics))
