"""The front door: what an operator reads first says the image is unpublished before any install
command, installs without editing this checkout (kustomize through kubectl, an overlay of the
operator's own), names the chart's release alike everywhere, and every docs page is listed."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import CHART, DEPLOY, ROOT
from tests.deploy.test_chart import RELEASE

DOCS = ROOT / "docs"
# The pages an operator reads, and the chart's own words about how it is installed.
OPERATOR_PAGES = (ROOT / "README.md", DEPLOY / "README.md", *sorted(DOCS.glob("*.md")))
CHART_TEXT = (
    CHART / "values.yaml",
    CHART / "values-dra.yaml",
    CHART / "templates" / "NOTES.txt",
)
INSTALL = re.compile(r"kubectl apply -k|helm install ")
UNPUBLISHED = re.compile(r"[Nn]o image is published|is not published")


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.parametrize("page", OPERATOR_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_says_the_image_is_unpublished_before_it_installs(page: Path) -> None:
    text = page.read_text()
    first_install = min(
        (m.start() for block in sh_blocks(text) for m in INSTALL.finditer(block)), default=None
    )
    if first_install is None:
        return  # no install command to run
    first_block = next(b for b in sh_blocks(text) if INSTALL.search(b))
    said = UNPUBLISHED.search(text)
    assert said is not None, f"{page.name} installs without saying no image is published"
    assert said.start() < text.index(first_block), page.name


@pytest.mark.parametrize("page", OPERATOR_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_edits_this_checkout_to_install(page: Path) -> None:
    text = page.read_text()
    assert "kustomize edit" not in text, page.name
    assert "cd daemonset/base" not in text, page.name
    assert "daemonset/base/config.yaml" not in text, page.name


def test_the_readme_install_works_with_kubectl_alone_and_leaves_the_checkout_alone(
    tmp_path: Path,
) -> None:
    """The README's kustomize lines, run at the top of a checkout (here a copy of this one's
    daemonset/, in a directory named vgpu): kubectl's own kustomize builds the install with the
    image pushed, from an overlay beside the checkout, and no file of the checkout changes."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not fetched: python tools/fetch_k8s_tools.py")
    text = (ROOT / "README.md").read_text()
    (block,) = [b for b in sh_blocks(text) if "podman push" in b]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mkdir -p ../my-vgpu"))
    end = lines.index("kubectl apply -k ../my-vgpu")
    overlay = "\n".join(lines[start:end])
    checkout = tmp_path / "vgpu"
    shutil.copytree(DEPLOY, checkout / "daemonset")
    before = digests(checkout)
    result = subprocess.run(
        ["bash", "-c", f"{overlay}\n{kubectl} kustomize ../my-vgpu"],
        capture_output=True, text=True, timeout=60, check=False, cwd=checkout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "my-vgpu" / "kustomization.yaml").is_file()
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/vgpu-device-plugin:0.1.0"
    assert {d["kind"] for d in docs} >= {"Namespace", "DaemonSet", "ConfigMap", "ServiceAccount"}
    assert digests(checkout) == before


def digests(root: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


HELM_COMMAND = re.compile(r"helm (install|upgrade|uninstall) ([^\s`]+)( [^\s`]+)?")


def test_the_release_is_named_alike_in_readme_chart_and_guides() -> None:
    """Every helm command of this chart names the release the tests install and the objects are
    named after (kustomize's names): one name to copy from any page."""
    found: list[tuple[str, str]] = []
    for path in (*OPERATOR_PAGES, *CHART_TEXT):
        text = " ".join(path.read_text().replace("\\\n", " ").replace("#", " ").split())
        for _verb, release, target in HELM_COMMAND.findall(text):
            if "nvdp/" in target or release.startswith(("<", "-", "...")):
                continue  # NVIDIA's chart, a placeholder, or a flag where the name is elided
            found.append((str(path.relative_to(ROOT)), release))
    assert found
    assert {release for _, release in found} == {RELEASE}, found


def test_every_docs_page_is_in_the_index() -> None:
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", index))
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert page.name in linked, f"docs/README.md does not list {page.name}"
    assert "../daemonset/README.md" in linked
    for target in linked:
        assert (DOCS / target).exists(), target
    assert "docs/README.md" in (ROOT / "README.md").read_text()
