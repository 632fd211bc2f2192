"""DRA mode as deployed: kubectl kustomize daemonset/overlays/dra and the chart with
values-dra.yaml give the daemon what the driver needs and nothing more."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RBAC = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["create", "update", "delete", "get", "list", "watch"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]


def _tool(name: str) -> str:
    found = shutil.which(name)
    cached = Path.home() / ".cache/vgpu/k8s-tools/2.2.2/bin" / name
    if found is None and cached.exists():
        found = str(cached)
    if found is None:
        pytest.skip(f"{name} is not installed (python tools/fetch_k8s_tools.py)")
    return found


def _docs(args: list[str]) -> list[dict[str, Any]]:
    result = subprocess.run(args, capture_output=True, text=True, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _rendered() -> dict[str, list[dict[str, Any]]]:
    return {
        "kustomize": _docs([_tool("kubectl"), "kustomize", "daemonset/overlays/dra"]),
        "helm": _docs(
            [
                _tool("helm"),
                "template",
                "vgpu",
                "daemonset/chart",
                "-n",
                "vgpu-system",
                "-f",
                "daemonset/chart/values-dra.yaml",
            ]
        ),
    }


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return _rendered()


@pytest.mark.parametrize("how", ["kustomize", "helm"])
def test_dra_deployment(rendered: dict[str, list[dict[str, Any]]], how: str) -> None:
    docs = rendered[how]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    classes = {c["metadata"]["name"]: c["spec"] for c in by_kind["DeviceClass"]}
    assert classes["vgpu.dev"]["selectors"] == [
        {"cel": {"expression": 'device.driver == "vgpu.dev"'}}
    ]
    assert classes["vgpu.dev-extended"]["extendedResourceName"] == "nvidia.com/vgpu"
    (role,) = by_kind["ClusterRole"]
    assert role["rules"] == RBAC
    assert "Role" not in by_kind
    (ds,) = by_kind["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    # The binding and the policy name the DaemonSet's own service account, whatever the
    # release is called (the chart is rendered as release "vgpu").
    (binding,) = by_kind["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (policy,) = by_kind["ValidatingAdmissionPolicy"]
    assert "authentication.kubernetes.io/node-name" in str(policy["spec"]["variables"])
    (condition,) = policy["spec"]["matchConditions"]
    namespace = binding["subjects"][0]["namespace"]
    user = f"system:serviceaccount:{namespace}:{pod['serviceAccountName']}"
    assert f'"{user}"' in condition["expression"]
    assert pod["automountServiceAccountToken"] is True
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VGPU_KUBELET_API"] == "dra"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins/vgpu.dev",
        "/var/run/cdi",
    } <= mounts
    assert "/var/lib/kubelet/device-plugins" not in mounts
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert "/var/lib/kubelet/device-plugins" not in paths
