"""Container images built locally from the static busybox: no registry is reachable.

One OCI image-layout tarball holds two images, `BUSYBOX` (for pods; its shell, sleep, cat ...)
and `PAUSE` (containerd's sandbox image: waits until it is told to stop). Built once into the
cache, byte for byte the same each time; `ctr -n k8s.io images import` loads it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

BUSYBOX = "docker.io/vgpu-e2e/busybox:1"
PAUSE = "docker.io/vgpu-e2e/pause:1"
APPLETS = (
    "sh", "sleep", "cat", "env", "true", "false", "echo", "ls", "ps", "kill", "yes", "dd",
    "head", "tail", "grep", "wc", "date", "id", "hostname", "mkdir", "rm", "touch", "test",
)  # fmt: skip
PAUSE_COMMAND = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait; done"]


def busybox_binary() -> Path | None:
    """The static busybox to put in the images (Debian's busybox-static), or None."""
    for candidate in ("/bin/busybox", "/usr/bin/busybox"):
        path = Path(candidate)
        if path.is_file():
            return path
    found = shutil.which("busybox")
    return Path(found) if found else None


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _rootfs_layer(busybox: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "run"):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if directory == "tmp" else 0o755
            info.mtime = 0
            tar.addfile(info)
        _tar_member(tar, "bin/busybox", busybox, 0o755)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            info.mtime = 0
            tar.addfile(info)
        _tar_member(tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\n")
        _tar_member(tar, "etc/group", b"root:x:0:\n")
    return buffer.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def build_images(cache: Path) -> Path:
    """The image tarball in `cache`, built when missing."""
    busybox = busybox_binary()
    if busybox is None:
        raise FileNotFoundError("busybox not found: apt-get install busybox-static")
    content = busybox.read_bytes()
    key = hashlib.sha256(content + json.dumps(APPLETS).encode()).hexdigest()[:16]
    out = cache / f"images-{key}.tar"
    if out.is_file():
        return out
    blobs: dict[str, bytes] = {}
    layer = _rootfs_layer(content)
    layer_ref = _blob(blobs, layer)
    manifests = []
    for name, command in ((BUSYBOX, ["/bin/sh"]), (PAUSE, PAUSE_COMMAND)):
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": command, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_ref["digest"]]},
        }
        config_ref = _blob(blobs, json.dumps(config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_ref},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_ref}],
        }
        manifest_ref = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
        manifests.append(
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_ref,
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        )
    index = {"schemaVersion": 2, "manifests": manifests}
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _tar_member(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in sorted(blobs.items()):
            _tar_member(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
    tmp.replace(out)
    return out
