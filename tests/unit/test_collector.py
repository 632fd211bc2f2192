"""The snapshot collector's metric families (docs/design.md §5, a contract): names, labels
and values from hand-built snapshots, scraped through the daemon's private registry
(tests/unit/test_metrics.py has the snapshots and the registry's own series)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.model import (
    SOURCE_DRA,
    AllocationRecord,
    DaemonHealth,
    DeviceGrant,
    MpsStatus,
)
from deviceplugin.usage.metrics import DaemonMetrics
from tests.unit.test_metrics import (
    CONTAINERS,
    CREATED,
    DRA_GPU,
    DRA_MIG,
    DRA_MIG_PARENT,
    EXPECTED_LABELS,
    GPU,
    NAMED_A,
    NO_MIG,
    NODE,
    OVER_LIMIT,
    SPANNING,
    T0,
    UNNAMED_C,
    UUID0,
    UUID1,
    GiB,
    MiB,
    container_labels,
    dra_sample_snapshot,
    exposed,
    exposed_values,
    gpu_labels,
    make,
    sample_snapshot,
)

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


def test_nan_ratio_is_exposed_as_zero() -> None:
    odd = dataclasses.replace(NAMED_A, sm_utilization_ratio=math.nan)
    metrics, _ = make(sample_snapshot(containers=(odd,)))
    labels = container_labels(odd)
    assert metrics.registry.get_sample_value("vgpu_container_sm_utilization_ratio", labels) == 0


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
