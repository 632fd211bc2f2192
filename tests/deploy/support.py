"""Helpers for the deployment tests: the repository's paths and the manifests, parsed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
