"""The DaemonSet and its kustomize files: schemas, lint, wiring to the CLI and the config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from packaging.version import Version

import deviceplugin
from deviceplugin.__main__ import build_parser
from deviceplugin.config import (
    NFD_FEATURE_FILE,
    NFD_FEATURE_NAME,
    Config,
    NodeLabelsConfig,
    default_config_yaml,
    load_config,
)
from tests.deploy.support import (
    BASE,
    DEPLOY,
    EXAMPLES,
    KUSTOMIZATION,
    NAMESPACE,
    ROOT,
    Manifest,
    container,
    daemonset,
    kustomization_dirs,
    load_documents,
    manifest_files,
    one,
)

# The oldest Kubernetes the plugin supports (pod-resources GetAllocatableResources is GA in 1.28)
# and the newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
# Resources of the Prometheus Operator: CRDs without a schema here, checked in test_monitoring.
CRD_GROUPS = ("monitoring.coreos.com/",)
# Kinds newer than the oldest supported Kubernetes, checked from the release that has them: the
# DRA component (docs/dra.md) needs resource.k8s.io/v1.
NEWER_KINDS = {
    "DeviceClass": "1.34.0",
    "ValidatingAdmissionPolicy": "1.30.0",
    "ValidatingAdmissionPolicyBinding": "1.30.0",
}
IMAGE = "ghcr.io/vgpu/vgpu-device-plugin"
CAPABILITIES = {"KILL", "SYS_PTRACE", "DAC_READ_SEARCH"}


def is_crd(doc: Manifest) -> bool:
    return str(doc.get("apiVersion", "")).startswith(CRD_GROUPS)


def validate(doc: Manifest, version: str, where: str) -> None:
    problem = ""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        problem = f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    if problem:
        pytest.fail(f"{where}: {doc['kind']} {doc['metadata'].get('name')}: {problem}")


def kustomize(path: Path) -> list[Manifest]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def env_of(c: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


# --- schemas and lint ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_matches_the_kubernetes_schema(path: Path, version: str) -> None:
    docs = load_documents(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        since = NEWER_KINDS.get(str(doc.get("kind")), "0")
        if not is_crd(doc) and Version(version) >= Version(since):
            validate(doc, version, str(path.relative_to(ROOT)))


@pytest.mark.parametrize("overlay", ["", "overlays/prometheus-operator"])
def test_kustomize_output_matches_the_kubernetes_schema(overlay: str) -> None:
    docs = kustomize(DEPLOY / overlay)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ConfigMap", "DaemonSet", "Namespace", "Service", "ServiceAccount"]
    if overlay:
        expected += ["ConfigMap", "NetworkPolicy", "PrometheusRule", "ServiceMonitor"]
    assert kinds == sorted(expected)
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        if not is_crd(doc):
            validate(doc, KUBERNETES_VERSIONS[-1], f"kubectl kustomize daemonset/{overlay}")


def test_kustomize_wires_the_generated_config_map_and_the_image() -> None:
    docs = {(d["kind"], d["metadata"]["name"].split("-")[0]): d for d in kustomize(DEPLOY)}
    config_map = next(d for (kind, _), d in docs.items() if kind == "ConfigMap")
    # A stable name: a new config is reloaded live by the running daemons, no pod restarts.
    assert config_map["metadata"]["name"] == "vgpu-config"
    assert config_map["data"] == {
        "config.yaml": default_config_yaml(node_labels_file=NFD_FEATURE_NAME)
    }
    spec = docs[("DaemonSet", "vgpu")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert spec["containers"][0]["image"] == f"{IMAGE}:{deviceplugin.__version__}"


def test_yamllint_passes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "-f", "parsable", "-s", "daemonset", ".yamllint"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- kustomize files ----------------------------------------------------------------------------


def referenced_paths(directory: Path) -> set[Path]:
    """Every file or directory a kustomization names: resources, components, generator files."""
    k = one(directory / KUSTOMIZATION)
    names: list[str] = [*k.get("resources", []), *k.get("components", [])]
    for generator in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        names += [entry.partition("=")[2] or entry for entry in generator.get("files", [])]
    return {(directory / name).resolve() for name in names}


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_names_every_file_of_its_dir_and_only_files_that_exist(
    directory: Path,
) -> None:
    referenced = referenced_paths(directory)
    for path in referenced:
        assert path.exists(), f"{directory / KUSTOMIZATION} names {path}, which does not exist"
    for path in directory.iterdir():
        if path.suffix in {".yaml", ".yml", ".json"} and path.name != KUSTOMIZATION:
            assert path.resolve() in referenced, f"{directory / KUSTOMIZATION} omits {path}"


def test_every_manifest_dir_but_the_examples_has_a_kustomization() -> None:
    dirs = {p.parent for p in manifest_files()} - {EXAMPLES}
    assert dirs <= set(kustomization_dirs())


def test_the_image_tag_is_the_package_version() -> None:
    (image,) = one(BASE / KUSTOMIZATION)["images"]
    assert image["name"] == IMAGE
    assert str(image["newTag"]) == deviceplugin.__version__
    assert container()["image"] == f"{IMAGE}:{deviceplugin.__version__}"


# --- the config ---------------------------------------------------------------------------------


def test_the_config_file_is_the_built_in_default_with_node_labels() -> None:
    path = BASE / "config.yaml"
    assert path.read_text() == default_config_yaml(node_labels_file=NFD_FEATURE_NAME), (
        "daemonset/base/config.yaml is stale: run python tools/gen_daemonset_config.py"
    )
    config = load_config(path)  # what check-config validates
    assert config == Config(node_labels=NodeLabelsConfig(file=NFD_FEATURE_NAME))
    assert not config.warnings


def test_the_node_feature_file_is_on_a_host_directory_that_nfd_reads() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    feature_dir = str(Path(NFD_FEATURE_FILE).parent)
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = next(m for m in mounts.values() if m["mountPath"] == feature_dir)
    assert not mount.get("readOnly")
    assert volumes[mount["name"]]["hostPath"] == {"path": feature_dir, "type": "DirectoryOrCreate"}
    # ... and the daemon is told where it is.
    assert env_of(container())["VGPU_NODE_FEATURES_DIR"] == feature_dir
    assert env_of(container())["VGPU_NODE_FEATURES_FILE"] == Path(NFD_FEATURE_FILE).name


# --- the DaemonSet and the CLI ------------------------------------------------------------------


def test_the_container_command_is_accepted_by_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    c = container()
    assert "command" not in c, "the image's ENTRYPOINT (vgpu-device-plugin) runs"
    env = env_of(c)
    settings = {
        "VGPU_CONFIG": "config",
        "VGPU_BACKEND": "backend",
        "VGPU_DEVICE_PLUGIN_DIR": "device_plugin_dir",
        "VGPU_POD_RESOURCES_SOCKET": "pod_resources_socket",
        "VGPU_METRICS_ADDRESS": "metrics_address",
        "VGPU_PROBE_ADDRESS": "probe_address",
        "VGPU_STATE_DIR": "state_dir",
        "VGPU_NODE_FEATURES_DIR": "node_features_dir",
        "VGPU_NODE_FEATURES_FILE": "node_features_file",
        "VGPU_CDI_DIR": "cdi_dir",
        "VGPU_MEMORY_LIMIT_HOOK": "memory_limit_hook",
        "VGPU_CGROUP_MOUNT": "cgroup_mount",
        "VGPU_MEMORY_LIMIT_PROBE_ROOT": "memory_limit_probe_root",
        "NODE_NAME": "node_name",
    }
    for name, value in env.items():
        if name.startswith("VGPU_"):
            assert name in settings, f"the DaemonSet sets {name}, which the CLI does not read"
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")  # what the downward API gives

    args = build_parser().parse_args(c["args"])  # SystemExit(2) if a flag were unknown

    assert args.command == "serve"
    for name, attribute in settings.items():
        expected = "gpu-node-1" if name == "NODE_NAME" else env[name]
        assert getattr(args, attribute) == expected, name
    assert args.log_format in {"text", "json"}


def test_the_daemonset_restates_the_cli_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DaemonSet spells out the paths and the port; they must stay the CLI's defaults, which
    the README documents."""
    env = env_of(container())
    restated = {
        "VGPU_DEVICE_PLUGIN_DIR": "device_plugin_dir",
        "VGPU_POD_RESOURCES_SOCKET": "pod_resources_socket",
        "VGPU_METRICS_ADDRESS": "metrics_address",
        "VGPU_STATE_DIR": "state_dir",
    }
    for name in restated:
        monkeypatch.delenv(name, raising=False)
    defaults = build_parser().parse_args(["serve"])
    for name, attribute in restated.items():
        assert env[name] == getattr(defaults, attribute), name


def test_mounts_serve_the_paths_the_daemon_uses() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    c = container()
    env = env_of(c)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}

    def host_path(mount_path: str) -> dict[str, str]:
        result: dict[str, str] = volumes[mounts[mount_path]["name"]]["hostPath"]
        return result

    # Directories, not sockets: the kubelet re-creates its sockets when it restarts.
    plugin_dir = env["VGPU_DEVICE_PLUGIN_DIR"]
    assert host_path(plugin_dir) == {"path": plugin_dir, "type": "Directory"}
    pod_resources_dir = str(Path(env["VGPU_POD_RESOURCES_SOCKET"]).parent)
    assert host_path(pod_resources_dir) == {"path": pod_resources_dir, "type": "Directory"}
    state_dir = env["VGPU_STATE_DIR"]
    assert host_path(state_dir) == {"path": state_dir, "type": "DirectoryOrCreate"}
    assert not mounts[state_dir].get("readOnly")
    assert not mounts[plugin_dir].get("readOnly")  # the daemon serves its socket there

    config_dir = str(Path(env["VGPU_CONFIG"]).parent)
    assert mounts[config_dir]["readOnly"] is True
    assert volumes[mounts[config_dir]["name"]]["configMap"]["name"] == "vgpu-config"
    assert Path(env["VGPU_CONFIG"]).name == "config.yaml"

    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    # Every other hostPath is /dev/null for the NVIDIA runtime's volume-mounts mode, NFD's
    # feature directory for the node labels, or read-only for attribution: the host's cgroup
    # hierarchy and the kubelet's container log links.
    feature_dir = str(Path(NFD_FEATURE_FILE).parent)
    others = {
        v["hostPath"]["path"]
        for v in spec["volumes"]
        if "hostPath" in v
        and v["hostPath"]["path"] not in {plugin_dir, pod_resources_dir, state_dir, feature_dir}
    }
    assert others == {
        "/dev/null",
        "/sys/fs/cgroup",
        "/var/log/containers",
        "/run/vgpu",
        "/var/run/cdi",
        "/opt/vgpu/libexec",
    }
    assert "/var/run/nvidia-container-devices/all" in mounts
    assert mounts["/var/log/containers"]["readOnly"] is True
    # Writable for the memory limits' probe (a throw-away cgroup per GPU), under the mount the
    # daemon is told of, and the probe root a plain path there.
    assert env["VGPU_CGROUP_MOUNT"] == "/host/sys/fs/cgroup"
    assert host_path("/host/sys/fs/cgroup") == {"path": "/sys/fs/cgroup", "type": "Directory"}
    assert env["VGPU_MEMORY_LIMIT_PROBE_ROOT"] == "/"
    # The hook's socket where the CDI specs' hook dials it (the CLI's default), and the CDI
    # directory the node's runtime reads.
    defaults = build_parser().parse_args(["serve"])
    assert host_path(str(Path(defaults.memory_limit_socket).parent)) == {
        "path": "/run/vgpu",
        "type": "DirectoryOrCreate",
    }
    assert host_path(env["VGPU_CDI_DIR"]) == {"path": "/var/run/cdi", "type": "DirectoryOrCreate"}


def test_the_runtime_hook_is_installed_on_the_host_where_the_cdi_specs_name_it() -> None:
    """An init container copies the image's static hook to the host path the daemon's CDI specs
    name (the CLI's --memory-limit-hook default), renaming it into place."""
    spec = daemonset()["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["image"] == container()["image"]
    hook = build_parser().parse_args(["serve"]).memory_limit_hook
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = init["volumeMounts"]
    assert volumes[mount["name"]]["hostPath"]["path"] == str(Path(hook).parent)
    script = init["command"][-1]
    host_hook = f"{mount['mountPath']}/{Path(hook).name}"
    assert script.startswith(f"install -m 0755 {hook} ")
    assert script.endswith(f"mv -f {mount['mountPath']}/.vgpu-hook.new {host_hook}")
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False


def test_security_context_is_the_narrowest_that_works() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    c = container()
    sc = c["securityContext"]
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsUser"] == 0
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == CAPABILITIES
    assert "SYS_ADMIN" not in sc["capabilities"]["add"]


def test_each_added_capability_says_why() -> None:
    lines = (BASE / "daemonset.yaml").read_text().splitlines()
    for capability in CAPABILITIES:
        (i,) = [n for n, line in enumerate(lines) if line.strip() == f"- {capability}"]
        assert lines[i - 1].strip().startswith("#"), f"no comment above {capability}"


def test_scheduling_and_resources() -> None:
    ds = daemonset()
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    assert spec["priorityClassName"] == "system-node-critical"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    # Terms are ORed: either label marks a GPU node.
    assert [t["matchExpressions"] for t in terms] == [
        [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}],
        [
            {
                "key": "feature.node.kubernetes.io/pci-10de.present",
                "operator": "In",
                "values": ["true"],
            }
        ],
    ]
    tolerations = {(t["key"], t.get("effect")) for t in spec["tolerations"]}
    assert ("nvidia.com/gpu", "NoSchedule") in tolerations
    assert ("CriticalAddonsOnly", None) in tolerations
    assert container()["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "500m", "memory": "256Mi"},
    }
    assert spec["serviceAccountName"] == one(BASE / "serviceaccount.yaml")["metadata"]["name"]


def test_probes_and_the_service_use_the_metrics_port() -> None:
    c = container()
    port = int(env_of(c)["VGPU_METRICS_ADDRESS"].rpartition(":")[2])
    probe_port = int(env_of(c)["VGPU_PROBE_ADDRESS"].rpartition(":")[2])
    assert c["ports"] == [
        {"name": "metrics", "containerPort": port, "protocol": "TCP"},
        {"name": "probes", "containerPort": probe_port, "protocol": "TCP"},
    ]
    # The probes have a listener of their own, which no client of the metrics port crowds out.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "probes"}, probe

    service = one(BASE / "service.yaml")
    assert service["spec"]["clusterIP"] == "None"  # headless: every daemon is scraped
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert daemonset()["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_daemon_gets_nvml_from_the_nvidia_runtime() -> None:
    env = env_of(container())
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["VGPU_BACKEND"] == "nvml"


def test_service_account_has_no_token() -> None:
    sa = one(BASE / "serviceaccount.yaml")
    assert sa["automountServiceAccountToken"] is False
    names = {p.name for p in DEPLOY.rglob("*.yaml")}
    assert not any("role" in n.lower() for n in names), "the daemon needs no API permissions"


# --- examples -----------------------------------------------------------------------------------


def slice_requests(path: Path) -> dict[str, int]:
    pod = one(path)
    return {
        c["name"]: c["resources"]["limits"]["nvidia.com/vgpu"] for c in pod["spec"]["containers"]
    }


def test_examples_request_slices() -> None:
    resource = Config().resource_name
    assert resource == "nvidia.com/vgpu"
    assert slice_requests(EXAMPLES / "pod.yaml") == {"cuda": 1}
    counts = slice_requests(EXAMPLES / "multi-container.yaml")
    assert len(counts) == 2
    assert len(set(counts.values())) == 2, f"the two containers request the same: {counts}"
