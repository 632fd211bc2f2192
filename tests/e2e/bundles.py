"""The binaries the end-to-end node runs, from tarballs checked and unpacked once into a cache.

Two bundles, usually side by side in one directory:

- Kubernetes (``VGPU_E2E_K8S_BUNDLE``: the tarball ``*bundle*.tgz``, its directory, or an
  unpacked directory with ``kube-multi`` and ``tinyetcd``);
- containerd 2.x with CDI (``containerd-*.tgz`` beside the Kubernetes bundle, or
  ``VGPU_E2E_CONTAINERD``: such a tarball, its directory, or an unpacked directory with
  ``bin/containerd``, ``bin/containerd-shim-runc-v2`` and ``bin/ctr``).

A tarball is checked against the ``<tarball>.sha256`` beside it when that file exists, then
unpacked once into ``$VGPU_E2E_CACHE`` (default ``~/.cache/vgpu/e2e``): a directory named after
its digest, made whole by a rename, so test workers unpacking at once never see half of one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BUNDLE_ENV = "VGPU_E2E_K8S_BUNDLE"
CONTAINERD_ENV = "VGPU_E2E_CONTAINERD"
CACHE_ENV = "VGPU_E2E_CACHE"
K8S_BINARIES = ("kube-multi", "tinyetcd")
CONTAINERD_BINARIES = ("bin/containerd", "bin/containerd-shim-runc-v2", "bin/ctr")


class ClusterError(Exception):
    """The cluster did not come up or a component misbehaved; says which and shows its log."""


@dataclass(frozen=True)
class Bundle:
    kube_multi: Path
    tinyetcd: Path
    # Where the bundle was found (the tarball's directory, or the unpacked directory): the
    # containerd tarball is looked for there.
    home: Path | None = None


@dataclass(frozen=True)
class Containerd:
    """containerd 2.x with CDI: its unpacked directory (``bin/``, and ``conf/`` in the bundle)."""

    root: Path
    version: str

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def containerd(self) -> Path:
        return self.bin_dir / "containerd"

    @property
    def shim(self) -> Path:
        return self.bin_dir / "containerd-shim-runc-v2"

    @property
    def ctr(self) -> Path:
        return self.bin_dir / "ctr"

    @property
    def cdicheck(self) -> Path | None:
        """`cdicheck validate FILE` checks a CDI spec with containerd's own CDI library."""
        path = self.bin_dir / "cdicheck"
        return path if path.is_file() else None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vgpu" / "e2e")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _holding(directory: Path, binaries: Sequence[str]) -> Path | None:
    """`directory` when it holds every one of `binaries`, else its one subdirectory that does."""
    for candidate in (directory, *sorted(p for p in directory.glob("*") if p.is_dir())):
        if all((candidate / b).is_file() for b in binaries):
            return candidate
    return None


def unpack_once(tarball: Path, kind: str, binaries: Sequence[str]) -> Path:
    """The directory holding `binaries` in `tarball`, unpacked into the cache when it is not
    there yet (checked against `<tarball>.sha256` first, when that file exists)."""
    digest = _sha256(tarball)
    sums = tarball.with_name(tarball.name + ".sha256")
    if sums.is_file():
        expected = sums.read_text().split()[0].lower()
        if expected != digest:
            raise ClusterError(f"{tarball}: sha256 {digest}, but {sums.name} says {expected}")
    target = cache_root() / f"{kind}-{digest[:16]}"
    found = _holding(target, binaries) if target.is_dir() else None
    if found is not None:
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        home = _holding(tmp, binaries)
        if home is None:
            raise ClusterError(f"{tarball}: has no {', '.join(binaries)}")
        for name in binaries:
            (home / name).chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it first
            if _holding(target, binaries) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _holding(target, binaries)
    assert found is not None, target
    return found


def _one_tarball(directory: Path, pattern: str, what: str) -> Path | None:
    tarballs = [
        *sorted(directory.glob(f"{pattern}.tgz")),
        *sorted(directory.glob(f"{pattern}.tar.gz")),
    ]
    if len(tarballs) > 1:
        raise ClusterError(f"{directory}: more than one {what}: {[p.name for p in tarballs]}")
    return tarballs[0] if tarballs else None


def resolve_bundle(spec: str) -> Bundle:
    """The Kubernetes bundle's binaries from `spec`: an unpacked directory, a tarball, or a
    directory holding one tarball `*bundle*.tgz`."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "kube-multi").is_file():
        return Bundle(path / "kube-multi", path / "tinyetcd", path)
    if path.is_dir():
        tarball = _one_tarball(path, "*bundle*", "Kubernetes bundle")
        if tarball is None:
            raise ClusterError(
                f"{BUNDLE_ENV}={spec}: expected kube-multi or one *bundle*.tgz in it"
            )
        path = tarball
    if not path.is_file():
        raise ClusterError(f"{BUNDLE_ENV}={spec}: no such file or directory")
    home = unpack_once(path, "bundle", K8S_BINARIES)
    return Bundle(home / "kube-multi", home / "tinyetcd", path.parent)


def containerd_source(near: Path | None) -> Path | None:
    """Where containerd comes from: `VGPU_E2E_CONTAINERD` when set, else the one
    `containerd-*.tgz` in `near` (the Kubernetes bundle's directory), else None."""
    named = os.environ.get(CONTAINERD_ENV)
    if named:
        return Path(named).expanduser()
    if near is None:
        return None
    directory = near if near.is_dir() else near.parent
    return _one_tarball(directory, "containerd-*", "containerd tarball")


@functools.cache
def resolve_containerd(source: Path) -> Containerd:
    """containerd from `source` (a tarball, a directory holding one, or an unpacked directory),
    checked to be 2.x: the first major version whose CRI plugin takes the kubelet's CDI devices
    without a setting (1.7.12+ needs `enable_cdi`; 1.6 has no CDI)."""
    root = _holding(source, CONTAINERD_BINARIES) if source.is_dir() else None
    if root is None:
        tarball = (
            _one_tarball(source, "containerd-*", "containerd tarball")
            if source.is_dir()
            else source
        )
        if tarball is None or not tarball.is_file():
            raise ClusterError(
                f"{source}: neither containerd's binaries ({', '.join(CONTAINERD_BINARIES)}) "
                "nor a containerd-*.tgz"
            )
        root = unpack_once(tarball, "containerd", CONTAINERD_BINARIES)
    out = subprocess.run(
        [str(root / "bin" / "containerd"), "--version"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    match = re.search(r"\sv?(\d+)\.(\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise ClusterError(f"{root}/bin/containerd --version: {out.stdout}{out.stderr}".strip())
    if int(match.group(1)) < 2:
        raise ClusterError(
            f"{root}/bin/containerd is {match.group(0).strip()}: the node needs containerd 2.x "
            "(CDI on by default), e.g. containerd-2.3.4-cdi.tgz beside the Kubernetes bundle"
        )
    return Containerd(root, ".".join(match.groups()))
