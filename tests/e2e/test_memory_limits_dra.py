"""GPU memory limits the driver enforces, with vgpu as a DRA driver, on the real node
(docs/design.md §15, docs/dra.md): each prepared claim's CDI spec carries the createRuntime
hook; the kubelet hands the claim's CDI devices to containerd 2.x, whose runc runs the hook, the
real static binary, and the daemon sets the claim's memory on the container's own cgroup through
the fake driver before the container's first instruction: the memory the claim consumed as the
soft limit (its request), its `vgpu.dev` parameters' memoryLimit (or the request) as the hard
one.

Everything is real but the GPU, the fake backend's. The tests read what the runtime did (the
container's view at its first instruction, its cgroup), the claims' status and the fake
driver's file."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeMigDevice, FakeProcess, FakeState
from tests.blackbox.daemon_harness import gpu as fake_gpu
from tests.e2e.harness import Cluster, ContainerdOptions, Daemon, wait_until
from tests.e2e.memlimits import (
    GPU,
    GPUS,
    GiB,
    build_hook,
    container_status,
    enforced,
    gpu_status,
    hook_failures_after_restart,
    limit_args,
    limits_on,
    partitioned,
    seeing_pod,
    seen_by,
    started_at_wall_s,
    under_node,
    wait_nothing_left,
)
from tests.e2e.test_dra import (
    DRIVER,
    NS,
    RESOURCE_API,
    _install,
    _post,
    claim_of,
    clean_claims,
)
from tests.e2e.test_dra import start_dra as start_dra_driver

RUNTIME = "containerd"
CONTAINERD_OPTIONS = ContainerdOptions()
CONFIG = """\
slicing: {replicas: 4}
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {action: kill, gracePeriod: 1s, pressureFreeBelow: 12Gi}
"""
PARAMETERS_VERSION = f"{DRIVER}/v1alpha1"


def template(name: str, memory: str, limit: str | None = None) -> dict[str, Any]:
    """A claim template asking for `memory` of one device, with a memory limit in its
    parameters when `limit` is given."""
    spec: dict[str, Any] = {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": DRIVER,
                        "capacity": {"requests": {"memory": memory}},
                    },
                }
            ]
        }
    }
    if limit is not None:
        parameters = {"apiVersion": PARAMETERS_VERSION, "kind": "GpuConfig", "memoryLimit": limit}
        spec["devices"]["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}
        ]
    return {"kind": "ResourceClaimTemplate", "metadata": {"name": name}, "spec": {"spec": spec}}


def claim_seeing_pod(
    cluster: Cluster, name: str, *, template_name: str = "", claim: str = ""
) -> dict[str, Any]:
    pod = seeing_pod(cluster, name)
    source = (
        {"resourceClaimTemplateName": template_name}
        if template_name
        else {"resourceClaimName": claim}
    )
    pod["spec"]["resourceClaims"] = [{"name": "gpu", **source}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


@pytest.fixture(scope="module")
def dra(cluster: Cluster) -> Iterator[Daemon]:
    _install(cluster)
    for body in (
        template("m8", "8Gi"),
        template("m8-burst", "8Gi", "20Gi"),
        template("m10", "10Gi"),
    ):
        _post(cluster, f"{RESOURCE_API}/namespaces/{NS}/resourceclaimtemplates", body)
    hook = build_hook(cluster)
    daemon = start_dra(cluster, hook)
    yield daemon
    daemon.kill()


def start_dra(cluster: Cluster, hook: Path) -> Daemon:
    daemon = start_dra_driver(cluster, CONFIG, gpus=GPUS, args=limit_args(cluster, hook))
    wait_until(lambda: daemon.status()["memory_limits"]["served"], timeout_s=20, what="hook served")
    return daemon


@pytest.fixture
def node(dra: Daemon) -> Iterator[Cluster]:
    yield dra.cluster
    clean_claims(dra.cluster, GPUS)


def spec_hooks(cluster: Cluster, uid: str) -> list[dict[str, Any]]:
    spec = json.loads((cluster.paths.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
    (device,) = spec["devices"]
    hooks: list[dict[str, Any]] = device["containerEdits"].get("hooks", [])
    return hooks


def test_a_claims_memory_is_set_on_the_containers_cgroup_before_its_first_instruction(
    node: Cluster, dra: Daemon
) -> None:
    node.create_pod(claim_seeing_pod(node, "p8", template_name="m8-burst"))
    node.wait_running("p8")
    claim = claim_of(node, "p8")
    (hook,) = spec_hooks(node, claim["metadata"]["uid"])
    assert hook["hookName"] == "createRuntime"
    cgroup = node.container_cgroup("p8", "main")
    seen = seen_by(node, "p8")["gpus"][GPU.uuid]["limits"][cgroup]
    # The memory the claim consumed is the request (soft), its parameters' limit the hard one.
    assert (seen["soft_bytes"], seen["hard_bytes"]) == (8 * GiB, 20 * GiB)
    assert seen["set_at_s"] >= started_at_wall_s(node.container_init_pid("p8", "main"))
    status = enforced(dra, "p8")
    assert (status["memory_request_bytes"], status["memory_limit_bytes"]) == (8 * GiB, 20 * GiB)
    # The scheduler accounted the request: 8Gi of the device's 40Gi consumed.
    (gpu,) = dra.status()["gpus"]
    assert gpu["dra"]["memory_claimed_bytes"] == 8 * GiB
    env = node.container_env("p8", "main")
    assert env["VGPU_MEMORY_LIMIT_MIB_0"] == str(20 * 1024)
    node.delete_pod("p8")
    wait_nothing_left(node, GPU.uuid)


def test_a_claim_shared_by_two_pods_limits_each_pods_container(node: Cluster, dra: Daemon) -> None:
    """The kubelet prepares a shared claim once, for the first pod; the second pod's container
    asks for its limits under the same claim, which the daemon reads again to find the pod."""
    created = node.api.post(
        f"{RESOURCE_API}/namespaces/{NS}/resourceclaims",
        {
            "kind": "ResourceClaim",
            "metadata": {"name": "shared"},
            "spec": template("x", "10Gi")["spec"]["spec"],
        },
    )
    uid = created["metadata"]["uid"]
    for pod in ("first", "second"):
        node.create_pod(claim_seeing_pod(node, pod, claim="shared"))
        node.wait_running(pod)
    limits = limits_on(node, GPU.uuid)
    for pod in ("first", "second"):
        cgroup = node.container_cgroup(pod, "main")
        assert (limits[cgroup]["soft_bytes"], limits[cgroup]["hard_bytes"]) == (10 * GiB, 10 * GiB)
        assert cgroup in seen_by(node, pod)["gpus"][GPU.uuid]["limits"]
    assert len(spec_hooks(node, uid)) == 1
    # /status shows both once the memory-limits part has published its next view.
    wait_until(
        lambda: (
            {
                r["cgroup"]
                for r in dra.status()["memory_limits"]["limits"]
                if r["gpu_uuid"] == GPU.uuid
            }
            == {node.container_cgroup(pod, "main") for pod in ("first", "second")}
        ),
        timeout_s=10,
        what="both limits in /status",
    )


def test_two_containers_of_a_pod_sharing_a_claim_get_a_limit_each(
    node: Cluster, dra: Daemon
) -> None:
    pod = claim_seeing_pod(node, "pair", template_name="m8-burst")
    first = pod["spec"]["containers"][0]
    pod["spec"]["containers"].append({**first, "name": "second"})
    node.create_pod(pod)
    node.wait_running("pair")
    limits = limits_on(node, GPU.uuid)
    for name in ("main", "second"):
        cgroup = node.container_cgroup("pair", name)
        assert (limits[cgroup]["soft_bytes"], limits[cgroup]["hard_bytes"]) == (8 * GiB, 20 * GiB)
        assert cgroup in seen_by(node, "pair", name)["gpus"][GPU.uuid]["limits"]
    # /status lists both cgroups under the claim; the claim is one allocation, so one row of
    # its pod in `containers`, enforced by the driver once both are set.
    cgroups = {node.container_cgroup("pair", name) for name in ("main", "second")}
    wait_until(
        lambda: {r["cgroup"] for r in dra.status()["memory_limits"]["limits"]} >= cgroups,
        timeout_s=10,
        what="both limits in /status",
    )
    rows = wait_until(
        lambda: [c for c in dra.status()["containers"] if c["pod"] == "pair"] or None,
        timeout_s=20,
        what="the claim's row",
    )
    assert {r["memory_enforced_by"] for r in rows} == {"driver-dmem"}, rows


def test_an_unhealthy_gpu_is_polled(node: Cluster, dra: Daemon) -> None:
    """A GPU that turns unhealthy is polled from then on, and /status says why; healthy
    again, its driver enforces again."""
    node.write_gpus(
        FakeState(gpus=(dataclasses.replace(GPU, healthy=False, health_reason="Xid 79"),))
    )

    def cause() -> str:
        (gpu,) = dra.status()["gpus"]
        return str(gpu["memory_enforcement_cause"])

    wait_until(lambda: cause() == "unhealthy", timeout_s=20, what="the unhealthy GPU polled")
    (gpu,) = dra.status()["gpus"]
    assert gpu["memory_enforcement"] == "poll"
    assert "Xid 79" in gpu["memory_enforcement_reason"]
    node.write_gpus(GPUS)
    wait_until(
        lambda: dra.status()["gpus"][0]["memory_enforcement"] == "driver-dmem",
        timeout_s=20,
        what="enforced by the driver again",
    )


# A driver that partitions memory, but the GPU is in MIG mode: partitions are for whole GPUs.
MIG_GPU = dataclasses.replace(
    partitioned(fake_gpu(1, name="NVIDIA A100-SXM4-80GB", memory_gib=80)),
    mig_enabled=True,
    mig_devices=(FakeMigDevice("MIG-e2e-mem-1", 1, 0, "3g.40gb", 40 * GiB),),
    mig_block=True,
)


def test_a_claim_on_a_mig_device_is_polled_and_gets_no_hook(node: Cluster, dra: Daemon) -> None:
    """A claim for a MIG device: its CDI spec carries no hook, its container is polled, and
    /status says why (`mig`); the whole GPU beside it stays enforced by the driver."""
    dra.write_config(CONFIG + "mig: {strategy: single}\n")
    node.write_gpus(FakeState(gpus=(GPU, MIG_GPU)))
    templated = False
    try:
        body = template("mig8", "8Gi")
        (request,) = body["spec"]["spec"]["devices"]["requests"]
        request["exactly"]["selectors"] = [
            {"cel": {"expression": f'device.attributes["{DRIVER}"].type == "mig"'}}
        ]
        _post(node, f"{RESOURCE_API}/namespaces/{NS}/resourceclaimtemplates", body)
        templated = True
        wait_until(
            lambda: any(g["uuid"] == "MIG-e2e-mem-1" for g in dra.status()["gpus"]),
            timeout_s=30,
            what="the MIG device",
        )
        node.create_pod(claim_seeing_pod(node, "on-mig", template_name="mig8"))
        node.wait_running("on-mig")
        claim = claim_of(node, "on-mig")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-1-mig-1-0"
        assert spec_hooks(node, claim["metadata"]["uid"]) == []
        status = wait_until(
            lambda: container_status(dra, "on-mig"), timeout_s=20, what="on-mig in /status"
        )
        assert status["memory_enforced_by"] == "poll"
        # The memory-limits part publishes its view of a new device at its next pass.
        device = wait_until(
            lambda: (d := gpu_status(dra, "MIG-e2e-mem-1"))["memory_enforcement_cause"] and d,
            timeout_s=20,
            what="the MIG device's memory enforcement",
        )
        assert (device["memory_enforcement"], device["memory_enforcement_cause"]) == ("poll", "mig")
        assert gpu_status(dra, GPU.uuid)["memory_enforcement"] == "driver-dmem"
        assert node.container_cgroup("on-mig", "main") not in limits_on(node, GPU.uuid)
    finally:
        if templated:
            node.delete_pod("on-mig")
            node.api.delete(f"{RESOURCE_API}/namespaces/{NS}/resourceclaimtemplates/mig8")
        dra.write_config(CONFIG)
        node.write_gpus(GPUS)
    wait_until(
        lambda: len(dra.status()["gpus"]) == 1, timeout_s=30, what="the node back to one GPU"
    )


def test_a_hook_that_cannot_reach_the_daemon_keeps_the_container_from_starting(
    node: Cluster, dra: Daemon
) -> None:
    node.create_pod(claim_seeing_pod(node, "stranded", template_name="m8"))
    node.wait_running("stranded")
    dra.stop()
    try:
        hook_failures_after_restart(node, "stranded")
    finally:
        restarted = start_dra(node, node.paths.root / "hook" / "vgpu-hook")
        # The module's daemon from now on.
        dra.proc, dra.log_path = restarted.proc, restarted.log_path


def test_limits_a_daemon_killed_outright_left_are_cleared_at_its_next_start(
    node: Cluster, dra: Daemon
) -> None:
    node.create_pod(claim_seeing_pod(node, "orphan", template_name="m8"))
    node.wait_running("orphan")
    cgroup = node.container_cgroup("orphan", "main")
    assert cgroup in limits_on(node, GPU.uuid)
    dra.signal(signal.SIGKILL)
    dra.proc.wait(5)
    node.delete_pod("orphan", wait=False)
    # The container and its leaf go while no daemon watches (the claim stays prepared until a
    # daemon unprepares it).
    wait_until(
        lambda: not os.path.exists(f"/sys/fs/cgroup/unified{cgroup}"),
        timeout_s=30,
        what="leaf gone",
    )
    ancestors = {c: v for c, v in under_node(node, limits_on(node, GPU.uuid)).items()
                 if cgroup.startswith(c + "/")}  # fmt: skip
    assert ancestors
    assert all(v["soft_bytes"] == 8 * GiB for v in ancestors.values()), ancestors
    restarted = start_dra(node, node.paths.root / "hook" / "vgpu-hook")
    # The module's daemon from now on.
    dra.proc, dra.log_path = restarted.proc, restarted.log_path
    wait_nothing_left(node, GPU.uuid)


def test_a_burstable_claim_above_its_request_is_reclaimed_and_a_guaranteed_one_untouched(
    node: Cluster, dra: Daemon
) -> None:
    """`burst` consumed 8Gi with a 20Gi limit and uses 16Gi; `steady` consumed 10Gi (its limit)
    and uses 9Gi: with 30Gi of the 40Gi used, less than the 12Gi the config wants free, `burst`
    loses its process and `steady` keeps its own."""
    node.create_pod(claim_seeing_pod(node, "burst", template_name="m8-burst"))
    node.create_pod(claim_seeing_pod(node, "steady", template_name="m10"))
    for pod in ("burst", "steady"):
        node.wait_running(pod)
        enforced(dra, pod)
    pids = {pod: node.container_init_pid(pod, "main") for pod in ("burst", "steady")}
    gpu = dataclasses.replace(
        GPU,
        processes=(
            FakeProcess(pid=pids["burst"], used_memory_bytes=16 * GiB),
            FakeProcess(pid=pids["steady"], used_memory_bytes=9 * GiB),
            # Another tenant's memory outside the pods: the GPU has 10Gi free, under 12Gi.
            FakeProcess(pid=os.getpid(), used_memory_bytes=5 * GiB),
        ),
    )
    node.write_gpus(FakeState(gpus=(gpu,)))
    started = time.monotonic()
    wait_until(lambda: not Path(f"/proc/{pids['burst']}").exists(), timeout_s=20, what="reclaim")
    print(f"\nreclaimed {time.monotonic() - started:.2f}s after the pressure")
    node.write_gpus(GPUS)
    assert Path(f"/proc/{pids['steady']}").exists()
    (steady,) = node.pod("steady")["status"]["containerStatuses"]
    assert steady["restartCount"] == 0
    actions = [(e["pod"], e["action"]) for e in dra.status()["enforcement"]]
    assert ("burst", "reclaim") in actions
    assert not any(p == "steady" for p, _ in actions)
