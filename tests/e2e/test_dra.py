"""vgpu as a DRA driver on a real kubelet v1.36.2, with the real scheduler (docs/dra.md).

The runtime is containerd 2.x with CDI where the node can run real containers (else the fake
CRI). What a container gets is read from the CDI devices the kubelet handed the runtime (in
containerd's log, or the fake runtime's CreateContainer line) and the CDI spec files those
devices name, never from vgpu's own answers (tests/e2e/test_dra_enforce.py reads them in the
containers' environment). What the scheduler granted is read from the claims' status."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.gpu.fake import FakeMigDevice, FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import RESOURCE, Cluster, ClusterError, Daemon, pod_manifest, wait_until
from tests.e2e.netns import ApiError

GiB = 1024**3
GPU = gpu(0, name="NVIDIA A100-PCIE-40GB", memory_gib=40)  # 10Gi and 25% a default share
GPUS = FakeState(gpus=(GPU,))
CONFIG = "slicing: {replicas: 4}\nenforcement: {pollInterval: 100ms, idlePollInterval: 100ms}\n"
DRIVER = "vgpu.dev"
RESOURCE_API = "/apis/resource.k8s.io/v1"
NS = "default"
# (name, memory, compute) of the claim templates the tests use.
TEMPLATES = [
    ("m15-c30", "15Gi", "30"),
    ("m25", "25Gi", None),
    ("m10-c10", "10Gi", "10"),
    ("m5-c5", "5Gi", "5"),
]


def _post(cluster: Cluster, path: str, body: dict[str, Any]) -> None:
    try:
        cluster.api.post(path, body)
    except ApiError as exc:
        if exc.status != 409:
            raise


def _install(cluster: Cluster) -> None:
    """The DeviceClasses of daemonset/components/dra and the tests' claim templates."""
    selectors = [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]
    for name, extra in ((DRIVER, {}), (f"{DRIVER}-extended", {"extendedResourceName": RESOURCE})):
        _post(
            cluster,
            f"{RESOURCE_API}/deviceclasses",
            {
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": selectors, **extra},
            },
        )
    for name, memory, compute in TEMPLATES:
        requests = {"memory": memory, **({"compute": compute} if compute else {})}
        _post(
            cluster,
            f"{RESOURCE_API}/namespaces/{NS}/resourceclaimtemplates",
            {
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {
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
                    }
                },
            },
        )


def claim_pod(name: str, template: str) -> dict[str, Any]:
    pod = pod_manifest(name)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def start_dra(
    cluster: Cluster,
    config: str = CONFIG,
    *,
    gpus: FakeState = GPUS,
    args: Sequence[str] = (),
) -> Daemon:
    """Our daemon as a DRA driver on the node (fake GPUs; `args`: more of serve's flags),
    registered with the kubelet."""
    daemon = cluster.start_daemon(
        config=config,
        gpus=gpus,
        args=[
            "--kubelet-api", "dra",
            "--kubeconfig", str(cluster.paths.pki / "admin.kubeconfig"),
            *args,
        ],
    )  # fmt: skip
    daemon.wait_http()
    wait_until(lambda: daemon.status()["health"]["registered"], timeout_s=30, what="registered")
    return daemon


@pytest.fixture(scope="module")
def dra(cluster: Cluster) -> Iterator[Daemon]:
    _install(cluster)
    daemon = start_dra(cluster)
    yield daemon
    daemon.kill()


@pytest.fixture
def node(dra: Daemon) -> Iterator[Cluster]:
    cluster = dra.cluster
    yield cluster
    for pod in cluster.pods():
        cluster.delete_pod(pod["metadata"]["name"])
    wait_until(lambda: not spec_files(cluster), timeout_s=30, what="every claim unprepared")


def clean_claims(cluster: Cluster, gpus: FakeState) -> None:
    """After a test: the fake GPUs as `gpus`, every pod and claim deleted, every claim
    unprepared."""
    cluster.write_gpus(gpus)
    for pod in cluster.pods():
        cluster.delete_pod(pod["metadata"]["name"])
    claims = f"{RESOURCE_API}/namespaces/{NS}/resourceclaims"
    for claim in cluster.api.get(claims)["items"]:
        try:
            cluster.api.delete(f"{claims}/{claim['metadata']['name']}")
        except ApiError as exc:
            if exc.status != 404:  # a template's claim, gone with its pod
                raise
    wait_until(lambda: not spec_files(cluster), timeout_s=30, what="every claim unprepared")


def the_slice(cluster: Cluster) -> dict[str, Any]:
    items = cluster.api.get(f"{RESOURCE_API}/resourceslices")["items"]
    ours: list[dict[str, Any]] = [s for s in items if s["spec"]["driver"] == DRIVER]
    assert len(ours) == 1, ours
    return ours[0]


def spec_files(cluster: Cluster) -> list[str]:
    return sorted(p.name for p in cluster.paths.cdi_dir.glob(f"{DRIVER}-claim_*.json"))


def claim_of(cluster: Cluster, pod: str) -> dict[str, Any]:
    """The claim the pod's `gpu` claim (or its extended resource) got from the scheduler."""
    status = cluster.pod(pod)["status"]
    names = [s["resourceClaimName"] for s in status.get("resourceClaimStatuses", [])]
    if not names:
        names = [status["extendedResourceClaimStatus"]["resourceClaimName"]]
    claim: dict[str, Any] = cluster.api.get(
        f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/{names[0]}"
    )
    return claim


def cdi_of(cluster: Cluster, pod: str) -> tuple[str, ...]:
    """The CDI devices the kubelet gave the pod's container `main`, as the runtime saw them."""
    found = cluster.container_cdi_devices(pod, "main")
    assert found, f"no CDI devices for {pod}"
    return found


def spec_env(cluster: Cluster, cdi_device: str) -> dict[str, str]:
    """The env of vgpu's CDI device `vgpu.dev/claim=<uid>`, from its spec file."""
    kind, _, name = cdi_device.partition("=")
    assert kind == f"{DRIVER}/claim", cdi_device
    spec = json.loads((cluster.paths.cdi_dir / f"{DRIVER}-claim_{name}.json").read_text())
    assert spec["kind"] == kind
    (device,) = [d for d in spec["devices"] if d["name"] == name]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def test_slice_appears_with_both_capacities(node: Cluster) -> None:
    s = the_slice(node)
    assert s["spec"]["nodeName"] == node.node()["metadata"]["name"]
    (device,) = s["spec"]["devices"]
    assert device["name"] == "gpu-0"
    assert device["allowMultipleAllocations"] is True
    assert device["attributes"]["uuid"] == {"string": GPU.uuid}
    assert device["capacity"]["memory"]["value"] == str(40 * GiB)
    assert device["capacity"]["compute"]["value"] == "100"


def test_two_claims_fill_the_gpu_a_third_waits_until_one_is_deleted(node: Cluster) -> None:
    node.create_pod(claim_pod("p15", "m15-c30"))
    node.create_pod(claim_pod("p25", "m25"))
    for pod in ("p15", "p25"):
        node.wait_running(pod)
    granted = {}
    for pod in ("p15", "p25"):
        (result,) = claim_of(node, pod)["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == (DRIVER, "gpu-0")
        granted[pod] = result["consumedCapacity"]
        cdi = cdi_of(node, pod)
        assert cdi[1:] == (f"nvidia.com/gpu={GPU.uuid}",)
        env = spec_env(node, cdi[0])
        assert env["NVIDIA_VISIBLE_DEVICES"] == GPU.uuid
        assert len(env["VGPU_ALLOCATION_ID"]) == 16
    # 25Gi named no compute: it consumed the default, one slice's share.
    assert granted == {
        "p15": {"memory": "15Gi", "compute": "30"},
        "p25": {"memory": "25Gi", "compute": "25"},
    }
    env15 = spec_env(node, cdi_of(node, "p15")[0])
    assert (env15["VGPU_MEMORY_LIMIT_MIB_0"], env15["VGPU_COMPUTE_SHARE_PERCENT_0"]) == (
        "15360",
        "30",
    )
    env25 = spec_env(node, cdi_of(node, "p25")[0])
    assert (env25["VGPU_MEMORY_LIMIT_MIB_0"], env25["VGPU_COMPUTE_SHARE_PERCENT_0"]) == (
        "25600",
        "25",
    )

    node.create_pod(claim_pod("p10", "m10-c10"))
    node.assert_stays_pending("p10", seconds=4)
    assert len(spec_files(node)) == 2
    uid15 = cdi_of(node, "p15")[0].partition("=")[2]
    node.delete_pod("p15")
    node.wait_running("p10")
    # Deleting the pod unprepared its claim: its spec file is gone, p10's is there.
    wait_until(lambda: f"{DRIVER}-claim_{uid15}.json" not in spec_files(node), timeout_s=20,
               what="p15's claim unprepared")  # fmt: skip
    assert len(spec_files(node)) == 2


def test_the_claim_shows_in_status_and_metrics_with_its_pod(node: Cluster, dra: Daemon) -> None:
    node.create_pod(claim_pod("seen", "m5-c5"))
    node.wait_running("seen")
    allocation = spec_env(node, cdi_of(node, "seen")[0])["VGPU_ALLOCATION_ID"]

    def listed() -> dict[str, Any] | None:
        return next(
            (a for a in dra.status()["allocations"] if a["allocation_id"] == allocation), None
        )

    record = wait_until(listed, timeout_s=20, what="the claim in /status")
    assert (record["namespace"], record["pod"]) == (NS, "seen")
    assert record["source"] == "dra"
    assert dra.status()["health"]["pod_resources_ok"] is True
    assert record["claim"] == f"{NS}/{claim_of(node, 'seen')['metadata']['name']}"
    # The container comes from the kubelet's pod-resources DRA entries.
    wait_until(lambda: (listed() or {}).get("container") == "main", timeout_s=20,
               what="the claim's container named")  # fmt: skip


def test_sigkill_between_prepare_and_unprepare_loses_nothing(node: Cluster, dra: Daemon) -> None:
    node.create_pod(claim_pod("survivor", "m5-c5"))
    node.wait_running("survivor")
    (spec,) = spec_files(node)
    dra.kill()
    node.delete_pod("survivor")
    # The kubelet cannot unprepare while the driver is away: the spec stays.
    time.sleep(2)
    assert spec_files(node) == [spec]
    again = start_dra(node)
    try:
        wait_until(lambda: not spec_files(node), timeout_s=60, what="unprepared after restart")
        state = json.loads((node.paths.root / "vgpu-state" / "dra-claims.json").read_text())
        assert state["claims"] == []
    finally:
        # The module's daemon is the new one from here on.
        dra.proc, dra.log_path = again.proc, again.log_path


def test_extended_resource_pod_gets_one_default_share(node: Cluster) -> None:
    node.create_pod(pod_manifest("ext1", {RESOURCE: 1}))
    node.wait_running("ext1")
    (result,) = claim_of(node, "ext1")["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0"
    assert result["consumedCapacity"] == {"memory": str(10 * GiB), "compute": "25"}
    env = spec_env(node, cdi_of(node, "ext1")[0])
    assert env["VGPU_MEMORY_LIMIT_MIB_0"] == "10240"
    # Two of the extended resource are two devices: one GPU cannot serve it, though it has
    # room for two default shares.
    node.create_pod(pod_manifest("ext2", {RESOURCE: 2}))
    pod = node.assert_stays_pending("ext2", seconds=4)
    scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "cannot allocate all claims" in scheduled[0]["message"]


def test_unhealthy_gpu_is_tainted_and_the_next_pod_waits(node: Cluster, dra: Daemon) -> None:
    node.write_gpus(FakeState(gpus=(dataclasses.replace(GPU, healthy=False),)))
    try:
        wait_until(lambda: the_slice(node)["spec"]["devices"][0].get("taints"), timeout_s=20,
                   what="the device tainted")  # fmt: skip
        (taint,) = the_slice(node)["spec"]["devices"][0]["taints"]
        assert (taint["key"], taint["effect"]) == (f"{DRIVER}/unhealthy", "NoSchedule")
        node.create_pod(claim_pod("after-taint", "m5-c5"))
        node.assert_stays_pending("after-taint", seconds=4)
    finally:
        node.write_gpus(GPUS)
    wait_until(lambda: not the_slice(node)["spec"]["devices"][0].get("taints"), timeout_s=20,
               what="the taint removed")  # fmt: skip
    node.wait_running("after-taint")


MIG_GPU = dataclasses.replace(
    gpu(1, name="NVIDIA A100-SXM4-80GB", memory_gib=80),
    mig_enabled=True,
    mig_devices=(FakeMigDevice("MIG-e2e-1", 1, 0, "3g.40gb", 40 * GiB),),
    mig_block=True,
)


def test_mig_devices_are_devices_of_the_slice(node: Cluster, dra: Daemon) -> None:
    dra.write_config(CONFIG + "mig: {strategy: single}\n")
    node.write_gpus(FakeState(gpus=(GPU, MIG_GPU)))
    try:

        def devices() -> dict[str, Any]:
            return {d["name"]: d for d in the_slice(node)["spec"]["devices"]}

        wait_until(lambda: "gpu-1-mig-1-0" in devices(), timeout_s=30, what="the MIG device")
        mig = devices()["gpu-1-mig-1-0"]
        assert mig["attributes"]["type"] == {"string": "mig"}
        assert mig["attributes"]["migProfile"] == {"string": "3g.40gb"}
        assert mig["attributes"]["parentUUID"] == {"string": MIG_GPU.uuid}
        assert mig["capacity"]["memory"]["value"] == str(40 * GiB)
        assert "gpu-1" not in devices()  # a GPU in MIG mode is its MIG devices
    finally:
        dra.write_config(CONFIG)
        node.write_gpus(GPUS)
    wait_until(lambda: len(the_slice(node)["spec"]["devices"]) == 1, timeout_s=30,
               what="the slice back to one GPU")  # fmt: skip


def test_a_kubelet_restart_keeps_claims_and_prepares_new_ones(node: Cluster, dra: Daemon) -> None:
    node.create_pod(claim_pod("before", "m5-c5"))
    node.wait_running("before")
    node.restart_kubelet()
    node.wait_node_ready()
    wait_until(lambda: dra.status()["health"]["registered"], timeout_s=30, what="registered")
    node.create_pod(claim_pod("after", "m5-c5"))
    node.wait_running("after")
    node.wait_running("before")
    assert len(spec_files(node)) == 2


COMPONENT = Path(__file__).resolve().parents[2] / "daemonset" / "components" / "dra"
DAEMON_SA = "system:serviceaccount:vgpu-system:vgpu-device-plugin"
PLURALS = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
    ),
}


def test_the_admission_policy_holds_the_daemon_to_its_own_nodes_slices(node: Cluster) -> None:
    """daemonset/components/dra's RBAC and ValidatingAdmissionPolicy on the real API server:
    the daemon's service account, on node N (the node name its token carries), may write only
    slices of node N. Its token is stood in for by impersonation with that extra."""
    docs = [
        d
        for f in ("rbac.yaml", "admission-policy.yaml")
        for d in yaml.safe_load_all((COMPONENT / f).read_text())
        if d
    ]
    for doc in docs:
        _post(node, PLURALS[doc["kind"]], doc)
    me = node.node()["metadata"]["name"]
    manifest = node.paths.root / "vap-slice.json"

    def create_as(node_name: str | None, slice_node: str) -> str:
        manifest.write_text(
            json.dumps(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": {"name": f"vap-{slice_node}"},
                    "spec": {
                        "driver": "vap.example.com",
                        "nodeName": slice_node,
                        "pool": {"name": slice_node, "generation": 1, "resourceSliceCount": 1},
                        "devices": [],
                    },
                }
            )
        )
        extra = []
        if node_name is not None:
            extra = ["--as-user-extra", f"authentication.kubernetes.io/node-name={node_name}"]
        try:
            return node.kubectl("--as", DAEMON_SA, *extra, "create", "-f", str(manifest))
        except ClusterError as e:
            return str(e)

    try:
        # The policy takes effect once the API server has loaded it.
        wait_until(
            lambda: "may not write" in create_as("other-node", me),
            timeout_s=30,
            what="the admission policy in force",
        )
        # Made while the policy was not yet loaded, if at all.
        with contextlib.suppress(ApiError):
            node.api.delete(f"{RESOURCE_API}/resourceslices/vap-{me}")
        wait_until(lambda: not [x for x in node.api.get(f"{RESOURCE_API}/resourceslices")["items"]
                                if x["metadata"]["name"] == f"vap-{me}"], timeout_s=10,
                   what="the early slice gone")  # fmt: skip
        assert "may not write ResourceSlices of node " + me in create_as("other-node", me)
        assert "names no node" in create_as(None, me)
        assert "created" in create_as(me, me)
        node.kubectl("--as", DAEMON_SA, "--as-user-extra",
                     f"authentication.kubernetes.io/node-name={me}",
                     "delete", "resourceslice", f"vap-{me}")  # fmt: skip
        # RBAC: claims it may read; pods it may not.
        can = ["--as", DAEMON_SA, "auth", "can-i"]
        assert node.kubectl(*can, "get", "resourceclaims").strip() == "yes"
        with pytest.raises(ClusterError, match="exit 1"):  # can-i answers no
            node.kubectl(*can, "list", "pods")
    finally:
        for doc in reversed(docs):
            with contextlib.suppress(ApiError):
                node.api.delete(f"{PLURALS[doc['kind']]}/{doc['metadata']['name']}")


def _create_to_running(node: Cluster, make: Any, n: int = 5) -> list[float]:
    times = []
    for i in range(n):
        name = f"timed-{i}"
        started = time.monotonic()
        node.create_pod(make(name))
        node.wait_running(name)
        times.append(time.monotonic() - started)
        node.delete_pod(name)
    return times


def test_pod_create_to_running_dra_against_device_plugin(node: Cluster, dra: Daemon) -> None:
    """Measured, and printed (run with -s): pod create -> Running, median of 5, each mode."""
    dra_times = _create_to_running(node, lambda name: claim_pod(name, "m5-c5"))
    wait_until(lambda: not spec_files(node), timeout_s=30, what="unprepared")
    dra.kill()
    # One mode per node: the extended-resource class goes, the device plugin comes.
    with contextlib.suppress(ApiError):
        node.api.delete(f"{RESOURCE_API}/deviceclasses/{DRIVER}-extended")
    plugin = node.start_daemon(config=CONFIG, gpus=GPUS)
    try:
        node.wait_allocatable(RESOURCE, 4)
        plugin_times = _create_to_running(node, lambda name: pod_manifest(name, {RESOURCE: 1}))
    finally:
        plugin.kill()
    print(
        f"\npod create->Running, median of {len(dra_times)}: "
        f"DRA {statistics.median(dra_times):.2f}s {[round(t, 2) for t in dra_times]}, "
        f"device plugin {statistics.median(plugin_times):.2f}s "
        f"{[round(t, 2) for t in plugin_times]}"
    )
    assert max(dra_times) < 30
    assert max(plugin_times) < 30
