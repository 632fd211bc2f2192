"""What the DRA driver is started with, and the request policies it publishes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deviceplugin.config import Config, DeviceIdStrategy

DEFAULT_DRIVER_NAME = "vgpu.dev"
DEFAULT_KUBELET_ROOT_DIR = "/var/lib/kubelet"
DEFAULT_CDI_DIR = "/var/run/cdi"
# Seconds each API server request (but the slice watch) may take: a claim the API server does
# not answer fails that claim's prepare after this long, naming the server.
DEFAULT_API_TIMEOUT_S = 10.0
# How often the prepared claims are read from the API server (one GET each): one it no longer has
# is unprepared.
DEFAULT_RECONCILE_S = 300.0
# The kubelet plugin registry watches this directory for registration sockets.
PLUGINS_REGISTRY = "plugins_registry"
PLUGINS = "plugins"


def device_ids_ignored(config: Config) -> str:
    """What the DRA driver says of a config that names GPUs by index; empty when it does not."""
    if config.allocation.device_id_strategy is DeviceIdStrategy.INDEX:
        return (
            "deviceIDStrategy index is ignored: the DRA driver names GPUs by UUID, as NVIDIA's "
            "DRA driver does; it applies to the device plugins only"
        )
    return ""


class GpuCdi(StrEnum):
    """How a prepared claim's container gets the GPU itself (docs/dra.md, "The GPU itself").

    `nvidia`: NVIDIA's CDI device `nvidia.com/gpu=<uuid>` (the spec that NVIDIA's container
    toolkit generates with `nvidia-ctk cdi generate --device-name-strategy=uuid`), beside vgpu's
    own claim device; `device-nodes`: vgpu's own spec carries the device nodes (/dev/nvidiactl,
    /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia<minor>), and the driver's libraries come
    from the NVIDIA runtime hook or the image."""

    NVIDIA = "nvidia"
    DEVICE_NODES = "device-nodes"


@dataclass(frozen=True, slots=True)
class DraSettings:
    """`serve --kubelet-api dra`: where the kubelet, the API server and the CDI specs are."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    kubelet_root_dir: Path = Path(DEFAULT_KUBELET_ROOT_DIR)
    cdi_dir: Path = Path(DEFAULT_CDI_DIR)
    # None: the pod's service account (in-cluster config).
    kubeconfig: Path | None = None
    gpu_cdi: GpuCdi = GpuCdi.NVIDIA
    api_timeout_s: float = DEFAULT_API_TIMEOUT_S
    reconcile_every_s: float = DEFAULT_RECONCILE_S

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_root_dir / PLUGINS_REGISTRY / f"{self.driver_name}-reg.sock"

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_root_dir / PLUGINS / self.driver_name

    @property
    def service_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"
