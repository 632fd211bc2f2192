"""What a parsed config is: the frozen dataclasses and enums of every section, their defaults,
and the bounds the parser holds values to. `reader`, `vgpu` and `nvidia` build these from a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

DEFAULT_RESOURCE_NAME = "nvidia.com/vgpu"
DEFAULT_REPLICAS = 4
# What a CUDA context and the libraries' workspaces take outside a framework's memory pool.
DEFAULT_CONTEXT_RESERVE_BYTES = 512 * 1024**2
DEFAULT_MPS_ROOT = "/run/vgpu/mps"
DEFAULT_MPS_CONTROL_COMMAND = "nvidia-cuda-mps-control"


class AllocationPolicy(StrEnum):
    PACK = "pack"
    SPREAD = "spread"


class DeviceListStrategy(StrEnum):
    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"
    DEVICE_SPECS = "device-specs"


class DeviceIdStrategy(StrEnum):
    """How a container's GPUs are named to the container runtime (NVIDIA's deviceIDStrategy):
    by UUID, or by NVML index (`<GPU index>:<MIG index>` for a MIG device)."""

    UUID = "uuid"
    INDEX = "index"


class MemoryAction(StrEnum):
    KILL = "kill"
    MONITOR = "monitor"


class ComputeAction(StrEnum):
    THROTTLE = "throttle"
    MONITOR = "monitor"


@dataclass(frozen=True, slots=True)
class GpuMatch:
    """Selects GPUs for an override. Every field given must match; `model` is a glob on the name.

    `profile` (a glob on the MIG profile, e.g. "1g.10gb") selects MIG devices: an override with a
    profile applies to MIG devices only, and one without applies to full GPUs only."""

    model: str | None = None
    index: int | None = None
    uuid: str | None = None
    profile: str | None = None


@dataclass(frozen=True, slots=True)
class SliceRule:
    """Exactly one of replicas and memory_per_slice_bytes is set."""

    replicas: int | None = None
    memory_per_slice_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class SliceOverride:
    match: GpuMatch
    rule: SliceRule


@dataclass(frozen=True, slots=True)
class SlicingConfig:
    default: SliceRule = field(default_factory=lambda: SliceRule(replicas=DEFAULT_REPLICAS))
    # The first override that matches a GPU wins.
    overrides: tuple[SliceOverride, ...] = ()


class MigStrategy(StrEnum):
    """How GPUs in MIG mode are advertised (NVIDIA's migStrategy, with the same meaning).

    - `none`: they are left out, with a log line.
    - `single`: every MIG device is sliced like a GPU under the one resource name; all MIG devices
      of the node must share one profile, else the MIG GPUs are left out.
    - `mixed`: one resource per MIG profile, `nvidia.com/mig-<profile>`; full GPUs keep the
      resource name."""

    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


@dataclass(frozen=True, slots=True)
class MigConfig:
    strategy: MigStrategy = MigStrategy.NONE
    # mixed: (profile, resource name) for profiles not advertised as nvidia.com/mig-<profile>
    # (NVIDIA's rename and renameByDefault).
    renames: tuple[tuple[str, str], ...] = ()

    def resource_for(self, profile: str) -> str:
        """The resource name of a MIG profile under the mixed strategy."""
        for renamed_profile, name in self.renames:
            if renamed_profile == profile:
                return name
        return MIG_RESOURCE_PREFIX + profile


@dataclass(frozen=True, slots=True)
class AllocationConfig:
    policy: AllocationPolicy = AllocationPolicy.PACK
    device_list_strategy: tuple[DeviceListStrategy, ...] = (DeviceListStrategy.ENVVAR,)
    # What NVIDIA_VISIBLE_DEVICES, the volume mounts and the CDI names call a GPU.
    device_id_strategy: DeviceIdStrategy = DeviceIdStrategy.UUID
    # Tell frameworks that grab GPU memory up front their share (XLA_PYTHON_CLIENT_MEM_FRACTION,
    # TF_FORCE_GPU_ALLOW_GROWTH, VGPU_MEMORY_FRACTION_<i>), less the context reserve.
    framework_hints: bool = True
    context_reserve_bytes: int = DEFAULT_CONTEXT_RESERVE_BYTES
    # Refuse a container that asks for more than one slice of a resource: what NVIDIA's plugin
    # does with sharing.mps unless failRequestsGreaterThanOne is false (NVIDIA files only).
    fail_requests_greater_than_one: bool = False


@dataclass(frozen=True, slots=True)
class MemoryEnforcement:
    action: MemoryAction = MemoryAction.KILL
    grace_period_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ComputeEnforcement:
    action: ComputeAction = ComputeAction.THROTTLE
    window_s: float = 5.0
    period_s: float = 0.25
    work_conserving: bool = True


@dataclass(frozen=True, slots=True)
class EnforcementConfig:
    poll_interval_s: float = 0.5
    # How often while no slice is allocated and no GPU process runs: nothing to enforce then.
    # Never faster than poll_interval_s (a smaller value means: always poll_interval_s).
    idle_poll_interval_s: float = 5.0
    memory: MemoryEnforcement = field(default_factory=MemoryEnforcement)
    compute: ComputeEnforcement = field(default_factory=ComputeEnforcement)
    # Decide, log and count every action, but send no signal.
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """CUDA MPS: when enabled, the daemon runs and supervises the node's MPS control daemon
    (`control_command -d`), with its pipe and log directories under `root`, and hands containers
    the pipe directory and their limits."""

    enabled: bool = False
    root: str = DEFAULT_MPS_ROOT
    control_command: str = DEFAULT_MPS_CONTROL_COMMAND


# Where node feature discovery's local source reads feature files (the DaemonSet gives the daemon
# this directory, --node-features-dir), and the feature file's name in the DaemonSet's config.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
NFD_FEATURE_NAME = "vgpu"
NFD_FEATURE_FILE = f"{NFD_FEATURES_DIR}/{NFD_FEATURE_NAME}"


DEFAULT_DRA_DRIVER_NAME = "vgpu.dev"
DEFAULT_DRA_MEMORY_MIN_BYTES = 256 * 1024**2
DEFAULT_DRA_MEMORY_STEP_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class DraConfig:
    """`dra`: the DRA driver's name and its request policies (docs/dra.md): what a claim may ask
    of one device's `memory` and `compute` (100 = the whole device). A default of None gives a
    claim that names no amount one slice's worth of the device (its memory / replicas, 100 /
    replicas), as `nvidia.com/vgpu: 1` gets."""

    driver_name: str = DEFAULT_DRA_DRIVER_NAME
    memory_min_bytes: int = DEFAULT_DRA_MEMORY_MIN_BYTES
    memory_step_bytes: int = DEFAULT_DRA_MEMORY_STEP_BYTES
    memory_default_bytes: int | None = None
    compute_min: int = 1
    compute_step: int = 1
    compute_default: int | None = None


@dataclass(frozen=True, slots=True)
class NodeLabelsConfig:
    """`nodeLabels.file`: the name of the feature file the daemon keeps for node feature
    discovery, which turns its lines into node labels; "" keeps none. The file is written only
    in the directory the daemon was started with (--node-features-dir), never elsewhere.

    `legacy_directory`: the directory that an old `nodeLabels.path` named; the daemon writes
    the file only when it is that same directory."""

    file: str = ""
    legacy_directory: str = ""


# Xids that an application causes (its own bad kernel, page fault, or a context it lost), not the
# GPU: they leave the GPU in service. NVIDIA k8s-device-plugin ignores the same ones.
DEFAULT_IGNORED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
DEFAULT_RECOVERY_DELAY_S = 60.0
DEFAULT_HANG_TIMEOUT_S = 10.0


class RecoveryPolicy(StrEnum):
    """What happens to a GPU that was marked unhealthy and then answers again.

    A GPU is marked unhealthy by a critical Xid or double-bit ECC event, by an NVML call on it that
    fails with GPU_IS_LOST or an unexpected error, or by an NVML call on it that has not returned
    for `hangTimeout`. Its slices are then reported Unhealthy to the kubelet, which admits no new
    pod onto them; pods already running keep them.

    - `manual` (the default): the GPU stays unhealthy until the daemon restarts, whatever it
      answers afterwards. An operator checks the GPU (nvidia-smi, the Xid in the kernel log, a
      reset or a drain) and then restarts the daemon's pod, which puts the GPU back in service if
      it reads correctly at start-up.
    - `auto`: the GPU is returned to service once it has answered every NVML call of a poll
      correctly and has had no critical Xid, no failed call and no hung call for `recoveryDelay`
      (default 60s). Any new fault restarts that wait. Every return to service is logged and
      counted, like every fall.
    """

    MANUAL = "manual"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """GPU health checking (the `health:` section).

    An Xid is critical, and marks its GPU unhealthy, unless it is ignored: listed in
    `ignored_xids` (default: the application errors 13, 31, 43, 45, 68, 109) or in
    `additional_ignored_xids`, and not listed in `critical_xids`, which wins over both.
    A double-bit ECC event counts as Xid 48. `enabled: false` turns the Xid and ECC event watch
    off; a GPU that NVML reports lost, or whose calls hang for `hang_timeout_s`, is still marked
    unhealthy, since it cannot be measured. See RecoveryPolicy for the way back."""

    enabled: bool = True
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    additional_ignored_xids: tuple[int, ...] = ()
    critical_xids: tuple[int, ...] = ()
    recovery: RecoveryPolicy = RecoveryPolicy.MANUAL
    recovery_delay_s: float = DEFAULT_RECOVERY_DELAY_S
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S

    def is_critical(self, xid: int) -> bool:
        """Whether Xid `xid` takes its GPU out of service (always False when disabled)."""
        if not self.enabled:
            return False
        if xid in self.critical_xids:
            return True
        return xid not in self.ignored_xids and xid not in self.additional_ignored_xids


class ConfigFormat(StrEnum):
    """The format a config file was written in: vgpu's own, or NVIDIA k8s-device-plugin's, which
    is read with the meaning NVIDIA's plugin gives it."""

    VGPU = "vgpu"
    NVIDIA = "nvidia"


@dataclass(frozen=True, slots=True)
class Config:
    version: str = "v1"
    resource_name: str = DEFAULT_RESOURCE_NAME
    slicing: SlicingConfig = field(default_factory=SlicingConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    enforcement: EnforcementConfig = field(default_factory=EnforcementConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    node_labels: NodeLabelsConfig = field(default_factory=NodeLabelsConfig)
    mig: MigConfig = field(default_factory=MigConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    # Non-fatal findings, e.g. NVIDIA keys that parse but that vgpu does not act on.
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # The format the file was written in (check-config says what vgpu adds to NVIDIA's meaning).
    format: ConfigFormat = field(default=ConfigFormat.VGPU, compare=False)


MIN_POLL_INTERVAL_S = 0.05
# Bounds beyond which a value is a mistake, not a choice: more slices per GPU than any workload
# could use (and device lists that approach the kubelet's message limit), slices too small to
# hold a CUDA context, polls too far apart to enforce anything, and durations past an hour.
MAX_REPLICAS = 1024
MIN_MEMORY_PER_SLICE_BYTES = 64 << 20
MAX_POLL_INTERVAL_S = 60.0
MAX_DURATION_S = 3600.0
MIN_COMPUTE_PERIOD_S = 0.02
MIN_HANG_TIMEOUT_S = 0.1
