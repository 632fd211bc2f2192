"""daemonset/README.md stays true: the config it quotes, the log lines it explains, its links."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from deviceplugin.config import NFD_FEATURE_NAME, default_config_yaml
from tests.deploy.support import DEPLOY, ROOT

README = DEPLOY / "README.md"
BEGIN = "<!-- default config: written by tools/gen_daemonset_config.py; tests/deploy checks it -->"
END = "<!-- end default config -->"
# Log lines the operator guide must explain (the issue that asked for it names them).
EXPLAINED = (
    "kubelet not accepting registration yet",
    "re-registering with the kubelet",
    "poll failed; keeping the last device list",
    "state file rejected",
    "gpu unhealthy",
    "config error",
    "cannot start",
)
# Lines built from parts in the source, as the log shows them -> a piece of the source.
BUILT: dict[str, str] = {}


def section(text: str, heading: str) -> str:
    _, _, rest = text.partition(f"\n## {heading}\n")
    assert rest, f"no section {heading!r}"
    return rest.split("\n## ", 1)[0]


def package_files() -> list[Path]:
    return [p for p in (ROOT / "deviceplugin").rglob("*.py") if "_proto" not in p.parts]


@cache
def source_text() -> str:
    return "\n".join(p.read_text() for p in package_files())


@cache
def source_strings() -> list[str]:
    """Every string literal of the package, implicit concatenations joined, f-string fields as
    a NUL."""
    strings: list[str] = []
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                strings.append(
                    "".join(
                        str(v.value) if isinstance(v, ast.Constant) else "\0" for v in node.values
                    )
                )
    return strings


def test_readme_quotes_the_default_config() -> None:
    text = README.read_text()
    _, _, rest = text.partition(BEGIN + "\n")
    quoted, found, _ = rest.partition(END)
    assert found, "the default-config markers are missing"
    assert quoted == f"```yaml\n{default_config_yaml(node_labels_file=NFD_FEATURE_NAME)}```\n", (
        "stale: run python tools/gen_daemonset_config.py"
    )


def test_troubleshooting_explains_log_lines_the_daemon_writes() -> None:
    table = section(README.read_text(), "Troubleshooting")
    documented = re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)
    for needle in EXPLAINED:
        assert any(line.startswith(needle) for line in documented), f"{needle!r} not explained"
    for line in documented:
        if line in BUILT:
            assert BUILT[line] in source_text(), line
            continue
        # "..." stands for a field's value: %s, %r or an f-string field in the source.
        pattern = re.compile(re.escape(line).replace(re.escape("..."), ".*?"))
        assert any(pattern.match(s) for s in source_strings()), (
            f"the daemon writes no log line like {line!r}"
        )


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_within_the_readme_resolve() -> None:
    text = README.read_text()
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    for target in re.findall(r"\]\(#([^)]+)\)", text):
        assert target in anchors, f"link to #{target}, which no heading makes"


def test_readme_names_files_that_exist() -> None:
    text = README.read_text()
    for name in re.findall(r"`((?:base|monitoring|overlays|examples)/[^`]*)`", text):
        assert (DEPLOY / name).exists(), name
    for name in re.findall(r"`(tools/[^` ]+)`", text):
        assert (ROOT / name).exists(), name


def test_top_level_readme_points_to_the_operator_guide() -> None:
    text = (ROOT / "README.md").read_text()
    install = section(text, "Install")
    assert "daemonset/README.md" in install
    assert "kubectl apply -k ../my-vgpu" in install
    # The image exists before anything that pulls it is applied.
    assert install.index("podman push") < install.index("kubectl apply -k ../my-vgpu")
    assert install.index("pod-security.kubernetes.io/enforce=privileged") < install.index(
        "helm install"
    )


def test_the_readme_is_a_front_door() -> None:
    """The README stays short: what vgpu is, how it compares, install, migrate, where to read on."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for heading in ("Install", "Migrate from NVIDIA's device plugin", "Operate"):
        assert section(text, heading)
    assert "Not yet run on a real GPU" in text[:3000]


def test_links_between_the_pages_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}"


def test_the_overlay_example_builds(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    text = README.read_text()
    _, _, rest = text.partition("\n### Your own overlay\n")
    example = rest.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "vgpu").symlink_to(ROOT)
    overlay = tmp_path / "my-vgpu"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(example)
    (overlay / "config.yaml").write_text("version: v1\nslicing:\n  replicas: 8\n")
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(result.stdout) if d["kind"] != "ConfigMap"}
    configs = [
        d
        for d in yaml.safe_load_all(result.stdout)
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})
    ]
    assert [c["data"]["config.yaml"] for c in configs] == ["version: v1\nslicing:\n  replicas: 8\n"]
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"].startswith("registry.example.com/")
    assert docs["ServiceMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_running_guide_deploys_in_an_order_that_works() -> None:
    """Followed top to bottom: the image exists before anything pulls it, and the namespace
    admits privileged pods before the chart's DaemonSet is created in it."""
    text = (ROOT / "docs" / "running.md").read_text()
    deploying = section(text, "Deploying")
    push = deploying.index("podman push")
    assert push < deploying.index("kubectl apply -k ../my-vgpu")
    assert push < deploying.index("helm install")
    assert deploying.index("pod-security.kubernetes.io/enforce=privileged") < deploying.index(
        "helm install"
    )
    assert "--create-namespace" not in deploying  # it would create the namespace unlabelled


def test_the_migration_docs_say_an_nvidia_file_starts_in_monitor_mode() -> None:
    """The README's migration section and docs/migrating.md tell an NVIDIA user that nothing is
    killed or paused at first, and the one setting that turns enforcement on, by the names
    `serve` and the chart read."""
    from deviceplugin.enforcement_mode import CHART_VALUE, ENV, FLAG

    readme = section((ROOT / "README.md").read_text(), "Migrate from NVIDIA's device plugin")
    guide = (ROOT / "docs" / "migrating.md").read_text()
    chart_values = yaml.safe_load((DEPLOY / "chart" / "values.yaml").read_text())
    assert chart_values[CHART_VALUE] is False
    for text in (readme, guide):
        flat = " ".join(text.split())
        assert "monitor mode" in flat
        assert "would_kill" in flat
        assert CHART_VALUE in flat
        assert ENV in flat
    assert FLAG in guide
    assert "Only vgpu's own format can turn enforcement" not in guide


def test_the_docs_claim_no_refusal_that_nvidias_plugin_does_not_make() -> None:
    """Not every file vgpu refuses is refused by NVIDIA's plugin (it takes replicas: 2000): the
    README and the migration guide say which are vgpu's own, with the bound vgpu holds."""
    from deviceplugin.config import MAX_REPLICAS

    readme = section((ROOT / "README.md").read_text(), "Migrate from NVIDIA's device plugin")
    guide = (ROOT / "docs" / "migrating.md").read_text()
    for text in (readme, guide):
        flat = " ".join(text.split())
        assert "refused here is refused by NVIDIA's plugin too" not in flat
        assert f"more than {MAX_REPLICAS} replicas" in flat or f"above {MAX_REPLICAS}" in flat
    assert "| a resource listed twice under one `sharing` section | serves the larger" in guide
    assert "| vgpu's own keys" in guide
