"""The node's container runtime: containerd 2.x with CDI, runc, and local busybox images.

What the node needs (``containerd_missing`` says what is not there): the containerd tarball
(``tests/e2e/bundles.py`` finds it beside the Kubernetes bundle), Debian's ``runc`` and
``busybox-static``. Debian's containerd 1.6 is not used: it has no CDI.

``config_toml`` is containerd's config for one node (the bundle's ``conf/config.toml``, with
the node's paths): CDI on, reading only the spec directories of ``ContainerdOptions`` (inside
the node; by default ``/var/run/cdi``, the node's own scratch directory, never the host's
``/etc/cdi``); NRI off unless asked for, then serving ``/var/run/nri/nri.sock`` (the node's
scratch directory) with plugin directories of the node's own, and no plugin.

``standin_nvidia_spec`` is a stand-in for the CDI spec NVIDIA's container toolkit writes: one
``nvidia.com/gpu`` device per fake GPU and MIG device, named by UUID, whose only edit is an
environment variable naming it (a runtime refuses a container whose CDI device no spec defines,
and vgpu's DRA driver hands out ``nvidia.com/gpu=<uuid>`` beside its own claim device).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.gpu.fake import FakeState
from tests.e2e import images
from tests.e2e.bundles import BUNDLE_ENV, CONTAINERD_ENV, Bundle, Containerd, containerd_source

NVIDIA_KIND = "nvidia.com/gpu"
STANDIN_SPEC = "nvidia-standin.json"  # in the node's CDI directory
STANDIN_ENV_PREFIX = "VGPU_E2E_CDI_"  # + the device's UUID, `-` as `_`, upper case
CDI_VERSION = "0.6.0"
NRI_PLUGIN = "io.containerd.nri.v1.nri"


@dataclass(frozen=True)
class ContainerdOptions:
    """How the node's containerd runs (a test module sets ``CONTAINERD_OPTIONS``)."""

    nri: bool = False  # serve NRI at /var/run/nri/nri.sock (host: Paths.nri_socket)
    # The CDI spec directories containerd reads, as paths inside the node: /var/run/cdi is the
    # node's scratch directory (Paths.cdi_dir); /var/lib/... and /run/... are the node's tmpfs.
    cdi_spec_dirs: tuple[str, ...] = ("/var/run/cdi",)
    # More containerd settings, TOML lines appended as they are (e.g. a plugin's table).
    extra_toml: str = ""
    debug: bool = True  # logs "CDI devices from CRI Config.CDIDevices: [...]" per container


def containerd_missing(bundle: Bundle | None = None) -> str | None:
    """Why real containers cannot run here (the containerd tarball, runc or busybox missing),
    or None when they can. `bundle` (default: the one VGPU_E2E_K8S_BUNDLE names) is where the
    containerd tarball is looked for."""
    near = bundle.home if bundle is not None else None
    if near is None and os.environ.get(BUNDLE_ENV):
        near = Path(os.environ[BUNDLE_ENV]).expanduser()
    if containerd_source(near) is None:
        return (
            f"no containerd-*.tgz beside the Kubernetes bundle ({near or BUNDLE_ENV + ' unset'}): "
            f"put containerd-2.3.4-cdi.tgz there or name one with {CONTAINERD_ENV}"
        )
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    if images.busybox_binary() is None:
        return "busybox is not installed (apt-get install busybox-static)"
    return None


def config_toml(root: Path, binaries: Containerd, options: ContainerdOptions) -> str:
    """containerd's config for the node whose scratch directory is `root`."""
    runc = shutil.which("runc") or "runc"
    disabled = ['"io.containerd.tracing.processor.v1.otlp"', '"io.containerd.internal.v1.tracing"']
    if not options.nri:
        disabled.append(f'"{NRI_PLUGIN}"')
    nri = (
        f"""
  [plugins.'{NRI_PLUGIN}']
    disable = false
    socket_path = "/var/run/nri/nri.sock"
    plugin_path = "{root}/nri-plugins"
    plugin_config_path = "{root}/nri-conf.d"
"""
        if options.nri
        else ""
    )
    cri = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
imports = []
disabled_plugins = [{", ".join(disabled)}]

[debug]
  level = "{"debug" if options.debug else "info"}"

[grpc]
  address = "/run/containerd/containerd.sock"

[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "{images.PAUSE}"

  [{cri}]
    enable_cdi = true
    cdi_spec_dirs = {json.dumps(list(options.cdi_spec_dirs))}
    restrict_oom_score_adj = true
    disable_apparmor = true
    [{cri}.containerd]
      default_runtime_name = "runc"
      [{cri}.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        runtime_path = "{binaries.shim}"
        [{cri}.containerd.runtimes.runc.options]
          SystemdCgroup = false
          BinaryName = "{runc}"
    [{cri}.cni]
      bin_dirs = ["{root}/cni-bin"]
      conf_dir = "{root}/cni"

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
{nri}{options.extra_toml}"""


def standin_env_name(uuid: str) -> str:
    """The variable the stand-in spec's device `uuid` sets in a container (to the UUID)."""
    return STANDIN_ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", uuid).upper()


@dataclass(frozen=True)
class CdiEdits:
    """More container edits for every device of a stand-in spec (CDI's containerEdits)."""

    env: Mapping[str, str] = field(default_factory=dict)
    hooks: Sequence[Mapping[str, Any]] = ()  # {"hookName": "createRuntime", "path": ..., ...}


def standin_nvidia_spec(state: FakeState, edits: CdiEdits | None = None) -> dict[str, Any]:
    """The stand-in `nvidia.com/gpu` CDI spec for the GPUs and MIG devices of `state`."""
    uuids = [u for gpu in state.gpus for u in (gpu.uuid, *(d.uuid for d in gpu.mig_devices))]
    devices = []
    for uuid in uuids:
        container_edits: dict[str, Any] = {
            "env": [f"{standin_env_name(uuid)}={uuid}"]
            + [f"{k}={v}" for k, v in (edits.env.items() if edits else ())]
        }
        if edits is not None and edits.hooks:
            container_edits["hooks"] = [dict(h) for h in edits.hooks]
        devices.append({"name": uuid, "containerEdits": container_edits})
    return {"cdiVersion": CDI_VERSION, "kind": NVIDIA_KIND, "devices": devices}


def write_cdi_spec(directory: Path, name: str, spec: Mapping[str, Any]) -> Path:
    """Write `spec` as `directory/name` in one rename (containerd watches the directory and
    must never read half a file); unchanged content is left alone."""
    path = directory / name
    data = json.dumps(spec, indent=2, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == data:
        return path
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(data)
    tmp.replace(path)
    return path
