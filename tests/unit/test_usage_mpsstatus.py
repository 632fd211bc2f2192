"""MPS v3 in /status, its terminal view and the metrics: per container its namespace, the
namespace's caps and its processes running as root; in the header the protocol, the wedges
restarted and the root clients; in the metrics the drains, wedges and each container's caps."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.model import MpsNamespace, MpsStatus, NodeSnapshot
from deviceplugin.usage.statusview import render_status
from tests.unit.test_metrics import NAMED_A, OVER_LIMIT, UUID0, GiB, make, sample_snapshot
from tests.unit.test_statusview import doc_of

ROOT_PID = NAMED_A.processes[0].pid
DIRECTORY = "/run/vgpu/mps/pipe/g0123456789/caaaaaaaaaa"
NAMESPACE = MpsNamespace(
    owner=NAMED_A.allocation_id,
    server="g0123456789",
    name="caaaaaaaaaa",
    pipe_directory=DIRECTORY,
    gpu_uuids=(UUID0,),
    active_thread_percentage=50,
    pinned_memory_mib=40 * 1024,
)


def v3_snapshot(
    *, wedges_total: int = 2, root_clients: tuple[int, ...] = (ROOT_PID, 9999)
) -> NodeSnapshot:
    """The sample node under MPS v3: NAMED_A in its namespace, its process running as root."""
    status = MpsStatus(
        up=True,
        pid=42,
        protocol=3,
        drains_total=3,
        wedges_total=wedges_total,
        restarts_total=2,
        namespaces=(NAMESPACE,),
        root_clients=root_clients,
    )
    base = sample_snapshot()
    health = dataclasses.replace(base.health, mps=status)
    return dataclasses.replace(base, health=health)


def test_status_gives_each_container_its_namespace_caps_and_root_processes() -> None:
    doc = doc_of(v3_snapshot())
    by_alloc = {c["allocation_id"]: c for c in doc["containers"]}
    assert by_alloc[NAMED_A.allocation_id]["mps"] == {
        "namespace": "g0123456789/caaaaaaaaaa",
        "pipe_directory": DIRECTORY,
        "active_thread_ratio": 0.5,
        "pinned_memory_limit_bytes": 40 * GiB,
        "root_clients": [ROOT_PID],  # its own; 9999 is another container's
    }
    # A container without a namespace (none was made for it) has none.
    assert by_alloc[OVER_LIMIT.allocation_id]["mps"] is None
    health = doc["health"]["mps"]
    assert (health["protocol"], health["wedges_total"], health["drains_total"]) == (3, 2, 3)
    assert health["root_clients"] == [ROOT_PID, 9999]
    assert health["namespaces"][0]["allocation_id"] == NAMED_A.allocation_id


def test_the_view_shows_wedges_root_clients_and_each_containers_namespace() -> None:
    text = "\n".join(render_status(doc_of(v3_snapshot()), width=160))
    assert "MPS v3 up (2 wedges restarted), 2 ROOT CLIENTS" in text
    assert (
        f"MPS namespace g0123456789/caaaaaaaaaa: threads 50%, pinned 40Gi, ROOT pids {ROOT_PID}"
        in text
    )
    # One namespace line: the container without one gets none.
    assert text.count("MPS namespace") == 1
    quiet = "\n".join(render_status(doc_of(v3_snapshot(wedges_total=0, root_clients=()))))
    assert "MPS v3 up" in quiet
    assert "wedge" not in quiet
    assert "ROOT" not in quiet


def test_the_metrics_count_drains_and_wedges_and_give_each_containers_caps() -> None:
    metrics, _ = make(v3_snapshot())
    payload, _ = metrics.render()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(payload.decode())
        for s in family.samples
    }
    node = (("node", "node-a"),)
    assert samples[("vgpu_mps_protocol", node)] == 3
    assert samples[("vgpu_mps_wedges_total", node)] == 2
    assert samples[("vgpu_mps_drains_total", node)] == 3
    assert samples[("vgpu_mps_root_clients", node)] == 2
    assert samples[("vgpu_mps_namespaces", node)] == 1
    labels = tuple(
        sorted(
            {
                "node": "node-a",
                "namespace": NAMED_A.namespace,
                "pod": NAMED_A.pod,
                "container": NAMED_A.container,
                "gpu_uuid": UUID0,
                "allocation_id": NAMED_A.allocation_id,
            }.items()
        )
    )
    assert samples[("vgpu_container_mps_active_thread_ratio", labels)] == 0.5
    assert samples[("vgpu_container_mps_pinned_memory_limit_bytes", labels)] == 40 * GiB
    caps = [n for n, _ in samples if n == "vgpu_container_mps_active_thread_ratio"]
    assert len(caps) == 1  # only the container with a namespace
