"""The versioned config file (docs/design.md §7): what a parsed config is, and how a file becomes
one. Every error names the key path and the bad value.

The package, by concern:

- `model` (with its sections `dra` and `health`): the frozen dataclasses of a parsed config,
  each key of vgpu's format declared once on the field holding its value: name, default, kind
  of value, description.
- `keys`: what such a declaration is, and `keys_of`, which walks them as the file nests.
- `values`: the enums of the choices, the bounds, and the patterns of checked strings.
- `reader`: the typed reader that collects problems with their key paths, and the parsing and
  formatting of durations, sizes and resource names.
- `vgpu`: vgpu's own format (`version: v1`).
- `nvidia` and `nvidia_flags`: NVIDIA k8s-device-plugin's format, and the warnings for its
  settings that vgpu accepts but does not act on.
- `load`: parse_config, which tells the two formats apart, and reading a file with the YAML
  safety checks (no duplicate keys, no unbounded nesting).
- `defaults`: a config as commented YAML (the full defaults), written from the declarations.
- `schema`: the JSON Schema of the file, written from the declarations, checked against the
  parser by the tests.

The rest of the code imports the public names from here.
"""

from deviceplugin.config.defaults import default_config_yaml
from deviceplugin.config.dra import (
    DraConfig,
)
from deviceplugin.config.health import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_IGNORED_XIDS,
    DEFAULT_RECOVERY_DELAY_S,
    HealthConfig,
)
from deviceplugin.config.load import (
    HAS_LIBYAML,
    config_from_bytes,
    is_empty_document,
    is_nvidia_config,
    load_config,
    parse_config,
)
from deviceplugin.config.memory import MemoryLimitsConfig, ResourceMemoryLimit
from deviceplugin.config.model import (
    DEFAULT_CONTEXT_RESERVE_BYTES,
    DEFAULT_MPS_CONTROL_COMMAND,
    DEFAULT_MPS_ROOT,
    DEFAULT_REPLICAS,
    DEFAULT_RESOURCE_NAME,
    MIG_RESOURCE_PREFIX,
    NFD_FEATURE_FILE,
    NFD_FEATURE_NAME,
    NFD_FEATURES_DIR,
    AllocationConfig,
    ComputeEnforcement,
    Config,
    EnforcementConfig,
    GpuMatch,
    MemoryEnforcement,
    MigConfig,
    MpsConfig,
    NodeLabelsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.config.reader import format_duration, format_size, parse_duration, parse_size
from deviceplugin.config.values import (
    MAX_DURATION_S,
    MAX_POLL_INTERVAL_S,
    MAX_REPLICAS,
    MIN_COMPUTE_PERIOD_S,
    MIN_HANG_TIMEOUT_S,
    MIN_MEMORY_PER_SLICE_BYTES,
    MIN_POLL_INTERVAL_S,
    AllocationPolicy,
    ComputeAction,
    ConfigFormat,
    DeviceIdStrategy,
    DeviceListStrategy,
    MemoryAction,
    MigStrategy,
    MpsProtocol,
    RecoveryPolicy,
)

__all__ = [
    "DEFAULT_CONTEXT_RESERVE_BYTES",
    "DEFAULT_HANG_TIMEOUT_S",
    "DEFAULT_IGNORED_XIDS",
    "DEFAULT_MPS_CONTROL_COMMAND",
    "DEFAULT_MPS_ROOT",
    "DEFAULT_RECOVERY_DELAY_S",
    "DEFAULT_REPLICAS",
    "DEFAULT_RESOURCE_NAME",
    "HAS_LIBYAML",
    "MAX_DURATION_S",
    "MAX_POLL_INTERVAL_S",
    "MAX_REPLICAS",
    "MIG_RESOURCE_PREFIX",
    "MIN_COMPUTE_PERIOD_S",
    "MIN_HANG_TIMEOUT_S",
    "MIN_MEMORY_PER_SLICE_BYTES",
    "MIN_POLL_INTERVAL_S",
    "NFD_FEATURES_DIR",
    "NFD_FEATURE_FILE",
    "NFD_FEATURE_NAME",
    "AllocationConfig",
    "AllocationPolicy",
    "ComputeAction",
    "ComputeEnforcement",
    "Config",
    "ConfigFormat",
    "DeviceIdStrategy",
    "DeviceListStrategy",
    "DraConfig",
    "EnforcementConfig",
    "GpuMatch",
    "HealthConfig",
    "MemoryAction",
    "MemoryEnforcement",
    "MemoryLimitsConfig",
    "MigConfig",
    "MigStrategy",
    "MpsConfig",
    "MpsProtocol",
    "NodeLabelsConfig",
    "RecoveryPolicy",
    "ResourceMemoryLimit",
    "SliceOverride",
    "SliceRule",
    "SlicingConfig",
    "config_from_bytes",
    "default_config_yaml",
    "format_duration",
    "format_size",
    "is_empty_document",
    "is_nvidia_config",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_size",
]
