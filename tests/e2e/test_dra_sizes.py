"""The real v1.36.2 API server takes the node's ResourceSlice for GPUs of every size NVML reports
and for a MIG layout, and refuses what the driver's own check of its rules refuses (docs/dra.md,
"Every GPU size: the range on the step grid").

NVML's total memory of real cards is not a multiple of the 256Mi step: an H100 80GB reports
81559Mi, an H200 143771Mi, an L4 23034Mi, an A10G 23028Mi, an L40S 46068Mi; A100 80GB MIG
devices 9728Mi (1g.10gb), 19968Mi (2g.20gb) and 40192Mi (3g.40gb). The API server refuses a
slice whose request policy's max is off the step grid, and the whole slice with it."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from deviceplugin.dra.slices import build_slice
from deviceplugin.dra.validation import slice_errors
from deviceplugin.gpu.fake import FakeGpu, FakeMigDevice, FakeState
from tests.e2e.harness import Cluster, Daemon, pod_manifest, wait_until
from tests.e2e.netns import ApiError
from tests.e2e.test_dra import _install

RUNTIME = "fakecri"
MIB = 1 << 20
DRIVER = "vgpu.dev"
RESOURCE_API = "/apis/resource.k8s.io/v1"
NS = "default"
REAL_GPUS = (
    ("NVIDIA H100 80GB HBM3", 81559),
    ("NVIDIA H200", 143771),
    ("NVIDIA L4", 23034),
    ("NVIDIA A10G", 23028),
    ("NVIDIA L40S", 46068),
)
# One A100 80GB's GPU instances: 3 + 2 + 1 + 1 of its 7 compute slices.
MIG_LAYOUT = (("3g.40gb", 40192), ("2g.20gb", 19968), ("1g.10gb", 9728), ("1g.10gb", 9728))
CONFIG = "mig: {strategy: mixed}\nenforcement: {pollInterval: 100ms, idlePollInterval: 100ms}\n"


def _gpus() -> FakeState:
    gpus = [
        FakeGpu(
            uuid=f"GPU-5{i:07d}-0000-4000-8000-000000000000",
            index=i,
            name=name,
            memory_total_bytes=mib * MIB,
            minor=i,
        )
        for i, (name, mib) in enumerate(REAL_GPUS)
    ]
    migs = tuple(
        FakeMigDevice(f"MIG-5{gi:07d}-0000-4000-8000-000000000000", gi, 0, profile, mib * MIB)
        for gi, (profile, mib) in enumerate(MIG_LAYOUT, start=1)
    )
    a100 = FakeGpu(
        uuid="GPU-50000009-0000-4000-8000-000000000000",
        index=len(REAL_GPUS),
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=81920 * MIB,
        minor=len(REAL_GPUS),
        mig_enabled=True,
        mig_block=True,
        mig_devices=migs,
    )
    return FakeState(gpus=(*gpus, a100))


@pytest.fixture(scope="module")
def dra(cluster: Cluster) -> Iterator[Daemon]:
    _install(cluster)  # the DeviceClasses, as test_dra.py installs them
    daemon = cluster.start_daemon(
        config=CONFIG,
        gpus=_gpus(),
        args=[
            "--kubelet-api", "dra",
            "--kubeconfig", str(cluster.paths.pki / "admin.kubeconfig"),
        ],
    )  # fmt: skip
    daemon.wait_http()
    wait_until(lambda: daemon.status()["health"]["registered"], timeout_s=30, what="registered")
    yield daemon
    daemon.kill()


def _our_slice(cluster: Cluster) -> dict[str, Any] | None:
    items = cluster.api.get(f"{RESOURCE_API}/resourceslices")["items"]
    ours = [s for s in items if s["spec"]["driver"] == DRIVER]
    return ours[0] if len(ours) == 1 else None


def _published(daemon: Daemon) -> float | None:
    found = re.search(r"^vgpu_dra_resourceslice_published\{[^}]*\} (\S+)$", daemon.metrics(), re.M)
    return float(found[1]) if found else None


def test_the_api_server_takes_the_slice_of_every_gpu_and_mig_size(
    cluster: Cluster, dra: Daemon
) -> None:
    expected = len(REAL_GPUS) + len(MIG_LAYOUT)

    def whole() -> dict[str, Any] | None:
        s = _our_slice(cluster)
        return s if s is not None and len(s["spec"]["devices"]) == expected else None

    published = wait_until(whole, timeout_s=30, what=f"a slice of {expected} devices")
    devices = {d["name"]: d for d in published["spec"]["devices"]}
    for i, (name, mib) in enumerate(REAL_GPUS):
        device = devices[f"gpu-{i}"]
        assert device["attributes"]["productName"] == {"string": name}
        memory = device["capacity"]["memory"]
        assert memory["value"] in (str(mib * MIB), f"{mib}Mi")
        top = _bytes(memory["requestPolicy"]["validRange"]["max"])
        assert top % (256 * MIB) == 0
        assert mib * MIB - 256 * MIB < top <= mib * MIB
    migs = [d for d in devices.values() if d["attributes"]["type"] == {"string": "mig"}]
    assert sorted(d["attributes"]["migProfile"]["string"] for d in migs) == sorted(
        p for p, _ in MIG_LAYOUT
    )
    wait_until(lambda: _published(dra) == 1.0, timeout_s=20, what="published == 1")
    assert "ResourceSlice refused" not in dra.log()
    assert "ResourceSlice not written" not in dra.log()


def test_a_claim_gets_all_an_l4_of_23034mi_offers(cluster: Cluster, dra: Daemon) -> None:
    """The range's max on the L4 (22784Mi) is what a claim for the most memory gets."""
    name = "l4-whole"
    template = {
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
                                "selectors": [
                                    {
                                        "cel": {
                                            "expression": f'device.attributes["{DRIVER}"]'
                                            '.productName == "NVIDIA L4"'
                                        }
                                    }
                                ],
                                "capacity": {"requests": {"memory": "22784Mi"}},
                            },
                        }
                    ]
                }
            }
        },
    }
    cluster.api.post(f"{RESOURCE_API}/namespaces/{NS}/resourceclaimtemplates", template)
    pod = pod_manifest(name)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": name}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    cluster.create_pod(pod)
    try:
        running = cluster.wait_running(name)
        claim_name = running["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        claim = cluster.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/{claim_name}")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-2"
        assert _bytes(result["consumedCapacity"]["memory"]) == 22784 * MIB
    finally:
        cluster.delete_pod(name)


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def _mirror_slice(max_mib: int, default_mib: int, min_mib: int = 256) -> dict[str, Any]:
    """A one-device slice for an L4 of 23034Mi, of a driver of its own (no daemon owns it)."""
    device = {
        "name": "gpu-0",
        "attributes": {"productName": {"string": "NVIDIA L4"}},
        "capacity": {
            "memory": {
                "value": str(23034 * MIB),
                "requestPolicy": {
                    "default": str(default_mib * MIB),
                    "validRange": {
                        "min": str(min_mib * MIB),
                        "max": str(max_mib * MIB),
                        "step": str(256 * MIB),
                    },
                },
            }
        },
        "allowMultipleAllocations": True,
    }
    return build_slice("mirror-node", "mirror.vgpu.dev", [copy.deepcopy(device)], 1)


@pytest.mark.parametrize(
    ("max_mib", "default_mib", "min_mib"),
    [
        (23034, 5632, 256),  # the max the driver published before: off the grid
        (22784, 5760, 256),  # a default off the grid
        (22784, 5632, 30720),  # a min beyond the device
        (22784, 5632, 256),  # every rule kept: taken
    ],
)
def test_the_api_server_refuses_exactly_what_the_drivers_check_refuses(
    cluster: Cluster, max_mib: int, default_mib: int, min_mib: int
) -> None:
    obj = _mirror_slice(max_mib, default_mib, min_mib)
    ours = {e.field for e in slice_errors(obj)}
    refused: ApiError | None = None
    try:
        cluster.api.post(f"{RESOURCE_API}/resourceslices", obj)
    except ApiError as e:
        refused = e
    if refused is None:
        cluster.api.delete(f"{RESOURCE_API}/resourceslices/{obj['metadata']['name']}")
        assert not ours, f"the API server took what the driver's check refuses: {sorted(ours)}"
        return
    assert refused.status == 422, refused
    message = json.loads(refused.body)["message"]
    print(message)
    theirs = set(re.findall(r"spec\.devices\[\d+\][^:,\s]*", message))
    assert ours, f"the API server refused what the driver's check takes: {message}"
    assert ours == theirs, message
