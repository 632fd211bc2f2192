"""vgpu as a DRA driver enforcing a claim on real containers: a real kubelet v1.36.2, the real
scheduler, containerd + runc (docs/dra.md, "On the real node, with real containers").

What a runtime with CDI does (containerd >= 1.7 with `enable_cdi`, CRI-O >= 1.23): the kubelet
puts the CDI device IDs that NodePrepareResources returned (`vgpu.dev/claim=<claim UID>`, and
`nvidia.com/gpu=<uuid>` by default) into the CreateContainer request; the runtime looks them up
in the spec files of /var/run/cdi and applies their container edits to the container's OCI spec.
vgpu's spec carries the environment (`NVIDIA_VISIBLE_DEVICES`, `VGPU_ALLOCATION_ID`,
`VGPU_MEMORY_LIMIT_MIB_<i>`, `VGPU_COMPUTE_SHARE_PERCENT_<i>`, framework hints), so the
container's processes carry the claim's allocation ID, by which the enforcer attributes them.

What this module substitutes: Debian's containerd 1.6 has no CDI and drops the CDI device IDs.
Each pod uses a ResourceClaim made before the pod (not from a template), so the claim's UID is
known in advance, and the pod spec itself carries the spec's environment: the allocation ID
derived by the documented formula (the first 16 hex digits of the SHA-256 of
`<GPU-UUID>::<claim UID>`), the visible GPU, and the limits of the amounts the claim asks for.
After the claim is prepared, the test checks that every one of those variables, as the
container's first process has it (/proc/PID/environ), equals what the spec file the daemon wrote
carries: the container has what a CDI runtime would have given it. The spec's other variables
(framework hints) are left out; nothing in enforcement reads them.

Everything else is real: the scheduler's allocation, the kubelet's prepare call, the pods'
cgroups and processes, the kubelet's pod-resources DRA entries, the kill and the restart. Only
the GPU is the fake backend's: the test lists the containers' real PIDs in its state file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeProcess, FakeState
from tests.e2e.harness import Cluster, Daemon, containerd_available, pod_manifest, wait_until
from tests.e2e.test_dra import DRIVER, GPU, GPUS, NS, RESOURCE_API, _install, spec_files, start_dra

pytestmark = pytest.mark.skipif(
    not containerd_available(),
    reason="needs real containers: containerd, runc, ctr and busybox-static "
    "(apt-get install containerd runc busybox-static)",
)

RUNTIME = "containerd"
GiB = 1024**3
CONFIG = """\
slicing: {replicas: 4}
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {action: kill, gracePeriod: 1s}
  compute: {action: throttle, window: 1s, period: 250ms}
"""
# (claim, memory, compute): the compute one names none gets the default, one slice's 25.
CLAIMS = [("c15", "15Gi", "30"), ("c25", "25Gi", None)]
LIMITS = {"c15": (15 * 1024, 30), "c25": (25 * 1024, 25)}


def allocation_id(claim_uid: str) -> str:
    """docs/dra.md: a claim's VGPU_ALLOCATION_ID on one GPU."""
    return hashlib.sha256(f"{GPU.uuid}::{claim_uid}".encode()).hexdigest()[:16]


def make_claim(cluster: Cluster, name: str, memory: str, compute: str | None) -> str:
    """A ResourceClaim asking for `memory` (and `compute`) of one vgpu device; its UID."""
    requests = {"memory": memory, **({"compute": compute} if compute else {})}
    created = cluster.api.post(
        f"{RESOURCE_API}/namespaces/{NS}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "capacity": {"requests": requests},
                            },
                        }
                    ]
                }
            },
        },
    )
    return str(created["metadata"]["uid"])


def cdi_env(claim: str, uid: str) -> dict[str, str]:
    """What vgpu's CDI spec for the claim gives a container, as far as enforcement reads it;
    a CDI runtime would add it, here the pod spec carries it."""
    mib, percent = LIMITS[claim]
    return {
        "NVIDIA_VISIBLE_DEVICES": GPU.uuid,
        "VGPU_ALLOCATION_ID": allocation_id(uid),
        "VGPU_MEMORY_LIMIT_MIB_0": str(mib),
        "VGPU_COMPUTE_SHARE_PERCENT_0": str(percent),
    }


def claim_pod(name: str, claim: str, env: dict[str, str]) -> dict[str, Any]:
    pod = pod_manifest(name)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    main = pod["spec"]["containers"][0]
    main["resources"] = {"claims": [{"name": "gpu"}]}
    main["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return pod


def spec_file_env(cluster: Cluster, uid: str) -> dict[str, str]:
    spec = json.loads((cluster.paths.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
    (device,) = [d for d in spec["devices"] if d["name"] == uid]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


PODS = {"c15": "p15", "c25": "p25"}


def claim_pods(cluster: Cluster) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The claims of CLAIMS and a Running pod on each (PODS), the CDI spec's environment in its
    spec: the claims' UIDs and each pod's environment, by claim."""
    uids = {name: make_claim(cluster, name, memory, compute) for name, memory, compute in CLAIMS}
    envs = {name: cdi_env(name, uid) for name, uid in uids.items()}
    for claim, pod in PODS.items():
        cluster.create_pod(claim_pod(pod, claim, envs[claim]))
    for pod in PODS.values():
        cluster.wait_running(pod)
    return uids, envs


def named(dra: Daemon, envs: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """/status's allocation record of each claim, once every one is named with its container."""

    def listed() -> dict[str, dict[str, Any]] | None:
        records = {a["allocation_id"]: a for a in dra.status()["allocations"]}
        found = {claim: records.get(env["VGPU_ALLOCATION_ID"]) for claim, env in envs.items()}
        if all(r is not None and r.get("container") == "main" for r in found.values()):
            return {k: v for k, v in found.items() if v is not None}
        return None

    result: dict[str, dict[str, Any]] = wait_until(
        listed, timeout_s=20, what="both claims named in /status"
    )
    return result


@pytest.fixture(scope="module")
def dra(cluster: Cluster) -> Iterator[Daemon]:
    _install(cluster)
    daemon = start_dra(cluster, CONFIG)
    yield daemon
    daemon.kill()


@pytest.fixture
def node(dra: Daemon) -> Iterator[Cluster]:
    """The cluster, cleaned after the test: the fake GPU idle, every pod and claim deleted,
    every claim unprepared."""
    cluster = dra.cluster
    yield cluster
    cluster.write_gpus(GPUS)
    for pod in cluster.pods():
        cluster.delete_pod(pod["metadata"]["name"])
    claims = f"{RESOURCE_API}/namespaces/{NS}/resourceclaims"
    for claim in cluster.api.get(claims)["items"]:
        cluster.api.delete(f"{claims}/{claim['metadata']['name']}")
    wait_until(lambda: not spec_files(cluster), timeout_s=30, what="every claim unprepared")


def test_a_claim_over_its_memory_is_killed_its_neighbour_untouched(
    node: Cluster, dra: Daemon
) -> None:
    cluster = node
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    uids, envs = claim_pods(cluster)
    timings["two pods Running"] = time.monotonic() - t0

    # The scheduler granted what was asked (c25 the compute default) on the one GPU.
    for claim, (mib, percent) in LIMITS.items():
        obj = cluster.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/{claim}")
        (result,) = obj["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == (DRIVER, "gpu-0")
        assert result["consumedCapacity"] == {"memory": f"{mib // 1024}Gi", "compute": str(percent)}
    # The container has exactly what the prepared claim's CDI spec carries.
    assert sorted(spec_files(cluster)) == sorted(f"{DRIVER}-claim_{u}.json" for u in uids.values())
    pids: dict[str, int] = {}
    for claim, pod in PODS.items():
        written = spec_file_env(cluster, uids[claim])
        has = cluster.container_env(pod, "main")
        assert {k: has.get(k) for k in envs[claim]} == {k: written[k] for k in envs[claim]}
        pids[pod] = cluster.container_init_pid(pod, "main")

    # Attribution's evidence: each claim named with its pod (reservedFor) and its container
    # (the kubelet's pod-resources DRA entries) in /status.
    records = named(dra, envs)
    for claim, pod in PODS.items():
        record = records[claim]
        assert (record["namespace"], record["pod"], record["container"]) == (NS, pod, "main")
        assert (record["source"], record["claim"]) == ("dra", f"{NS}/{claim}")
    assert dra.status()["health"]["pod_resources_ok"] is True
    timings["claims named in /status"] = time.monotonic() - t0

    # 16Gi against a claim of 15Gi: over; 20Gi against 25Gi: within.
    def fake_gpu(*processes: FakeProcess) -> FakeState:
        return FakeState(gpus=(dataclasses.replace(GPU, processes=processes),))

    cluster.write_gpus(
        fake_gpu(
            FakeProcess(pid=pids["p15"], used_memory_bytes=16 * GiB),
            FakeProcess(pid=pids["p25"], used_memory_bytes=20 * GiB),
        )
    )
    started = time.monotonic()
    try:
        try:
            wait_until(
                lambda: not os.path.exists(f"/proc/{pids['p15']}"), timeout_s=15, what="the kill"
            )
        except TimeoutError:
            status = dra.status()
            raise AssertionError(
                f"p15/main (pid {pids['p15']}) not killed: gpus {json.dumps(status['gpus'])}, "
                f"containers {json.dumps(status['containers'])}, "
                f"enforcement {json.dumps(status['enforcement'])}\n{dra.log()[-3000:]}"
            ) from None
        killed_after = time.monotonic() - started
        assert killed_after >= 0.9, f"killed {killed_after:.2f}s after, before the 1s grace"
        timings["over the limit -> killed"] = killed_after

        def restarted() -> bool:
            (status,) = cluster.pod("p15")["status"]["containerStatuses"]
            return bool(status["restartCount"] >= 1 and status["state"].get("running"))

        wait_until(restarted, timeout_s=30, what="the kubelet restarting p15/main")
        timings["killed -> restarted, Running"] = time.monotonic() - started - killed_after
    finally:
        cluster.write_gpus(GPUS)

    # Attributed, not refused: no process on the GPU was misattributed.
    status = dra.status()
    (gpu_status,) = status["gpus"]
    assert gpu_status["misattributed_processes"] == 0, json.dumps(gpu_status)
    # The neighbour is untouched.
    assert os.path.exists(f"/proc/{pids['p25']}")
    (neighbour,) = cluster.pod("p25")["status"]["containerStatuses"]
    assert neighbour["restartCount"] == 0
    assert cluster.container_init_pid("p25", "main") == pids["p25"]
    kills = [e for e in status["enforcement"] if e["kind"] == "memory"]
    assert [(e["pod"], e["container"], e["action"]) for e in kills] == [("p15", "main", "kill")]
    log = dra.log()
    assert "action=kill" in log
    assert f"pid={pids['p15']}" in log
    # The restarted container carries the claim's allocation again (its env is the pod's).
    assert cluster.container_env("p15", "main")["VGPU_ALLOCATION_ID"] == allocation_id(uids["c15"])
    print("\n" + ", ".join(f"{k}: {v:.2f}s" for k, v in timings.items()))


def test_a_pod_joining_a_prepared_claim_is_held_to_it_too(node: Cluster, dra: Daemon) -> None:
    """A ResourceClaim shared by two pods: the kubelet prepares it for the first and, for the
    second, only lists it in pod-resources. The second pod's container is the claim's too:
    named with it in /status, and its process over the claim's memory killed, the first pod's
    untouched."""
    cluster = node
    uid = make_claim(cluster, "shared", "15Gi", "30")
    env = cdi_env("c15", uid)
    for pod in ("first", "second"):
        pod_spec = claim_pod(pod, "shared", env)
        cluster.create_pod(pod_spec)
        cluster.wait_running(pod)
    first = cluster.container_init_pid("first", "main")
    second = cluster.container_init_pid("second", "main")

    def shared() -> dict[str, Any] | None:
        for a in dra.status()["allocations"]:
            if a["allocation_id"] == env["VGPU_ALLOCATION_ID"] and a["pod"] == "first,second":
                return dict(a)
        return None

    started = time.monotonic()
    record = wait_until(shared, timeout_s=20, what="the second pod named with the claim")
    print(f"\nsecond pod named with the shared claim after {time.monotonic() - started:.2f}s")
    assert (record["container"], record["claim"]) == ("main", f"{NS}/shared")
    cluster.write_gpus(
        FakeState(
            gpus=(
                dataclasses.replace(
                    GPU,
                    processes=(
                        FakeProcess(pid=first, used_memory_bytes=GiB),
                        FakeProcess(pid=second, used_memory_bytes=15 * GiB),
                    ),
                ),
            )
        )
    )
    try:
        try:
            wait_until(lambda: not os.path.exists(f"/proc/{second}"), timeout_s=15, what="kill")
        except TimeoutError:
            status = dra.status()
            raise AssertionError(
                f"second/main (pid {second}) not killed: gpus {json.dumps(status['gpus'])}, "
                f"allocations {json.dumps(status['allocations'])}\n{dra.log()[-3000:]}"
            ) from None
    finally:
        cluster.write_gpus(GPUS)
    assert dra.status()["gpus"][0]["misattributed_processes"] == 0
    # 1Gi + 15Gi over the claim's 15Gi: the largest process goes, the other stays.
    assert os.path.exists(f"/proc/{first}")
    (status,) = cluster.pod("first")["status"]["containerStatuses"]
    assert status["restartCount"] == 0


def test_claims_busy_together_are_held_to_the_compute_they_consumed(
    node: Cluster, dra: Daemon
) -> None:
    """Both claims' processes want the whole GPU: each container's share is the compute its
    claim consumed (30 and 25), the duty cycle holds the one over its entitlement (the fake GPU
    gives a stopped process nothing), and once the demand is gone both run free, never killed,
    never left stopped."""
    cluster = node
    _, envs = claim_pods(cluster)
    named(dra, envs)
    pids = {pod: cluster.container_init_pid(pod, "main") for pod in PODS.values()}
    cluster.write_gpus(
        FakeState(
            gpus=(
                dataclasses.replace(
                    GPU,
                    processes=tuple(
                        FakeProcess(pid=pid, used_memory_bytes=GiB, sm_demand_percent=100)
                        for pid in pids.values()
                    ),
                ),
            )
        )
    )
    try:

        def smaller_share_throttled() -> dict[str, dict[str, Any]] | None:
            containers = {c["pod"]: c for c in dra.status()["containers"]}
            return containers if containers.get("p25", {}).get("throttled") else None

        containers = wait_until(smaller_share_throttled, timeout_s=20, what="p25 throttled")
        assert containers["p15"]["compute_share_ratio"] == pytest.approx(0.30)
        assert containers["p25"]["compute_share_ratio"] == pytest.approx(0.25)
        assert containers["p15"]["entitlement_ratio"] > containers["p25"]["entitlement_ratio"]
        assert ("p25", "throttle") in {(e["pod"], e["action"]) for e in dra.status()["enforcement"]}
    finally:
        cluster.write_gpus(GPUS)
    wait_until(
        lambda: not any(c["throttled"] for c in dra.status()["containers"]),
        timeout_s=20,
        what="throttle released",
    )
    for pod, pid in pids.items():
        (status,) = cluster.pod(pod)["status"]["containerStatuses"]
        assert status["restartCount"] == 0, pod
        with open(f"/proc/{pid}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] != "T", f"{pod} left stopped"
