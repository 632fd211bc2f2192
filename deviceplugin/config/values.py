"""The values config keys take: the options of each choice, as enums, the bounds beyond which a
value is refused, and the patterns that describe checked strings to the JSON Schema.
"""

from __future__ import annotations

from enum import StrEnum

MAX_DURATION_S = 3600.0
MIN_POLL_INTERVAL_S = 0.05
# Bounds beyond which a value is a mistake, not a choice: more slices per GPU than any workload
# could use (and device lists that approach the kubelet's message limit), slices too small to
# hold a CUDA context, polls too far apart to enforce anything, and durations past an hour
# (MAX_DURATION_S, every duration's bound).
MAX_REPLICAS = 1024
MIN_MEMORY_PER_SLICE_BYTES = 64 << 20
MAX_POLL_INTERVAL_S = 60.0
MIN_COMPUTE_PERIOD_S = 0.02
MIN_HANG_TIMEOUT_S = 0.1

# What the JSON Schema says of strings the parser checks with code. An extended resource name as
# the kubelet checks it: <DNS subdomain>/<qualified name>.
RESOURCE_NAME_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# An absolute path kept as os.path.normpath writes it (no "//", "." or ".." part, no trailing
# "/"), without commas or colons: the MPS root, which containers get at the same path.
MPS_ROOT_PATTERN = r"^/[^,:\n]*$"
NOT_NORMALISED_PATTERN = r"//|/\.\.?(/|$)|./$"
# A DRA driver's name: a DNS subdomain that starts with a letter, at most 63 characters.
DRIVER_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
FEATURE_FILE_PATTERN = "^([A-Za-z0-9_-][A-Za-z0-9_.-]*)?$"


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


class MpsProtocol(StrEnum):
    """Which MPS protocol the node's control daemon runs: `auto` MPS v3 (a namespace per
    container) where the driver and the control command offer it, else v2 (per-slice
    defaults); `v2` always v2; `v3` v3 or no start."""

    AUTO = "auto"
    V2 = "v2"
    V3 = "v3"


class MemoryAction(StrEnum):
    KILL = "kill"
    MONITOR = "monitor"


class ComputeAction(StrEnum):
    THROTTLE = "throttle"
    MONITOR = "monitor"


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


class ConfigFormat(StrEnum):
    """The format a config file was written in: vgpu's own, or NVIDIA k8s-device-plugin's, which
    is read with the meaning NVIDIA's plugin gives it."""

    VGPU = "vgpu"
    NVIDIA = "nvidia"
