"""The chart's RBAC and DRA admission policy against a real kube-apiserver (the Kubernetes v1.36.2
bundle that VGPU_E2E_K8S_BUNDLE names, as for tests/e2e: the tarball, its directory, or a
directory with kube-multi and tinyetcd), with etcd, in network and PID namespaces of their own
with only loopback, started once for the module (tests/deploy/apiserver/rbac_check.sh):

- per-node configs: the daemon's ServiceAccount may `get` nodes and nothing more, and with its
  own token the daemon's per-node config reader chooses, switches and refuses as the label says;
- the chart under several release names side by side (`helm install` for real): each release's
  service account may do exactly what its daemon needs, and the DRA admission policy holds that
  service account, and no other, to its own node's ResourceSlices.

Needs root (unshare), openssl, the bundle, and helm and kubectl (tools/fetch_k8s_tools.py);
skips, saying which is missing, otherwise. About a minute."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.deploy.support import ROOT
from tools import fetch_k8s_tools

BUNDLE_ENV = "VGPU_E2E_K8S_BUNDLE"
SCRIPT = ROOT / "tests" / "deploy" / "apiserver" / "rbac_check.sh"
BINARIES = ("kube-multi", "tinyetcd")


def bundle_bin() -> Path:
    """The bundle's binaries: a directory that has them, or the tarball (named, or the one
    `*bundle*.tgz` in the directory named), unpacked once into the cache after its sha256 is
    checked against the `.sha256` beside it."""
    spec = os.environ.get(BUNDLE_ENV, "")
    if not spec:
        pytest.skip(f"no Kubernetes bundle: set {BUNDLE_ENV} (.ci/run does where there is one)")
    path = Path(spec)
    if path.is_dir() and all((path / name).is_file() for name in BINARIES):
        return path
    tarballs = sorted(path.glob("*bundle*.tgz")) if path.is_dir() else [path]
    assert len(tarballs) == 1, f"{BUNDLE_ENV}={spec}: not one *bundle*.tgz there"
    (tarball,) = tarballs
    assert tarball.is_file(), f"{BUNDLE_ENV}={spec}: no bundle there"
    expected = Path(f"{tarball}.sha256").read_text().split()[0]
    cache = Path.home() / ".cache" / "vgpu" / f"k8s-bundle-{expected[:16]}"
    if not all((cache / name).is_file() for name in BINARIES):
        actual = hashlib.sha256(tarball.read_bytes()).hexdigest()
        assert actual == expected, f"{tarball} has sha256 {actual}, not {expected}"
        staging = cache.with_name(cache.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(staging, filter="data")
        shutil.rmtree(cache, ignore_errors=True)
        staging.rename(cache)
    return cache


def tools_path() -> str:
    helm, kubectl = fetch_k8s_tools.cached("helm"), fetch_k8s_tools.cached("kubectl")
    if helm is None or kubectl is None:
        pytest.skip("helm and kubectl are not fetched: python tools/fetch_k8s_tools.py")
    return f"{helm.parent}:{os.environ.get('PATH', '')}"


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The `result ...` lines of one run of rbac_check.sh."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a network namespace of its own")
    if shutil.which("openssl") is None or shutil.which("ip") is None:
        pytest.skip("needs openssl and ip (iproute2)")
    binaries = bundle_bin()
    work = tmp_path_factory.mktemp("apiserver")
    result = subprocess.run(
        ["unshare", "--net", "--pid", "--fork", "--kill-child",
         "bash", str(SCRIPT), str(work), str(binaries)],
        capture_output=True, text=True, timeout=420, check=False,
        env={**os.environ, "PATH": tools_path()},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [
        line.removeprefix("result ")
        for line in result.stdout.splitlines()
        if line.startswith("result ")
    ]


@pytest.mark.timeout(480)
def test_the_service_account_gets_its_node_and_nothing_more(findings: list[str]) -> None:
    found = [line for line in findings if not line.startswith("release ")]
    assert found == [
        "can-i get nodes yes",
        "can-i list nodes no",
        "can-i watch nodes no",
        "can-i patch nodes no",
        "can-i get pods no",
        "initial a100-eight",
        "switch default",
        "refuse the node's label nvidia.com/device-plugin.config=nope",
        "switch a100-eight",
    ], findings


DRA_NEEDS = [
    *(f"can-i {verb} resourceslices.resource.k8s.io yes"
      for verb in ("create", "update", "delete", "get", "list", "watch")),
    "can-i get resourceclaims.resource.k8s.io yes",
    "can-i get nodes yes",
]  # fmt: skip
DRA_MUST_NOT = [
    "can-i list resourceclaims.resource.k8s.io no",
    "can-i deletecollection resourceslices.resource.k8s.io no",
    "can-i create deviceclasses.resource.k8s.io no",
    "can-i patch nodes no",
    "can-i list pods no",
    "can-i get secrets no",
]
OWN_NODE_ONLY = [
    "slice token-node=gpu-1 slice-node=gpu-1 created",
    "slice token-node=gpu-1 slice-node=gpu-2 denied: may not write",
    "slice token-node=- slice-node=gpu-1 denied: names no node",
]


@pytest.mark.timeout(480)
def test_any_release_name_gets_what_its_daemon_needs_beside_another(
    findings: list[str],
) -> None:
    """`helm install vgpu ...` (not named vgpu-device-plugin), a second release beside it in the
    same namespace, and the first name again in another namespace: every service account may do
    what its daemon needs and no more, and the DRA admission policy matches it."""
    found = [line.removeprefix("release ") for line in findings if line.startswith("release ")]
    by_release: dict[str, list[str]] = {}
    for line in found:
        release, _, what = line.partition(" ")
        by_release.setdefault(release, []).append(what)
    assert by_release["vgpu/vgpu-system"] == ["installed", *DRA_NEEDS, *DRA_MUST_NOT,
                                              *OWN_NODE_ONLY], found  # fmt: skip
    refused, *rest = by_release["gpu-pool-b/vgpu-system"]
    assert refused.startswith("refused: Error: "), found
    assert (
        "the DeviceClass vgpu.dev exists already (release vgpu in namespace vgpu-system): another"
        " install of the DRA driver vgpu.dev made it; set dra.deviceClasses=false to use it"
    ) in refused, found
    assert rest == [
        "installed",
        *DRA_NEEDS,
        *DRA_MUST_NOT,
        *OWN_NODE_ONLY,
    ], found
    assert by_release["vgpu/gpu-team"] == [
        "installed",
        "can-i get nodes yes",
        "can-i list nodes no",
        "can-i create resourceslices.resource.k8s.io no",
    ], found
    # Each release has its own cluster-wide objects: none collided.
    (roles,) = [line for line in found if line.startswith("cluster roles ")]
    assert sorted(roles.removeprefix("cluster roles ").split()) == [
        "gpu-team-vgpu-vgpu-device-plugin",
        "vgpu-system-gpu-pool-b-vgpu-device-plugin",
        "vgpu-system-gpu-pool-b-vgpu-device-plugin-dra-driver",
        "vgpu-system-gpu-sharing",
        "vgpu-system-vgpu-vgpu-device-plugin-dra-driver",
    ], found
