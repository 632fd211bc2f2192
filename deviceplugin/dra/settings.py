"""What the DRA driver is started with, and the request policies it publishes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deviceplugin.config import Config, DeviceIdStrategy, DraConfig

DEFAULT_DRIVER_NAME = "vgpu.dev"
DEFAULT_KUBELET_ROOT_DIR = "/var/lib/kubelet"
DEFAULT_CDI_DIR = "/var/run/cdi"
# Seconds each API server request (but the slice watch) may take: a claim the API server does
# not answer fails that claim's prepare after this long, naming the server.
DEFAULT_API_TIMEOUT_S = 10.0
# The kubelet plugin registry watches this directory for registration sockets.
PLUGINS_REGISTRY = "plugins_registry"
PLUGINS = "plugins"
# The plugin service versions this driver serves, as the kubelet names them.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"

MIB = 1024**2


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
class RequestPolicy:
    """What a claim may ask of one device's capacities (KEP-5075 request policies).

    Memory: at least `memory_min_bytes`, in steps of `memory_step_bytes` (the scheduler rounds a
    request up to the next step); a claim naming no memory gets one device-plugin slice's memory
    of that device. Compute: percent of the device, at least `compute_min`, in steps of
    `compute_step`; a claim naming no compute gets one slice's share (100 / replicas). The
    scheduler records what it granted in the claim's `consumedCapacity`, and the enforcer holds
    the claim to exactly that, so the two never disagree."""

    memory_min_bytes: int = 256 * MIB
    memory_step_bytes: int = 256 * MIB
    compute_min: int = 1
    compute_step: int = 1
    # None: one slice's worth of the device.
    memory_default_bytes: int | None = None
    compute_default: int | None = None

    @classmethod
    def of(cls, cfg: DraConfig) -> RequestPolicy:
        """The config's `dra` section's policies."""
        return cls(
            memory_min_bytes=cfg.memory_min_bytes,
            memory_step_bytes=cfg.memory_step_bytes,
            compute_min=cfg.compute_min,
            compute_step=cfg.compute_step,
            memory_default_bytes=cfg.memory_default_bytes,
            compute_default=cfg.compute_default,
        )


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

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_root_dir / PLUGINS_REGISTRY / f"{self.driver_name}-reg.sock"

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_root_dir / PLUGINS / self.driver_name

    @property
    def service_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"
