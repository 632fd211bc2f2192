"""What a parsed config is: the frozen dataclasses of every section, with each key of vgpu's
format declared once on the field that holds its value (`keys`): its name, default, kind of value
with unit and bounds (`values`), and description. `vgpu` and `nvidia` build these from a file;
`schema`, `defaults` and the docs' key table are written from the declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deviceplugin.config.dra import DraConfig
from deviceplugin.config.health import HealthConfig
from deviceplugin.config.keys import (
    Boolean,
    Choice,
    Const,
    Duration,
    Integer,
    Items,
    OneOrMore,
    Section,
    Size,
    Text,
    inline,
    key,
    required,
    section,
)
from deviceplugin.config.memory import MemoryLimitsConfig
from deviceplugin.config.values import (
    FEATURE_FILE_PATTERN,
    MAX_POLL_INTERVAL_S,
    MAX_REPLICAS,
    MIN_COMPUTE_PERIOD_S,
    MIN_MEMORY_PER_SLICE_BYTES,
    MIN_POLL_INTERVAL_S,
    MPS_ROOT_PATTERN,
    NOT_NORMALISED_PATTERN,
    RESOURCE_NAME_PATTERN,
    AllocationPolicy,
    ComputeAction,
    ConfigFormat,
    DeviceIdStrategy,
    DeviceListStrategy,
    MemoryAction,
    MigStrategy,
    MpsProtocol,
)

DEFAULT_RESOURCE_NAME = "nvidia.com/vgpu"
DEFAULT_REPLICAS = 4
# What a CUDA context and the libraries' workspaces take outside a framework's memory pool.
DEFAULT_CONTEXT_RESERVE_BYTES = 512 * 1024**2
DEFAULT_MPS_ROOT = "/run/vgpu/mps"
DEFAULT_MPS_CONTROL_COMMAND = "nvidia-cuda-mps-control"
# Below this much free memory a GPU is under memory pressure (enforcement.memory).
DEFAULT_PRESSURE_FREE_BELOW_BYTES = 1024**3


@dataclass(frozen=True, slots=True)
class GpuMatch:
    """Selects GPUs for an override. Every field given must match; `model` is a glob on the name.

    `profile` (a glob on the MIG profile, e.g. "1g.10gb") selects MIG devices: an override with a
    profile applies to MIG devices only, and one without applies to full GPUs only."""

    model: str | None = key(
        "model", None, Text(min_length=1), "A glob on the GPU's name, e.g. *A100*."
    )
    index: int | None = key("index", None, Integer(0), "The GPU's index.")
    uuid: str | None = key("uuid", None, Text(min_length=1), "The GPU's UUID.")
    profile: str | None = key(
        "profile",
        None,
        Text(min_length=1),
        "A glob on a MIG device's profile, e.g. 1g.10gb; an override with a profile applies to"
        " MIG devices only, one without to full GPUs only.",
    )


@dataclass(frozen=True, slots=True)
class SliceRule:
    """Exactly one of replicas and memory_per_slice_bytes is set."""

    replicas: int | None = key(
        "replicas",
        None,
        Integer(1, MAX_REPLICAS),
        "Slices per GPU: each gets 1/replicas of the GPU's memory and compute, and a container"
        " holding k slices of a GPU gets k times that.",
    )
    memory_per_slice_bytes: int | None = key(
        "memoryPerSlice",
        None,
        Size(MIN_MEMORY_PER_SLICE_BYTES),
        "The memory of one slice, instead of replicas: replicas = the GPU's memory /"
        " memoryPerSlice.",
        example="10Gi",
    )


@dataclass(frozen=True, slots=True)
class SliceOverride:
    match: GpuMatch = required(
        "match",
        Section(GpuMatch),
        "Which GPUs the override applies to; every key given must match.",
    )
    rule: SliceRule = inline(SliceRule)


@dataclass(frozen=True, slots=True)
class SlicingConfig:
    default: SliceRule = inline(SliceRule, lambda: SliceRule(replicas=DEFAULT_REPLICAS))
    # The first override that matches a GPU wins.
    overrides: tuple[SliceOverride, ...] = key(
        "overrides",
        (),
        Items(SliceOverride),
        "Per-GPU exceptions, matched by model (a glob on the GPU's name), index, uuid or MIG"
        " profile, each with its replicas or memoryPerSlice; the first that matches a GPU wins.",
        example='[{match: {model: "*A100*"}, replicas: 8},'
        " {match: {index: 1}, memoryPerSlice: 20Gi}]",
    )


MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


@dataclass(frozen=True, slots=True)
class MigConfig:
    strategy: MigStrategy = key(
        "strategy",
        MigStrategy.NONE,
        Choice(MigStrategy),
        "none: GPUs in MIG mode are left out. single: every MIG device is sliced like a GPU and"
        " advertised under resourceName (all MIG devices of the node must share one profile)."
        " mixed: each profile is its own resource, nvidia.com/mig-<profile> (e.g."
        " nvidia.com/mig-1g.10gb), as with NVIDIA's plugin. A MIG device is one slice unless a"
        ' slicing override matches its profile, e.g. {match: {profile: "1g.10gb"}, replicas: 2}.'
        " Memory limits are enforced per MIG device; NVML measures no utilisation per MIG"
        " device, so compute shares are not enforced on them.",
    )
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
    policy: AllocationPolicy = key(
        "policy",
        AllocationPolicy.PACK,
        Choice(
            AllocationPolicy,
            {"packed": "pack", "distributed": "spread"},
            "NVIDIA's packed, distributed are accepted too",
        ),
        "pack: put a container's slices on the GPU that already has the most used slices;"
        " spread: on the least used GPU.",
    )
    device_list_strategy: tuple[DeviceListStrategy, ...] = key(
        "deviceListStrategy",
        (DeviceListStrategy.ENVVAR,),
        OneOrMore(DeviceListStrategy),
        "How a container gets its GPUs: one strategy or a list of them.",
    )
    # What NVIDIA_VISIBLE_DEVICES, the volume mounts and the CDI names call a GPU.
    device_id_strategy: DeviceIdStrategy = key(
        "deviceIDStrategy",
        DeviceIdStrategy.UUID,
        Choice(DeviceIdStrategy),
        "What the container runtime is told a GPU is called: uuid (GPU-..., MIG-...) or index"
        " (NVML's index: 0, 1, and <GPU index>:<MIG index> for a MIG device), as NVIDIA's"
        " deviceIDStrategy.",
    )
    framework_hints: bool = key(
        "frameworkHints",
        True,
        Boolean(),
        "Tell frameworks that reserve GPU memory up front their share, so that they fit their"
        " slices: XLA_PYTHON_CLIENT_MEM_FRACTION (JAX), TF_FORCE_GPU_ALLOW_GROWTH (TensorFlow)"
        " and VGPU_MEMORY_FRACTION_<i> per GPU (PyTorch, vLLM: set in code or on the command"
        " line).",
    )
    context_reserve_bytes: int = key(
        "contextReserve",
        DEFAULT_CONTEXT_RESERVE_BYTES,
        Size(zero=True),
        "Left out of those fractions for the CUDA context and the libraries outside the"
        " framework's pool; 0 for none.",
    )
    # Refuse a container that asks for more than one slice of a resource: what NVIDIA's plugin
    # does with sharing.mps unless failRequestsGreaterThanOne is false (NVIDIA files only).
    fail_requests_greater_than_one: bool = False


@dataclass(frozen=True, slots=True)
class MemoryEnforcement:
    action: MemoryAction = key(
        "action",
        MemoryAction.KILL,
        Choice(MemoryAction),
        "kill: SIGKILL the largest GPU process of a container that stays above its memory limit"
        " for longer than gracePeriod; monitor: only record the violation.",
    )
    grace_period_s: float = key(
        "gracePeriod", 2.0, Duration(), "How long a container may stay above its memory limit."
    )
    pressure_free_below_bytes: int = key(
        "pressureFreeBelow",
        DEFAULT_PRESSURE_FREE_BELOW_BYTES,
        Size(zero=True),
        "A GPU whose free memory is below this, or too little for its containers below their"
        " request to reach it, is under memory pressure: the container furthest above its"
        " request (one whose limit is above its request) loses its largest process, as action"
        " says; never one within its request. 0: only the second rule.",
    )


@dataclass(frozen=True, slots=True)
class ComputeEnforcement:
    action: ComputeAction = key(
        "action",
        ComputeAction.THROTTLE,
        Choice(ComputeAction),
        "throttle: pause and resume (SIGSTOP/SIGCONT) the GPU processes of a container that uses"
        " more than its compute share while others wait; monitor: only record the violation.",
    )
    window_s: float = key(
        "window",
        5.0,
        Duration(),
        "Utilisation is averaged over this window; at least one period.",
    )
    period_s: float = key(
        "period", 0.25, Duration(MIN_COMPUTE_PERIOD_S), "The length of one pause/resume cycle."
    )
    work_conserving: bool = key(
        "workConserving",
        True,
        Boolean(),
        "Let containers use GPU time that no other container wants, beyond their share.",
    )


@dataclass(frozen=True, slots=True)
class EnforcementConfig:
    poll_interval_s: float = key(
        "pollInterval",
        0.5,
        Duration(MIN_POLL_INTERVAL_S, MAX_POLL_INTERVAL_S),
        "How often GPU memory, utilisation and health are read.",
    )
    # Never faster than poll_interval_s (a smaller value means: always poll_interval_s).
    idle_poll_interval_s: float = key(
        "idlePollInterval",
        5.0,
        Duration(MIN_POLL_INTERVAL_S, MAX_POLL_INTERVAL_S),
        "How often while no slice is allocated and no GPU process runs: nothing is enforced"
        " then, and an Allocate brings back pollInterval at once. Never faster than"
        " pollInterval.",
    )
    dry_run: bool = key(
        "dryRun",
        False,
        Boolean(),
        "Decide, log and count every enforcement action, but send no signal to any process.",
    )
    memory: MemoryEnforcement = section(
        "memory", MemoryEnforcement, "A container above its memory limit."
    )
    compute: ComputeEnforcement = section(
        "compute",
        ComputeEnforcement,
        "A container above its compute share while others want the GPU.",
    )


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """CUDA MPS: when enabled, the daemon runs and supervises the node's MPS control daemon
    (`control_command -d`), with its pipe and log directories under `root`, and hands containers
    the pipe directory and their limits."""

    enabled: bool = key(
        "enabled",
        False,
        Boolean(),
        "Run and supervise the node's CUDA MPS control daemon and share the GPUs through it:"
        " each MPS client process is held to one slice's memory and compute by the GPU itself,"
        " and containers get the pipe directory and their limits. Needs the DaemonSet's MPS"
        " component.",
    )
    root: str = key(
        "root",
        DEFAULT_MPS_ROOT,
        Text(
            "an absolute, normalised path without commas or colons",
            pattern=MPS_ROOT_PATTERN,
            not_pattern=NOT_NORMALISED_PATTERN,
        ),
        "Where the MPS pipe (<root>/pipe, mounted into containers at the same path), log"
        " (<root>/log) and shared memory (<root>/shm) directories are.",
    )
    control_command: str = key(
        "controlCommand",
        DEFAULT_MPS_CONTROL_COMMAND,
        Text(min_length=1, not_pattern=r"^\s*$"),
        "The MPS control program, run with -f as the daemon's child and sent commands on stdin.",
    )
    protocol: MpsProtocol = key(
        "protocol",
        MpsProtocol.AUTO,
        Choice(MpsProtocol),
        "The MPS protocol: auto runs MPS v3 (a namespace per container, capped at its share and"
        " memory) where the driver (R615 and later) and the control command offer it, else v2"
        " (one slice's limits per client process); v2 always v2; v3 v3, or the start fails.",
    )
    canary_command: str | None = key(
        "canaryCommand",
        None,
        Text("a command line", min_length=1),
        "Under MPS v3, the canary run through each MPS server after a client left without a"
        " drain and every 5 minutes, to tell a wedged GPU from a healthy one: a CUDA client that"
        " must exit within 15 s (one that hangs is a wedge: MPS is restarted). Unset: the"
        " built-in one, a CUDA context made through libcuda.",
        example="/usr/local/bin/cuda-canary --device 0",
    )


# Where node feature discovery's local source reads feature files (the DaemonSet gives the daemon
# this directory, --node-features-dir), and the feature file's name in the DaemonSet's config.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
NFD_FEATURE_NAME = "vgpu"
NFD_FEATURE_FILE = f"{NFD_FEATURES_DIR}/{NFD_FEATURE_NAME}"


@dataclass(frozen=True, slots=True)
class NodeLabelsConfig:
    """`nodeLabels.file`: the name of the feature file the daemon keeps for node feature
    discovery, which turns its lines into node labels; "" keeps none. The file is written only
    in the directory the daemon was started with (--node-features-dir), never elsewhere.

    `legacy_directory`: the directory that an old `nodeLabels.path` named; the daemon writes
    the file only when it is that same directory."""

    file: str = key(
        "file",
        "",
        Text("a file name, no path", pattern=FEATURE_FILE_PATTERN, max_length=200),
        "Keep a node feature discovery feature file of this name in the directory the daemon"
        " was started with, --node-features-dir: NFD v0.15 or newer turns"
        " its lines into node labels nvidia.com/vgpu.count, .replicas, .memory-per-slice-mib,"
        " .product (these four describe resourceName's slices), .mig-strategy and"
        " .memory-enforcement (driver, poll or mixed: whether the GPUs' drivers enforce memory"
        ' limits). "" keeps none; the DaemonSet mounts NFD\'s features.d directory and names it.',
    )
    legacy_directory: str = key(
        "path",
        "",
        Text("an absolute path", pattern="^(/.*)?$"),
        "The old spelling of file, read as file: <its name> and written only when its"
        " directory is the daemon's --node-features-dir.",
        deprecated=True,
    )


@dataclass(frozen=True, slots=True)
class Config:
    version: str = key("version", "v1", Const("v1"), "The format's version.")
    resource_name: str = key(
        "resourceName",
        DEFAULT_RESOURCE_NAME,
        Text(
            "an extended resource name, <domain>/<name>",
            pattern=RESOURCE_NAME_PATTERN,
            not_pattern=r"kubernetes\.io/|^requests\.",
        ),
        "The extended resource pods request, e.g. resources.limits: {nvidia.com/vgpu: 1}.",
    )
    slicing: SlicingConfig = section("slicing", SlicingConfig, "How each GPU is split into slices.")
    allocation: AllocationConfig = section(
        "allocation", AllocationConfig, "How slices are chosen and handed to a container."
    )
    enforcement: EnforcementConfig = section(
        "enforcement",
        EnforcementConfig,
        "What happens to a container that uses more than its slices.",
    )
    mps: MpsConfig = section(
        "mps",
        MpsConfig,
        "CUDA MPS: one control daemon for the node, run and supervised by the daemon, and its"
        " pipe directory and limits in each container.",
    )
    health: HealthConfig = section(
        "health", HealthConfig, "GPU health from NVML's Xid and ECC events (nvml backend)."
    )
    node_labels: NodeLabelsConfig = section(
        "nodeLabels",
        NodeLabelsConfig,
        "Node labels through a node feature discovery feature file.",
    )
    mig: MigConfig = section("mig", MigConfig, "GPUs in MIG mode.")
    memory_limits: MemoryLimitsConfig = section(
        "memoryLimits",
        MemoryLimitsConfig,
        "Memory limits above the request (burst) per resource; the limits the GPU's driver"
        " enforces (docs/design.md §15).",
    )
    dra: DraConfig = section(
        "dra",
        DraConfig,
        "DRA mode only (serve --kubelet-api dra; docs/dra.md): the driver's name and what a"
        " claim may ask of one device's capacities. The scheduler rounds a request up to min +"
        " a multiple of step.",
    )
    # Non-fatal findings, e.g. NVIDIA keys that parse but that vgpu does not act on.
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # The format the file was written in (check-config says what vgpu adds to NVIDIA's meaning).
    format: ConfigFormat = field(default=ConfigFormat.VGPU, compare=False)
