"""The daemon's metrics registry (docs/design.md §5, a contract): the snapshots the exporter's
tests share (`sample_snapshot` also serves the status-view and HTTP tests), every series with
its labels, the histograms, the private registry, and /healthz. The snapshot collector's
families are tested in tests/unit/test_collector.py.
"""

from __future__ import annotations

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
    # the memory limits the driver enforces (docs/design.md §15)
    "vgpu_gpu_memory_enforcement": GPU | {"mode", "cause"},
    "vgpu_container_gpu_memory_request_bytes": CONTAINER,
    "vgpu_container_gpu_memory_enforced_by": CONTAINER | {"by"},
    "vgpu_memory_limit_actions_total": NODE_ONLY | {"action"},
    "vgpu_memory_limit_hook_served": NODE_ONLY,
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
