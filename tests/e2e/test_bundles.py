"""Where the e2e node's binaries come from (tests/e2e/bundles.py, runtime.py), without a
cluster: a containerd tarball is found beside the Kubernetes bundle, checked, unpacked once and
refused when it is not containerd 2.x; without one, the reason real containers cannot run names
where it was looked for and what to do."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tests.e2e import bundles
from tests.e2e.bundles import (
    CACHE_ENV,
    CONTAINERD_ENV,
    Bundle,
    ClusterError,
    containerd_source,
    resolve_containerd,
)
from tests.e2e.runtime import containerd_missing


def fake_containerd_tarball(directory: Path, version: str) -> Path:
    """A containerd-*.tgz whose `containerd --version` says `version`, and its .sha256."""
    scripts = {
        "bin/containerd": f"#!/bin/sh\necho containerd example.com/containerd {version}\n",
        "bin/containerd-shim-runc-v2": "#!/bin/sh\n",
        "bin/ctr": "#!/bin/sh\n",
    }
    tarball = directory / f"containerd-{version.lstrip('v')}-cdi.tgz"
    with tarfile.open(tarball, "w:gz") as tar:
        for name, text in scripts.items():
            info = tarfile.TarInfo(f"containerd-{version}/{name}")
            info.size = len(text)
            info.mode = 0o755
            tar.addfile(info, io.BytesIO(text.encode()))
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    tarball.with_name(tarball.name + ".sha256").write_text(f"{digest}  {tarball.name}\n")
    return tarball


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(CONTAINERD_ENV, raising=False)
    return tmp_path / "cache"


def k8s_bundle(home: Path) -> Bundle:
    return Bundle(home / "kube-multi", home / "tinyetcd", home)


def test_without_a_containerd_tarball_the_reason_says_where_and_what_to_do(
    tmp_path: Path, cache: Path
) -> None:
    reason = containerd_missing(k8s_bundle(tmp_path))
    assert reason is not None
    assert str(tmp_path) in reason
    assert "containerd-2.3.4-cdi.tgz" in reason
    assert CONTAINERD_ENV in reason


def test_the_tarball_beside_the_bundle_is_checked_and_unpacked_once(
    tmp_path: Path, cache: Path
) -> None:
    tarball = fake_containerd_tarball(tmp_path, "v2.3.4")
    assert containerd_source(tmp_path) == tarball
    assert containerd_source(tmp_path / "k8s-v1.36.2-bundle.tgz") == tarball  # the bundle file
    found = resolve_containerd(tarball)
    assert found.version == "2.3.4"
    assert found.containerd.is_file()
    assert found.root.is_relative_to(cache)
    assert bundles.unpack_once(tarball, "containerd", bundles.CONTAINERD_BINARIES) == found.root


def test_a_tarball_that_does_not_match_its_sha256_is_refused(tmp_path: Path, cache: Path) -> None:
    tarball = fake_containerd_tarball(tmp_path, "v2.3.5")
    tarball.with_name(tarball.name + ".sha256").write_text("0" * 64 + "\n")
    with pytest.raises(ClusterError, match="sha256"):
        resolve_containerd(tarball)
    assert not cache.exists() or not any(cache.iterdir())


def test_containerd_1_is_refused_naming_what_the_node_needs(tmp_path: Path, cache: Path) -> None:
    tarball = fake_containerd_tarball(tmp_path, "1.6.20")
    with pytest.raises(ClusterError, match=r"1\.6\.20: the node needs containerd 2\.x"):
        resolve_containerd(tarball)


def test_vgpu_e2e_containerd_names_another_one(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fake_containerd_tarball(elsewhere, "v2.0.0")
    monkeypatch.setenv(CONTAINERD_ENV, str(elsewhere))
    assert containerd_source(tmp_path) == elsewhere
    assert resolve_containerd(elsewhere).version == "2.0.0"
    reason = containerd_missing(k8s_bundle(tmp_path))  # runc or busybox may still be missing
    assert reason is None or "containerd" not in reason
