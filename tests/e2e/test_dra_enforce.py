"""vgpu as a DRA driver enforcing a claim on real containers: a real kubelet v1.36.2, the real
scheduler, containerd 2.x with CDI + runc (docs/dra.md, "On the real node, with real containers").

Pods ask as a user would: a ResourceClaimTemplate in the pod spec (or, to share one claim, a
ResourceClaim both pods name), and nothing else: no environment in the pod spec. The kubelet
puts the CDI device IDs NodePrepareResources returned (`vgpu.dev/claim=<claim UID>` and
`nvidia.com/gpu=<uuid>`) into the CreateContainer request; containerd resolves them in the
node's /var/run/cdi (vgpu's spec for the claim; the harness's stand-in NVIDIA spec for the fake
GPU) and applies their edits. The tests read what the container's first process has
(/proc/PID/environ) against the spec file the daemon wrote: every variable of it.

Everything is real but the GPU, the fake backend's: the test lists the containers' real PIDs in
its state file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeProcess, FakeState
from tests.e2e.harness import (
    CdiEdits,
    Cluster,
    ContainerdOptions,
    Daemon,
    pod_manifest,
    standin_nvidia_spec,
    wait_until,
)
from tests.e2e.runtime import STANDIN_SPEC, standin_env_name
from tests.e2e.test_dra import (
    DRIVER,
    GPU,
    GPUS,
    NS,
    RESOURCE_API,
    _install,
    claim_of,
    claim_pod,
    clean_claims,
    spec_files,
    start_dra,
)

RUNTIME = "containerd"
CONTAINERD_OPTIONS = ContainerdOptions(nri=True)  # served, no plugin: see test_nri_is_served
GiB = 1024**3
CONFIG = """\
slicing: {replicas: 4}
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {action: kill, gracePeriod: 1s}
  compute: {action: throttle, window: 1s, period: 250ms}
"""
# Pod -> the claim template of test_dra's TEMPLATES it names, and its limits: 15Gi and 30%;
# 25Gi and no compute, so the default, one slice's 25%.
PODS = {"p15": "m15-c30", "p25": "m25"}
LIMITS = {"p15": (15 * 1024, 30), "p25": (25 * 1024, 25)}


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


def shared_claim_pod(name: str, claim: str) -> dict[str, Any]:
    """A pod whose container uses the ResourceClaim `claim` (made before, shared)."""
    pod = pod_manifest(name)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def spec_file_env(cluster: Cluster, uid: str) -> dict[str, str]:
    spec = json.loads((cluster.paths.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
    (device,) = [d for d in spec["devices"] if d["name"] == uid]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def assert_has_the_claims_cdi_env(cluster: Cluster, pod: str, uid: str) -> dict[str, str]:
    """The container's first process has every variable of the claim's spec file, as written,
    and the stand-in NVIDIA device's (the runtime applied both CDI devices); that environment."""
    written = spec_file_env(cluster, uid)
    has = cluster.container_env(pod, "main")
    assert {k: has.get(k) for k in written} == written, f"{pod}: {has}"
    assert has[standin_env_name(GPU.uuid)] == GPU.uuid
    assert has["VGPU_ALLOCATION_ID"] == allocation_id(uid)
    pod_spec_env = cluster.pod(pod)["spec"]["containers"][0].get("env")
    assert pod_spec_env is None, pod_spec_env
    return has


def claim_pods(cluster: Cluster) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """A Running pod on each claim template of PODS: each pod's claim UID and its container's
    environment (from CDI)."""
    for pod, template in PODS.items():
        cluster.create_pod(claim_pod(pod, template))
    for pod in PODS:
        cluster.wait_running(pod)
    uids = {pod: str(claim_of(cluster, pod)["metadata"]["uid"]) for pod in PODS}
    envs = {pod: assert_has_the_claims_cdi_env(cluster, pod, uids[pod]) for pod in PODS}
    return uids, envs


def named(dra: Daemon, envs: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """/status's allocation record of each pod's claim (`envs`: each pod's environment), once
    every one is named with its container."""

    def listed() -> dict[str, dict[str, Any]] | None:
        records = {a["allocation_id"]: a for a in dra.status()["allocations"]}
        found = {pod: records.get(env["VGPU_ALLOCATION_ID"]) for pod, env in envs.items()}
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
    yield dra.cluster
    clean_claims(dra.cluster, GPUS)


def test_a_claim_over_its_memory_is_killed_its_neighbour_untouched(
    node: Cluster, dra: Daemon
) -> None:
    cluster = node
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    uids, envs = claim_pods(cluster)
    timings["two pods Running"] = time.monotonic() - t0

    # The scheduler granted what was asked (p25 the compute default) on the one GPU, and each
    # container has what its prepared claim's CDI spec carries (claim_pods checked it), among
    # it the limits of what was granted.
    assert sorted(spec_files(cluster)) == sorted(f"{DRIVER}-claim_{u}.json" for u in uids.values())
    pids: dict[str, int] = {}
    for pod, (mib, percent) in LIMITS.items():
        (result,) = claim_of(cluster, pod)["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == (DRIVER, "gpu-0")
        assert result["consumedCapacity"] == {"memory": f"{mib // 1024}Gi", "compute": str(percent)}
        limits = (envs[pod]["VGPU_MEMORY_LIMIT_MIB_0"], envs[pod]["VGPU_COMPUTE_SHARE_PERCENT_0"])
        assert limits == (str(mib), str(percent))
        pids[pod] = cluster.container_init_pid(pod, "main")

    # Attribution's evidence: each claim named with its pod (reservedFor) and its container
    # (the kubelet's pod-resources DRA entries) in /status.
    records = named(dra, envs)
    for pod in PODS:
        record = records[pod]
        assert (record["namespace"], record["pod"], record["container"]) == (NS, pod, "main")
        claim = claim_of(cluster, pod)["metadata"]["name"]
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
    # The restarted container has its claim's CDI devices again.
    assert_has_the_claims_cdi_env(cluster, "p15", uids["p15"])
    print("\n" + ", ".join(f"{k}: {v:.2f}s" for k, v in timings.items()))


def test_a_pod_joining_a_prepared_claim_is_held_to_it_too(node: Cluster, dra: Daemon) -> None:
    """A ResourceClaim shared by two pods: the kubelet prepares it for the first and, for the
    second, only lists it in pod-resources. The second pod's container is the claim's too:
    named with it in /status, and its process over the claim's memory killed, the first pod's
    untouched."""
    cluster = node
    uid = make_claim(cluster, "shared", "15Gi", "30")
    for pod in ("first", "second"):
        cluster.create_pod(shared_claim_pod(pod, "shared"))
        cluster.wait_running(pod)
    # Prepared once, for the first pod; the kubelet hands both containers its CDI devices.
    env = assert_has_the_claims_cdi_env(cluster, "first", uid)
    assert_has_the_claims_cdi_env(cluster, "second", uid)
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
    pids = {pod: cluster.container_init_pid(pod, "main") for pod in PODS}
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


# A CDI hook: the OCI state on its stdin, with what /proc says of the state's process then.
HOOK = """
import json, sys
state = json.load(sys.stdin)
proc = f"/proc/{state['pid']}"
record = {"state": state, "cgroup": open(f"{proc}/cgroup").read(),
          "cmdline": open(f"{proc}/cmdline").read().split("\\0")}
with open(f"{sys.argv[1]}/{state['id']}.json", "w") as out:
    json.dump(record, out)
"""


def test_a_cdi_hook_runs_before_the_containers_command_in_its_cgroup(
    node: Cluster, dra: Daemon
) -> None:
    """A `createRuntime` hook in a CDI device's edits (here the stand-in NVIDIA device's) is run
    by runc in the node's namespaces once the container's init process is in the container's
    own cgroup and before it runs the container's command; the OCI state on the hook's stdin
    names that process (its host PID)."""
    out = Path(node.paths.root / "hook-records")
    out.mkdir()
    hook = {"hookName": "createRuntime", "path": sys.executable,
            "args": ["python3", "-c", HOOK, str(out)]}  # fmt: skip
    node.write_cdi_spec(STANDIN_SPEC, standin_nvidia_spec(GPUS, CdiEdits(hooks=[hook])))
    node.create_pod(claim_pod("hooked", "m5-c5"))
    node.wait_running("hooked")
    cid = node.container_id("hooked", "main")
    record = json.loads((out / f"{cid}.json").read_text())
    pid = node.container_init_pid("hooked", "main")
    assert record["state"]["pid"] == pid
    assert record["state"]["status"] == "creating"
    # Not yet the container's command: runc's own init, which execs it once started.
    assert [Path(record["cmdline"][0]).name, record["cmdline"][1]] == ["runc", "init"]
    # The memory controller's line (cgroup v1), else cgroup v2's, as container_cgroup reads it.
    lines = [line.split(":", 2) for line in record["cgroup"].splitlines()]
    cgroup = next(p for _, ctl, p in lines if "memory" in ctl.split(",") or ctl == "")
    assert cgroup == node.container_cgroup("hooked", "main")
    assert cgroup.endswith(f"/{cid}")
    assert node.container_env("hooked", "main")["VGPU_MEMORY_LIMIT_MIB_0"] == "5120"


def test_nri_is_served_where_a_plugin_would_connect(node: Cluster) -> None:
    """CONTAINERD_OPTIONS asks for NRI: containerd serves it at /var/run/nri/nri.sock in the
    node (`paths.nri_socket` on the host), with no plugin."""
    assert stat.S_ISSOCK(node.paths.nri_socket.stat().st_mode)
    assert "created NRI interface" in (node.paths.log_dir / "containerd.log").read_text()
