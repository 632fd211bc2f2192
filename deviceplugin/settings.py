"""What the daemon runs with, resolved once at the edge (flags, environment, config file)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin.config import Config, DeviceIdStrategy
from deviceplugin.dra.settings import DraSettings
from deviceplugin.enforcement_mode import as_run
from deviceplugin.errors import StartupError
from deviceplugin.kubelet.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.memlimits.settings import MemoryLimitSettings
from deviceplugin.usage.httpserver import TlsFiles

__all__ = ["DaemonSettings", "MemoryLimitSettings", "check_trust"]

if TYPE_CHECKING:
    from deviceplugin.nodeconfig import NodeConfig


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Everything `serve` needs, resolved once at the edge (flags, environment, config file)."""

    config: Config = field(default_factory=Config)
    backend: str = "nvml"
    device_plugin_dir: Path = Path(DEFAULT_DEVICE_PLUGIN_DIR)
    pod_resources_socket: Path = Path(DEFAULT_POD_RESOURCES_SOCKET)
    metrics_address: str = ":9410"
    # /healthz alone, for the kubelet's probes, on a listener of its own; "": none.
    probe_address: str = ""
    # HTTPS for the metrics endpoint; None: plain HTTP.
    metrics_tls: TlsFiles | None = None
    state_dir: Path = Path("/var/lib/vgpu")
    node_name: str = ""
    # The file `config` was read from, watched for changes and read again on SIGHUP; None for
    # the built-in defaults (nothing to reload).
    config_path: Path | None = None
    # The node feature discovery features directory: the only place node labels are written;
    # None: nowhere.
    node_features_dir: Path | None = None
    config_hash: str = ""
    # Let a process outside every pod cgroup keep its claimed allocation: only for workloads
    # that are not in pods (the demo, tests); `serve` refuses it outside a fake backend.
    trust_host_processes: bool = False
    # Per-node configs: the config file is one of a directory's, chosen by a label of the node
    # (config_path is the one chosen at start; None with the `empty` choice).
    node_config: NodeConfig | None = None
    # Node labels where the config names no nodeLabels.file: the feature file of this name in
    # node_features_dir (given at start, whatever the config's format).
    node_features_file: str = ""
    # Where the kubelet puts pod containers (docs/design.md §12): "auto" and "" read them from
    # this daemon's own pod container (either driver at / outside a pod).
    kubelet_cgroup_driver: str = "auto"
    kubelet_cgroup_root: str = ""
    # `--kubelet-api dra`: served as a DRA driver (deviceplugin.dra) instead of device plugins.
    dra: DraSettings | None = None
    # --device-id-strategy: wins over every config file's deviceIDStrategy, as NVIDIA's flag
    # (DEVICE_ID_STRATEGY) wins over its config file; None: the file's.
    device_id_strategy: DeviceIdStrategy | None = None
    # --enforce-nvidia-config: an NVIDIA-format config is enforced; else it runs in monitor
    # mode, a dry run (deviceplugin/enforcement_mode.py).
    enforce_nvidia_config: bool = False
    # GPU memory limits through the driver (docs/design.md §15); None: every GPU is polled.
    memory_limits: MemoryLimitSettings | None = None
    # The unified (v2) cgroup hierarchy as this daemon sees it, and the cgroup under which the
    # nvml backend may probe each GPU's memory partitions ("": no probe, every GPU polled).
    cgroup_mount: Path = Path("/sys/fs/cgroup")
    memory_limit_probe_root: str = ""

    def configured(self, config: Config) -> Config:
        """`config` with the flags that win over the config file applied, and in monitor mode
        where it is NVIDIA's format and enforcement is not turned on."""
        config = as_run(config, self.enforce_nvidia_config)
        if self.device_id_strategy is None:
            return config
        allocation = replace(config.allocation, device_id_strategy=self.device_id_strategy)
        return replace(config, allocation=allocation)


def check_trust(settings: DaemonSettings) -> None:
    """Refuse to trust host processes' claims on real GPUs: any process on the node could then
    charge its use to a pod and have that pod's processes killed. Raises StartupError."""
    if settings.trust_host_processes and not settings.backend.startswith("fake:"):
        raise StartupError(
            "--trust-host-processes lets any process outside the pods charge its GPU use to a "
            "pod (and get that pod's processes killed); it is only for the demo and tests and "
            f"needs --backend fake:PATH, not {settings.backend!r}: drop the flag "
            "(and VGPU_TRUST_HOST_PROCESSES)"
        )
