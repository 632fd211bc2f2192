"""The MPS kustomize component (daemonset/components/mps, rendered by daemonset/overlays/mps):
it renders and validates, turns MPS on, gives the daemon what MPS needs, and nothing more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.allocation import mps_pipe_directory, mps_shm_directory
from deviceplugin.config import (
    NFD_FEATURE_NAME,
    Config,
    MpsConfig,
    NodeLabelsConfig,
    default_config_yaml,
    load_config,
    parse_config,
)
from tests.deploy.support import DEPLOY, MPS_COMPONENT, NAMESPACE, ROOT, Manifest
from tests.deploy.test_manifests import CAPABILITIES, KUBERNETES_VERSIONS, kustomize, validate

OVERLAY = DEPLOY / "overlays" / "mps"

# The DaemonSet keeps its node-label feature file with MPS on as well.
NODE_LABELS = NodeLabelsConfig(file=NFD_FEATURE_NAME)


def rendered(path: Path) -> dict[str, Manifest]:
    return {d["kind"]: d for d in kustomize(path) if d["kind"] in ("DaemonSet", "ConfigMap")}


def pod_spec(docs: dict[str, Manifest]) -> dict[str, Any]:
    spec: dict[str, Any] = docs["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def test_the_overlay_renders_and_matches_the_kubernetes_schema() -> None:
    docs = kustomize(OVERLAY)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "Service", "ServiceAccount"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE
        for version in KUBERNETES_VERSIONS:
            validate(doc, version, "kubectl kustomize daemonset/overlays/mps")


def test_the_component_turns_mps_on_and_changes_nothing_else_in_the_config() -> None:
    docs = rendered(OVERLAY)
    config_map = docs["ConfigMap"]
    text = config_map["data"]["config.yaml"]
    config = parse_config(yaml.safe_load(text))
    assert config == Config(mps=MpsConfig(enabled=True), node_labels=NODE_LABELS)
    assert not config.warnings
    # The DaemonSet mounts the replaced ConfigMap under its stable name: the daemons reload it live.
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["metadata"]["name"] == rendered(DEPLOY)["ConfigMap"]["metadata"]["name"]


def test_the_component_config_is_the_default_with_mps_on_and_current() -> None:
    path = MPS_COMPONENT / "config.yaml"
    lines = path.read_text().splitlines()
    defaults = default_config_yaml(node_labels_file=NFD_FEATURE_NAME).splitlines()
    changed = [i for i, (a, b) in enumerate(zip(lines, defaults, strict=True)) if a != b]
    assert [(defaults[i], lines[i]) for i in changed] == [("  enabled: false", "  enabled: true")]
    assert lines[: changed[0]][::-1].index("mps:") < 5  # the one under mps:
    assert load_config(path) == Config(mps=MpsConfig(enabled=True), node_labels=NODE_LABELS)
    check = subprocess.run(
        [sys.executable, "tools/gen_daemonset_config.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr


def test_the_daemon_gets_the_mps_root_and_shares_its_dev_shm_with_clients() -> None:
    spec = pod_spec(rendered(OVERLAY))
    c = spec["containers"][0]
    root = MpsConfig().root
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    root_volume = volumes[mounts[root]["name"]]
    assert root_volume["hostPath"] == {"path": root, "type": "DirectoryOrCreate"}
    assert not mounts[root].get("readOnly")  # the control daemon writes its pipes and logs
    # The daemon's /dev/shm is the host directory that Allocate mounts at each client's
    # /dev/shm: the MPS server (a child of the control daemon) and its clients see one place.
    shm_volume = volumes[mounts["/dev/shm"]["name"]]
    assert shm_volume["hostPath"]["path"] == mps_shm_directory(root)
    assert mps_pipe_directory(root).startswith(root_volume["hostPath"]["path"] + "/")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # MPS binaries come with compute


def test_least_privilege_is_kept() -> None:
    spec = pod_spec(rendered(OVERLAY))
    sc = spec["containers"][0]["securityContext"]
    assert not spec.get("hostIPC")  # shared memory goes through the shm directory instead
    assert not spec.get("hostNetwork")
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Only what starting MPS servers as their clients' users takes.
    assert set(sc["capabilities"]["add"]) == CAPABILITIES | {"SETUID", "SETGID"}


def test_without_the_component_nothing_of_mps_is_there() -> None:
    spec = pod_spec(rendered(DEPLOY))
    c = spec["containers"][0]
    assert "/dev/shm" not in {m["mountPath"] for m in c["volumeMounts"]}
    assert MpsConfig().root not in {m["mountPath"] for m in c["volumeMounts"]}
    assert set(c["securityContext"]["capabilities"]["add"]) == CAPABILITIES
    assert {e["name"]: e.get("value") for e in c["env"]}["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_the_component_says_why_it_adds_each_capability() -> None:
    text = (MPS_COMPONENT / "kustomization.yaml").read_text()
    assert (
        "SETUID and SETGID: the control daemon starts each MPS server as its client's user" in text
    )
