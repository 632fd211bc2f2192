"""The Helm chart as NVIDIA's users bring their values and files to it, and under any release name:
what `helm template` renders or refuses, and why. The same chart against a real API server, under
several release names at once: tests/deploy/test_apiserver_rbac.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deviceplugin.config import config_from_bytes
from tests.deploy.support import CHART, NAMESPACE, ROOT, Manifest
from tests.deploy.test_chart import (
    by_kind,
    env_of,
    pod_spec,
    render,
    run_helm,
    template_args,
    the,
    volumes_and_mounts,
)

DRA = CHART / "values-dra.yaml"
NVIDIA_MPS = (
    "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
)
# The top-level values of NVIDIA k8s-device-plugin's chart (deployments/helm/nvidia-device-plugin/
# values.yaml, v0.17 to v0.18, and nvidiaDevRoot, which its templates read), each with a value of
# the kind it takes there.
NVIDIA_VALUES = {
    "config.name": "nvidia-configs",
    "compatWithCPUManager": "true",
    "migStrategy": "mixed",
    "failOnInitError": "false",
    "deviceListStrategy": "volume-mounts",
    "deviceIDStrategy": "index",
    "nvidiaDriverRoot": "/run/nvidia/driver",
    "nvidiaDevRoot": "/",
    "gdrcopyEnabled": "true",
    "gdsEnabled": "true",
    "mofedEnabled": "true",
    "deviceDiscoveryStrategy": "nvml",
    "nameOverride": "nvdp",
    "fullnameOverride": "nvdp",
    "namespaceOverride": "nvidia",
    "selectorLabelsOverride.app": "nvdp",
    "componentSelectorLabels.enabled": "true",
    "allowDefaultNamespace": "true",
    "imagePullSecrets[0].name": "registry",
    "image.repository": "registry.example.com/vgpu",
    "updateStrategy.type": "OnDelete",
    "podAnnotations.a": "b",
    "podSecurityContext.runAsUser": "0",
    "securityContext.privileged": "false",
    "resources.limits.cpu": "1",
    "nodeSelector.gpu": "yes",
    "affinity.nodeAffinity": "null",
    "tolerations[0].key": "nvidia.com/gpu",
    "priorityClassName": "system-node-critical",
    "runtimeClassName": "nvidia",
    "devicePlugin.enabled": "false",
    "gfd.enabled": "true",
    "nfd.enableNodeFeatureApi": "true",
    "mps.root": "/run/nvidia/mps",
    "mps.enableHostPID": "true",
    "cdi.nvidiaHookPath": "/usr/bin/nvidia-cdi-hook",
}
# What this chart says of those it has no value for: where the setting goes instead.
ELSEWHERE = {
    "migStrategy": "set config.mig.strategy",
    "deviceListStrategy": "set config.allocation.deviceListStrategy",
}


def template_error(*args: str) -> str:
    result = run_helm(*args)
    assert result.returncode != 0, f"rendered: {args}"
    return result.stderr


@pytest.mark.parametrize("value", sorted(NVIDIA_VALUES))
def test_every_value_of_nvidias_chart_is_taken_or_refused_saying_what_to_do(value: str) -> None:
    """A values file brought from NVIDIA's chart never meets the schema's bare "additional
    properties not allowed": each value means the same here, or is refused with a hint."""
    setting = f"{value}={NVIDIA_VALUES[value]}"
    result = run_helm(*template_args(sets=(setting,)))
    top = value.split(".", maxsplit=1)[0].split("[", maxsplit=1)[0]
    if result.returncode == 0:
        assert top not in ("gfd", "nfd", "devicePlugin", "cdi", "compatWithCPUManager"), value
        return
    assert "not allowed" not in result.stderr, result.stderr
    if value in ELSEWHERE:
        assert ELSEWHERE[value] in result.stderr
    else:
        name = ".".join(value.split(".")[:2]) if top == "mps" else top
        assert f"- {name} (NVIDIA's chart): " in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("setting", "hint"),
    [
        ("gfd.enabled=true", "--set devicePlugin.enabled=false --set gfd.enabled=true"),
        ("nfd.enabled=true", "install it on its own (v0.15 or newer)"),
        ("compatWithCPUManager=true", "config.flags.plugin.passDeviceSpecs=true"),
        ("devicePlugin.enabled=true", "deploys the device plugin and nothing else"),
        ("mps.enableHostPID=true", "always runs in the host's PID namespace"),
        ("cdi.nvidiaHookPath=/usr/bin/nvidia-cdi-hook", "nvidia-ctk cdi generate"),
    ],
)
def test_nvidia_only_values_are_refused_with_a_hint(setting: str, hint: str) -> None:
    error = template_error(*template_args(sets=(setting,)))
    assert "values of NVIDIA's chart that this chart does not have" in error
    assert hint in " ".join(error.split())


def test_several_nvidia_only_values_are_refused_together() -> None:
    error = template_error(*template_args(sets=("gfd.enabled=true", "nfd.enabled=true")))
    assert "- gfd (NVIDIA's chart)" in error
    assert "- nfd (NVIDIA's chart)" in error


# --- the config file ---------------------------------------------------------------------------


def config_map_data(docs: list[Manifest]) -> dict[str, str]:
    (config_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    data: dict[str, str] = config_map["data"]
    return data


def test_set_file_config_writes_nvidias_file_as_is(tmp_path: Path) -> None:
    """`--set-file config=FILE`, as NVIDIA's users pass a file: the daemon's config.yaml is that
    file, byte for byte, and it reads as NVIDIA's config."""
    nvidia = tmp_path / "nvidia-config.yaml"
    nvidia.write_text(
        "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    docs = render(files=(f"config={nvidia}",))
    assert config_map_data(docs) == {"config.yaml": nvidia.read_text()}
    config = config_from_bytes(nvidia.read_bytes(), "config.yaml")
    assert config.resource_name == "nvidia.com/gpu"
    assert config.slicing.default.replicas == 4
    assert env_of(docs)["VGPU_CONFIG"] == "/etc/vgpu/config.yaml"


def test_a_config_file_that_is_not_a_mapping_is_refused_naming_the_value(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: v1\nsharing: [\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- version: v1\n")
    error = template_error(*template_args(files=(f"config.map.a100={broken}",)))
    assert "config.map.a100 is not a YAML mapping of config keys" in error
    error = template_error(*template_args(files=(f"config={listed}",)))
    assert "config is not a YAML mapping of config keys" in error


def test_a_config_that_mixes_the_formats_is_refused_at_render(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(NVIDIA_MPS + "enforcement:\n  dryRun: true\n")
    error = template_error(*template_args(files=(f"config.map.mixed={mixed}",)))
    assert "config.map.mixed mixes NVIDIA's format (sharing) with vgpu's keys (enforcement)" in (
        error
    )
    # ... as the daemon does.
    with pytest.raises(Exception, match="enforcement"):
        config_from_bytes(mixed.read_bytes(), "mixed")


def test_an_nvidia_mps_file_in_config_map_needs_what_mps_needs(tmp_path: Path) -> None:
    mps = tmp_path / "mps.yaml"
    mps.write_text(NVIDIA_MPS)
    files = (f"config.map.mps={mps}",)
    error = template_error(*template_args(files=files))
    assert "config.map.mps turns MPS on (sharing.mps): set mps.enabled=true too" in error
    docs = render(files=files, sets=("mps.enabled=true",))
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["mps-root"]["hostPath"]["path"] == mounts["mps-root"]["mountPath"]
    assert mounts["mps-root"]["mountPath"] == config_from_bytes(mps.read_bytes(), "mps").mps.root
    assert mounts["mps-shm"]["mountPath"] == "/dev/shm"


def test_flags_mps_root_and_the_charts_mps_mounts_agree(tmp_path: Path) -> None:
    """NVIDIA's chart mounts /run/nvidia/mps; vgpu's daemon runs MPS where the file says
    (flags.mpsRoot), else in /run/vgpu/mps: the chart mounts that directory or refuses."""
    rooted = tmp_path / "rooted.yaml"
    rooted.write_text(NVIDIA_MPS + "flags:\n  mpsRoot: /run/nvidia/mps\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text(NVIDIA_MPS)
    error = template_error(*template_args(files=(f"config={rooted}",), sets=("mps.enabled=true",)))
    assert (
        "config: flags.mpsRoot is /run/nvidia/mps, but mps.root (the host directory the chart"
        " mounts) is /run/vgpu/mps: make them the same"
    ) in error
    error = template_error(
        *template_args(
            files=(f"config.map.a={plain}",), sets=("mps.enabled=true", "mps.root=/run/nvidia/mps")
        )
    )
    assert "flags.mpsRoot is not set, so the daemon uses /run/vgpu/mps" in error
    docs = render(
        files=(f"config={rooted}",), sets=("mps.enabled=true", "mps.root=/run/nvidia/mps")
    )
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["mps-root"]["hostPath"]["path"] == "/run/nvidia/mps"
    assert mounts["mps-root"]["mountPath"] == "/run/nvidia/mps"
    assert volumes["mps-shm"]["hostPath"]["path"] == "/run/nvidia/mps/shm"
    assert config_from_bytes(rooted.read_bytes(), "rooted").mps.root == "/run/nvidia/mps"


# --- names under any release ----------------------------------------------------------------------


CLUSTER_WIDE = (
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def cluster_wide(docs: list[Manifest]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_WIDE}


@pytest.mark.parametrize(
    ("release", "namespace"), [("vgpu", NAMESPACE), ("gpu-pool-b", NAMESPACE), ("vgpu", "gpu-b")]
)
def test_every_dra_object_names_this_releases_service_account(release: str, namespace: str) -> None:
    docs = render(
        DRA, release=release, namespace=namespace, sets=("config.map.a.slicing.replicas=2",)
    )
    sa = pod_spec(docs)["serviceAccountName"]
    assert the(docs, "ServiceAccount")["metadata"]["name"] == sa
    user = f"system:serviceaccount:{namespace}:{sa}"
    for binding in [d for d in docs if d["kind"] == "ClusterRoleBinding"]:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": namespace}
        ]
        assert binding["roleRef"]["name"] in {
            d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"
        }
    policy = the(docs, "ValidatingAdmissionPolicy")
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    binding = the(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]


def test_two_releases_have_cluster_wide_objects_of_their_own() -> None:
    sets = ("config.map.a.slicing.replicas=2",)
    renders = [
        render(DRA, release="vgpu", sets=sets),
        render(DRA, release="gpu-pool-b", sets=(*sets, "dra.deviceClasses=false")),
        render(DRA, release="vgpu", namespace="gpu-b", sets=(*sets, "dra.deviceClasses=false")),
    ]
    names = [cluster_wide(docs) for docs in renders]
    assert all(len(n) == 6 for n in names), names  # two roles, two bindings, policy and binding
    assert not names[0] & names[1]
    assert not names[0] & names[2]
    assert not names[1] & names[2]
    # The DeviceClasses are the driver's: the first release's alone.
    classes = [
        [d["metadata"]["name"] for d in docs if d["kind"] == "DeviceClass"] for docs in renders
    ]
    assert classes == [["vgpu.dev", "vgpu.dev-extended"], [], []]


def test_the_dra_driver_the_config_names_gets_its_classes_and_plugin_directory() -> None:
    docs = render(DRA, sets=("config.dra.driverName=gpu.example.com",))
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert set(classes) == {"gpu.example.com", "gpu.example.com-extended"}
    for device_class in classes.values():
        (selector,) = device_class["spec"]["selectors"]
        assert selector["cel"]["expression"] == 'device.driver == "gpu.example.com"'
    volumes, mounts = volumes_and_mounts(docs)
    assert volumes["plugin-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins/gpu.example.com"
    assert mounts["plugin-dir"]["mountPath"] == "/var/lib/kubelet/plugins/gpu.example.com"
    error = template_error(
        *template_args(
            DRA,
            sets=("config.map.a.dra.driverName=gpu.example.com", "config.map.b.slicing.replicas=2"),
        )
    )
    assert "the configs name different DRA drivers (dra.driverName: gpu.example.com, vgpu.dev)" in (
        error
    )


def test_the_network_policy_lets_the_dra_driver_reach_the_api_server() -> None:
    docs = render(DRA, sets=("monitoring.networkPolicy.enabled=true",))
    (rule,) = the(docs, "NetworkPolicy")["spec"]["egress"]
    assert {p["port"] for p in rule["ports"]} == {443, 6443}
    assert by_kind(docs)[("DaemonSet", "vgpu-device-plugin")]["spec"]["template"]["spec"][
        "automountServiceAccountToken"
    ]


def test_the_config_map_of_a_set_file_config_parses_back() -> None:
    """The ConfigMap the chart writes for a file given as a string is valid YAML holding it."""
    docs = render(sets=("config=version: v1",))
    assert yaml.safe_load(config_map_data(docs)["config.yaml"]) == {"version": "v1"}


def test_the_migration_guide_says_what_becomes_of_the_labels_the_daemonset_needs() -> None:
    """Every node label the chart's DaemonSet is scheduled by is one GFD or NFD puts on the
    nodes: the migration guide says what becomes of each when NVIDIA's release goes."""
    guide = (ROOT / "docs" / "migrating.md").read_text()
    _, _, section = guide.partition("\n### Node labels when NVIDIA's release goes\n")
    section = section.split("\n## ", 1)[0]
    assert section, "docs/migrating.md has no section on node labels"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    terms = values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = [e["key"] for term in terms["nodeSelectorTerms"] for e in term["matchExpressions"]]
    assert keys
    for key in keys:
        assert f"`{key}=true`" in section, key
    assert "devicePlugin.enabled=false" in section
    assert "prune" in section


def test_enforce_nvidia_config_turns_enforcement_on_keeping_the_file(tmp_path: Path) -> None:
    """An NVIDIA file runs in monitor mode unless enforceNvidiaConfig: the value reaches the
    daemon, the file stays as given."""
    nvidia = tmp_path / "nvidia-config.yaml"
    nvidia.write_text(NVIDIA_MPS.replace("mps", "timeSlicing"))
    monitored = render(files=(f"config={nvidia}",))
    assert "VGPU_ENFORCE_NVIDIA_CONFIG" not in env_of(monitored)
    enforced = render(files=(f"config={nvidia}",), sets=("enforceNvidiaConfig=true",))
    assert env_of(enforced)["VGPU_ENFORCE_NVIDIA_CONFIG"] == "true"
    assert (
        config_map_data(enforced)
        == config_map_data(monitored)
        == {"config.yaml": nvidia.read_text()}
    )
