"""The chart's per-node config RBAC against a real kube-apiserver (the Kubernetes v1.36.2 bundle
that VGPU_E2E_K8S_BUNDLE names, as for tests/e2e: the tarball, its directory, or a directory with
kube-multi and tinyetcd), with etcd, in network and PID namespaces of their own with only
loopback: the daemon's ServiceAccount may `get` nodes and nothing more, and with its own token
the daemon's per-node config reader chooses, switches and refuses as the label says.

Needs root (unshare), openssl, the bundle, and helm and kubectl (tools/fetch_k8s_tools.py);
skips, saying which is missing, otherwise. About 20 s."""

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


@pytest.mark.timeout(300)
def test_the_service_account_gets_its_node_and_nothing_more(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a network namespace of its own")
    if shutil.which("openssl") is None or shutil.which("ip") is None:
        pytest.skip("needs openssl and ip (iproute2)")
    binaries = bundle_bin()
    result = subprocess.run(
        [
            "unshare",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "bash",
            str(SCRIPT),
            str(tmp_path),
            str(binaries),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PATH": tools_path()},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = [
        line.removeprefix("result ")
        for line in result.stdout.splitlines()
        if line.startswith("result ")
    ]
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
    ], result.stdout + result.stderr
