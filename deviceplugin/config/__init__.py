"""The versioned config file (docs/design.md §7): types, defaults, loading and
validation, in one place.

Loading is implemented below the types. Every error names the key path and the bad value.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import Any, TypeVar

import yaml

from deviceplugin.errors import ConfigError

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
    # Tell frameworks that grab GPU memory up front their share (XLA_PYTHON_CLIENT_MEM_FRACTION,
    # TF_FORCE_GPU_ALLOW_GROWTH, VGPU_MEMORY_FRACTION_<i>), less the context reserve.
    framework_hints: bool = True
    context_reserve_bytes: int = DEFAULT_CONTEXT_RESERVE_BYTES


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


# Where node feature discovery's local source reads feature files; the DaemonSet's config sets it.
NFD_FEATURE_FILE = "/etc/kubernetes/node-feature-discovery/features.d/vgpu"


@dataclass(frozen=True, slots=True)
class NodeLabelsConfig:
    """`nodeLabels.path`: the feature file the daemon keeps for node feature discovery, which
    turns its lines into node labels; "" keeps none."""

    path: str = ""


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
    # Non-fatal findings, e.g. NVIDIA keys that parse but that vgpu does not act on.
    warnings: tuple[str, ...] = field(default=(), compare=False)


# --- Loading and validation -------------------------------------------------------------------
#
# parse_config() checks the YAML-loaded data against the schema below and collects every problem
# before it raises, so that one run of `check-config` shows everything that is wrong. Each problem
# starts with the key path (`slicing.overrides[1].match`) and shows the bad value.

_DURATION_HINT = "use e.g. 500ms, 2s"
_SIZE_HINT = "use e.g. 10Gi, 512Mi, 1G or a whole number of bytes"

_DURATION_UNITS_S: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # the micro sign, as Go's time.ParseDuration accepts it
    "μs": 1e-6,  # the Greek mu, the same
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_BARE_NUMBER = re.compile(r"[+-]?(\d+(?:\.\d*)?|\.\d+)")

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "k": 1000,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "Ki": 1024,
    "KiB": 1024,
    "Mi": 1024**2,
    "MiB": 1024**2,
    "Gi": 1024**3,
    "GiB": 1024**3,
    "Ti": 1024**4,
    "TiB": 1024**4,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)")

# Extended resource names, as the kubelet's IsExtendedResourceName checks them.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MAX_NAME_LENGTH = 63
_MAX_SUBDOMAIN_LENGTH = 253
_QUOTA_PREFIX = "requests."

_POLICIES: dict[str, AllocationPolicy] = {
    "pack": AllocationPolicy.PACK,
    "spread": AllocationPolicy.SPREAD,
    # NVIDIA k8s-device-plugin's names for the same policies.
    "packed": AllocationPolicy.PACK,
    "distributed": AllocationPolicy.SPREAD,
}
_STRATEGIES: dict[str, DeviceListStrategy] = {s.value: s for s in DeviceListStrategy}
_MEMORY_ACTIONS: dict[str, MemoryAction] = {a.value: a for a in MemoryAction}
_COMPUTE_ACTIONS: dict[str, ComputeAction] = {a.value: a for a in ComputeAction}
_RECOVERY_POLICIES: dict[str, RecoveryPolicy] = {p.value: p for p in RecoveryPolicy}

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

_T = TypeVar("_T")

_TOP_KEYS = (
    "version",
    "resourceName",
    "slicing",
    "allocation",
    "enforcement",
    "mps",
    "health",
    "nodeLabels",
    "mig",
)
_NODE_LABELS_KEYS = ("path",)
_SLICING_KEYS = ("replicas", "memoryPerSlice", "overrides")
_OVERRIDE_KEYS = ("match", "replicas", "memoryPerSlice")
_MATCH_KEYS = ("model", "index", "uuid", "profile")
_MIG_KEYS = ("strategy",)
_ALLOCATION_KEYS = ("policy", "deviceListStrategy", "frameworkHints", "contextReserve")
_ENFORCEMENT_KEYS = ("pollInterval", "dryRun", "memory", "compute")
_MEMORY_KEYS = ("action", "gracePeriod")
_COMPUTE_KEYS = ("action", "window", "period", "workConserving")
_MPS_KEYS = ("enabled", "root", "controlCommand")
_HEALTH_KEYS = (
    "enabled",
    "ignoredXids",
    "additionalIgnoredXids",
    "criticalXids",
    "recovery",
    "recoveryDelay",
    "hangTimeout",
)


def _show(value: object) -> str:
    """A value as the user wrote it in YAML, for messages (a long one shortened)."""
    if isinstance(value, str):
        return _shorten(json.dumps(value, ensure_ascii=False))
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _shorten(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def _kind(value: object) -> str:
    return "a string" if isinstance(value, str) else _show(value)


def parse_duration(value: str | int | float) -> float:
    """Seconds from a duration such as `500ms`, `2s`, `1.5s`, `1m30s` or `250us`.

    Units: ns, us, ms, s, m, h. A bare number is refused (is `2` seconds or milliseconds?), except
    0. A leading sign is accepted, so that range checks can report negative values as such."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
    if not isinstance(value, str):
        if value == 0:
            return 0.0
        raise ValueError(
            f"{_show(value)} has no unit: durations need one (use e.g. {value}s or {value}ms)"
        )
    text = value.strip()
    if _BARE_NUMBER.fullmatch(text):
        if float(text) == 0:
            return 0.0
        raise ValueError(
            f"{_show(value)} has no unit: durations need one (use e.g. {text}s or {text}ms)"
        )
    sign = 1.0
    if text[:1] in ("+", "-"):
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    total = 0.0
    position = 0
    while position < len(text):
        part = _DURATION_PART.match(text, position)
        if part is None:
            break
        total += float(part.group(1)) * _DURATION_UNITS_S[part.group(2)]
        position = part.end()
    if not text or position != len(text):
        raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
    return sign * total


def format_duration(seconds: float) -> str:
    """The shortest way to write `seconds` that parse_duration reads back: 2s, 500ms, 1m, 1.5s."""
    if seconds == 0:
        return "0s"
    micros = round(seconds * 1_000_000)
    if abs(micros - seconds * 1_000_000) > 1e-6 * abs(seconds * 1_000_000):
        return f"{seconds:.9f}".rstrip("0") + "s"
    for unit, size_us in (("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000)):
        if micros % size_us == 0:
            return f"{micros // size_us}{unit}"
    if abs(micros) >= 1_000_000:
        return f"{micros / 1_000_000:.6f}".rstrip("0") + "s"
    if micros % 1000 == 0:
        return f"{micros // 1000}ms"
    return f"{micros}us"


def format_size(size_bytes: int) -> str:
    """The shortest binary-unit way to write a size that parse_size reads back: 512Mi, 10Gi."""
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if size_bytes and size_bytes % size == 0:
            return f"{size_bytes // size}{unit}"
    return str(size_bytes)


def parse_size(value: str | int) -> int:
    """Bytes from a size such as `10Gi`, `512Mi`, `80GiB`, `1G` (decimal) or `1024` (bytes).

    Binary units Ki Mi Gi Ti (KiB ...), decimal units K M G T (k, KB ...). A fraction is accepted
    when the result is a whole number of bytes (`1.5Gi`)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is not a size: sizes cannot be negative")
        return value
    found = _SIZE.fullmatch(value.strip())
    if found is None or found.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
    size = Fraction(found.group(1)) * _SIZE_UNITS[found.group(2)]
    if size.denominator != 1:
        raise ValueError(f"{_show(value)} is not a whole number of bytes ({_SIZE_HINT})")
    return int(size)


def _resource_name_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name the kubelet accepts, or None if it is."""
    expected = "expected <domain>/<name>, e.g. nvidia.com/vgpu"
    domain, slash, short = name.partition("/")
    if not slash:
        return f"{_show(name)} has no domain ({expected})"
    if "kubernetes.io/" in name:
        return f"{_show(name)} is in the kubernetes.io domain, which is reserved for Kubernetes"
    if name.startswith(_QUOTA_PREFIX):
        return f'{_show(name)} starts with "{_QUOTA_PREFIX}", which Kubernetes reserves for quotas'
    if not _DNS_SUBDOMAIN.fullmatch(domain) or len(_QUOTA_PREFIX + domain) > _MAX_SUBDOMAIN_LENGTH:
        return f"{_show(name)}: the domain {_show(domain)} is not a DNS subdomain ({expected})"
    if not _QUALIFIED_NAME.fullmatch(short) or len(short) > _MAX_NAME_LENGTH:
        return (
            f"{_show(name)}: the name {_show(short)} must be at most {_MAX_NAME_LENGTH} letters,"
            " digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Reader:
    """Typed access to YAML-loaded data that records a problem, with its key path, for every
    value that does not fit and returns None for it. parse_config raises once, at the end."""

    def __init__(
        self, *, null_is_absent: bool = False, top_level_hints: Mapping[str, str] | None = None
    ) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []
        # NVIDIA's files (and its "Running with config" dumps) write unset settings as null.
        self._null_is_absent = null_is_absent
        # Extra words for an unknown top-level key, by key.
        self._top_level_hints = top_level_hints or {}

    def error(self, path: str, message: str) -> None:
        self.problems.append(f"{path or 'top level'}: {message}")

    def warn(self, sentence: str) -> None:
        """A finding that does not stop the config from loading; it names its key path."""
        self.warnings.append(sentence)

    def section(self, value: object, path: str, keys: Sequence[str]) -> dict[str, object]:
        """The known keys of a mapping; unknown keys are problems. A missing or null section is
        empty."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping with keys {', '.join(keys)}, got {_kind(value)}")
            return {}
        known: dict[str, object] = {}
        for key, item in value.items():
            if key not in keys:
                hint = "" if path else self._top_level_hints.get(str(key), "")
                self.error(
                    path,
                    f"unknown key {_show(key)} (expected one of: {', '.join(sorted(keys))}){hint}",
                )
            elif not (self._null_is_absent and item is None):
                known[key] = item
        return known

    def integer(
        self, value: object, path: str, minimum: int, maximum: int | None = None
    ) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(path, f"{_show(value)} is not an integer")
            return None
        if value < minimum:
            self.error(path, f"{_show(value)} is too small (must be >= {minimum})")
            return None
        if maximum is not None and value > maximum:
            self.error(path, f"{_show(value)} is too large (must be <= {maximum})")
            return None
        return value

    def boolean(self, value: object, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.error(path, f"{_show(value)} is not a boolean (use true or false)")
            return None
        return value

    def string(self, value: object, path: str) -> str | None:
        if not isinstance(value, str):
            self.error(path, f"{_show(value)} is not a string")
            return None
        if not value:
            self.error(path, "is empty")
            return None
        return value

    def choice(self, value: object, path: str, options: Mapping[str, _T], shown: str) -> _T | None:
        if isinstance(value, str) and value in options:
            return options[value]
        self.error(path, f"{_show(value)} is not one of {shown}")
        return None

    def duration(
        self, value: object, path: str, minimum_s: float, maximum_s: float = MAX_DURATION_S
    ) -> float | None:
        try:
            if not isinstance(value, str | int | float):
                raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
            seconds = parse_duration(value)
        except (ValueError, OverflowError) as e:
            self.error(path, str(e))
            return None
        if not seconds <= maximum_s:  # also NaN
            self.error(
                path, f"{_show(value)} is too long (must be <= {format_duration(maximum_s)})"
            )
            return None
        if seconds < minimum_s:
            self.error(
                path, f"{_show(value)} is too short (must be >= {format_duration(minimum_s)})"
            )
            return None
        return seconds

    def size(self, value: object, path: str) -> int | None:
        try:
            if not isinstance(value, str | int):
                raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
            size = parse_size(value)
        except ValueError as e:
            self.error(path, str(e))
            return None
        if size <= 0:
            self.error(path, f"{_show(value)} is too small (must be more than 0 bytes)")
            return None
        return size

    def items(self, value: object, path: str) -> list[object]:
        """A list; null is empty."""
        if value is None:
            return []
        if not isinstance(value, list):
            self.error(path, f"expected a list, got {_kind(value)}")
            return []
        return value

    def resource_name(self, value: object, path: str) -> str | None:
        name = self.string(value, path)
        if name is None:
            return None
        problem = _resource_name_problem(name)
        if problem is not None:
            self.error(path, problem)
            return None
        return name

    def strategies(self, value: object, path: str) -> tuple[DeviceListStrategy, ...] | None:
        """deviceListStrategy: one name or a non-empty list of distinct names."""
        shown = ", ".join(_STRATEGIES)
        if isinstance(value, str):
            one = self.choice(value, path, _STRATEGIES, shown)
            return None if one is None else (one,)
        if not isinstance(value, list):
            self.error(path, f"expected a strategy or a list of them ({shown}), got {_kind(value)}")
            return None
        if not value:
            self.error(path, f"is empty (list at least one of {shown})")
            return None
        chosen: list[DeviceListStrategy] = []
        valid = True
        for i, item in enumerate(value):
            strategy = self.choice(item, f"{path}[{i}]", _STRATEGIES, shown)
            if strategy is None:
                valid = False
            elif strategy in chosen:
                self.error(f"{path}[{i}]", f"{_show(item)} is listed twice")
                valid = False
            else:
                chosen.append(strategy)
        return tuple(chosen) if valid else None

    def xids(self, value: object, path: str) -> tuple[int, ...] | None:
        """A list of distinct Xid numbers (positive integers); null is empty."""
        if value is None:
            return ()
        if not isinstance(value, list):
            self.error(path, f"expected a list of Xid numbers, e.g. [13, 31], got {_kind(value)}")
            return None
        chosen: list[int] = []
        valid = True
        for i, item in enumerate(value):
            xid = self.integer(item, f"{path}[{i}]", 1)
            if xid is None:
                valid = False
            elif xid in chosen:
                self.error(f"{path}[{i}]", f"{xid} is listed twice")
                valid = False
            else:
                chosen.append(xid)
        return tuple(chosen) if valid else None

    def version(self, value: object, path: str) -> str | None:
        if value != "v1":
            self.error(path, f'{_show(value)} is not supported (expected "v1")')
            return None
        return "v1"


def _slice_rule(r: _Reader, section: Mapping[str, object], path: str) -> SliceRule | None:
    """replicas or memoryPerSlice (exactly one) of a slicing section or an override; None if
    neither is set or a value is invalid."""
    has_replicas = "replicas" in section
    has_memory = "memoryPerSlice" in section
    replicas = (
        r.integer(section["replicas"], _join(path, "replicas"), 1, MAX_REPLICAS)
        if has_replicas
        else None
    )
    memory = (
        r.size(section["memoryPerSlice"], _join(path, "memoryPerSlice")) if has_memory else None
    )
    if memory is not None and memory < MIN_MEMORY_PER_SLICE_BYTES:
        r.error(
            _join(path, "memoryPerSlice"),
            f"{_show(section['memoryPerSlice'])} is too small (must be >= "
            f"{MIN_MEMORY_PER_SLICE_BYTES >> 20}Mi: a slice must hold a CUDA context)",
        )
        return None
    if has_replicas and has_memory:
        r.error(path, "set either replicas or memoryPerSlice, not both")
        return None
    if replicas is not None:
        return SliceRule(replicas=replicas)
    if memory is not None:
        return SliceRule(memory_per_slice_bytes=memory)
    return None


def _gpu_match(r: _Reader, value: object, path: str) -> GpuMatch | None:
    section = r.section(value, path, _MATCH_KEYS)
    if not section:
        if value is None or value == {}:
            r.error(path, f"needs at least one of {', '.join(_MATCH_KEYS)}")
        return None
    model = r.string(section["model"], _join(path, "model")) if "model" in section else None
    index = r.integer(section["index"], _join(path, "index"), 0) if "index" in section else None
    uuid = r.string(section["uuid"], _join(path, "uuid")) if "uuid" in section else None
    profile = r.string(section["profile"], _join(path, "profile")) if "profile" in section else None
    return GpuMatch(model=model, index=index, uuid=uuid, profile=profile)


def _slicing(r: _Reader, value: object) -> SlicingConfig:
    path = "slicing"
    section = r.section(value, path, _SLICING_KEYS)
    default = SlicingConfig().default
    if "replicas" in section or "memoryPerSlice" in section:
        default = _slice_rule(r, section, path) or default
    overrides: list[SliceOverride] = []
    for i, item in enumerate(r.items(section.get("overrides"), _join(path, "overrides"))):
        item_path = f"{path}.overrides[{i}]"
        override = r.section(item, item_path, _OVERRIDE_KEYS)
        if not isinstance(item, dict):
            continue
        match: GpuMatch | None = None
        if "match" in override:
            match = _gpu_match(r, override["match"], _join(item_path, "match"))
        else:
            r.error(item_path, 'needs a match, e.g. match: {model: "*A100*"}')
        if "replicas" not in override and "memoryPerSlice" not in override:
            r.error(item_path, "needs replicas or memoryPerSlice")
        rule = _slice_rule(r, override, item_path)
        if match is not None and rule is not None:
            overrides.append(SliceOverride(match=match, rule=rule))
    return SlicingConfig(default=default, overrides=tuple(overrides))


def _allocation(r: _Reader, value: object) -> AllocationConfig:
    path = "allocation"
    section = r.section(value, path, _ALLOCATION_KEYS)
    defaults = AllocationConfig()
    policy = defaults.policy
    if "policy" in section:
        shown = "pack, spread (NVIDIA's packed, distributed are accepted too)"
        policy = r.choice(section["policy"], _join(path, "policy"), _POLICIES, shown) or policy
    strategies = defaults.device_list_strategy
    if "deviceListStrategy" in section:
        parsed = r.strategies(section["deviceListStrategy"], _join(path, "deviceListStrategy"))
        strategies = parsed or strategies
    hints = defaults.framework_hints
    if "frameworkHints" in section:
        parsed_hints = r.boolean(section["frameworkHints"], _join(path, "frameworkHints"))
        hints = hints if parsed_hints is None else parsed_hints
    reserve = defaults.context_reserve_bytes
    if "contextReserve" in section:
        value = section["contextReserve"]
        # 0 is a valid reserve (no room kept for the CUDA context), unlike other sizes.
        zero = (value == 0 and not isinstance(value, bool)) or value == "0"
        parsed_reserve = 0 if zero else r.size(value, _join(path, "contextReserve"))
        reserve = reserve if parsed_reserve is None else parsed_reserve
    return AllocationConfig(
        policy=policy,
        device_list_strategy=strategies,
        framework_hints=hints,
        context_reserve_bytes=reserve,
    )


def _enforcement(r: _Reader, value: object) -> EnforcementConfig:
    path = "enforcement"
    section = r.section(value, path, _ENFORCEMENT_KEYS)
    defaults = EnforcementConfig()

    poll = defaults.poll_interval_s
    if "pollInterval" in section:
        parsed = r.duration(
            section["pollInterval"],
            _join(path, "pollInterval"),
            MIN_POLL_INTERVAL_S,
            MAX_POLL_INTERVAL_S,
        )
        poll = defaults.poll_interval_s if parsed is None else parsed

    dry_run = defaults.dry_run
    if "dryRun" in section:
        parsed_dry_run = r.boolean(section["dryRun"], _join(path, "dryRun"))
        dry_run = dry_run if parsed_dry_run is None else parsed_dry_run

    memory_path = _join(path, "memory")
    memory = r.section(section.get("memory"), memory_path, _MEMORY_KEYS)
    memory_action = defaults.memory.action
    if "action" in memory:
        shown = ", ".join(_MEMORY_ACTIONS)
        action_path = _join(memory_path, "action")
        memory_action = r.choice(memory["action"], action_path, _MEMORY_ACTIONS, shown) or (
            memory_action
        )
    grace = defaults.memory.grace_period_s
    if "gracePeriod" in memory:
        parsed = r.duration(memory["gracePeriod"], _join(memory_path, "gracePeriod"), 0.0)
        grace = grace if parsed is None else parsed

    compute_path = _join(path, "compute")
    compute = r.section(section.get("compute"), compute_path, _COMPUTE_KEYS)
    compute_action = defaults.compute.action
    if "action" in compute:
        shown = ", ".join(_COMPUTE_ACTIONS)
        action_path = _join(compute_path, "action")
        compute_action = r.choice(compute["action"], action_path, _COMPUTE_ACTIONS, shown) or (
            compute_action
        )
    window: float | None = defaults.compute.window_s
    if "window" in compute:
        window = r.duration(compute["window"], _join(compute_path, "window"), 0.0)
    period: float | None = defaults.compute.period_s
    if "period" in compute:
        period = r.duration(compute["period"], _join(compute_path, "period"), MIN_COMPUTE_PERIOD_S)
    if window is not None and period is not None and window < period:
        r.error(
            _join(compute_path, "window"),
            f"{format_duration(window)} is shorter than period {format_duration(period)}"
            " (the window must hold at least one duty cycle)",
        )
    work_conserving = defaults.compute.work_conserving
    if "workConserving" in compute:
        parsed_bool = r.boolean(compute["workConserving"], _join(compute_path, "workConserving"))
        work_conserving = work_conserving if parsed_bool is None else parsed_bool

    return EnforcementConfig(
        poll_interval_s=poll,
        dry_run=dry_run,
        memory=MemoryEnforcement(action=memory_action, grace_period_s=grace),
        compute=ComputeEnforcement(
            action=compute_action,
            window_s=defaults.compute.window_s if window is None else window,
            period_s=defaults.compute.period_s if period is None else period,
            work_conserving=work_conserving,
        ),
    )


def _mps_root(r: _Reader, value: object, path: str) -> str | None:
    root = r.string(value, path)
    if root is None:
        return None
    if not root.startswith("/"):
        r.error(path, f"{_show(root)} is not an absolute path (e.g. {DEFAULT_MPS_ROOT})")
        return None
    # Containers get <root>/pipe at the same path: keep it a plain, normalised path.
    if os.path.normpath(root) != root or any(c in root for c in ",:\n"):
        r.error(path, f"{_show(root)} is not a normalised path without commas or colons")
        return None
    return root


def _mps(r: _Reader, value: object) -> MpsConfig:
    section = r.section(value, "mps", _MPS_KEYS)
    defaults = MpsConfig()
    enabled = defaults.enabled
    if "enabled" in section:
        parsed = r.boolean(section["enabled"], "mps.enabled")
        enabled = enabled if parsed is None else parsed
    root = defaults.root
    if "root" in section:
        root = _mps_root(r, section["root"], "mps.root") or root
    command = defaults.control_command
    if "controlCommand" in section:
        parsed_command = r.string(section["controlCommand"], "mps.controlCommand")
        if parsed_command is not None and not parsed_command.strip():
            r.error("mps.controlCommand", "is empty (the default is nvidia-cuda-mps-control)")
        elif parsed_command is not None:
            command = parsed_command
    return MpsConfig(enabled=enabled, root=root, control_command=command)


def _node_labels(r: _Reader, value: object) -> NodeLabelsConfig:
    section = r.section(value, "nodeLabels", _NODE_LABELS_KEYS)
    if section.get("path", "") == "":
        return NodeLabelsConfig()
    path = r.string(section["path"], "nodeLabels.path")
    if path and not path.startswith("/"):
        r.error(
            "nodeLabels.path", f"{_show(path)} is not an absolute path; use e.g. {NFD_FEATURE_FILE}"
        )
        return NodeLabelsConfig()
    return NodeLabelsConfig(path=path or "")


def _health(r: _Reader, value: object) -> HealthConfig:
    path = "health"
    section = r.section(value, path, _HEALTH_KEYS)
    defaults = HealthConfig()
    enabled = defaults.enabled
    if "enabled" in section:
        parsed_bool = r.boolean(section["enabled"], _join(path, "enabled"))
        enabled = enabled if parsed_bool is None else parsed_bool
    lists: dict[str, tuple[int, ...]] = {}
    for key, default in (
        ("ignoredXids", defaults.ignored_xids),
        ("additionalIgnoredXids", defaults.additional_ignored_xids),
        ("criticalXids", defaults.critical_xids),
    ):
        parsed_xids = r.xids(section[key], _join(path, key)) if key in section else None
        lists[key] = default if parsed_xids is None else parsed_xids
    # criticalXids wins over the default ignore list; an Xid written both as ignored and as
    # critical is a contradiction.
    for key in ("ignoredXids", "additionalIgnoredXids"):
        if key not in section:
            continue
        both = [x for x in lists["criticalXids"] if x in lists[key]]
        if both:
            shown = ", ".join(str(x) for x in both)
            r.error(
                _join(path, "criticalXids"),
                f"{shown} also listed in {_join(path, key)}; list each Xid in one of them",
            )
    recovery = defaults.recovery
    if "recovery" in section:
        recovery = (
            r.choice(
                section["recovery"],
                _join(path, "recovery"),
                _RECOVERY_POLICIES,
                ", ".join(_RECOVERY_POLICIES),
            )
            or recovery
        )
    delay = defaults.recovery_delay_s
    if "recoveryDelay" in section:
        parsed = r.duration(section["recoveryDelay"], _join(path, "recoveryDelay"), 0.0)
        delay = delay if parsed is None else parsed
    hang = defaults.hang_timeout_s
    if "hangTimeout" in section:
        parsed = r.duration(section["hangTimeout"], _join(path, "hangTimeout"), MIN_HANG_TIMEOUT_S)
        hang = hang if parsed is None else parsed
    return HealthConfig(
        enabled=enabled,
        ignored_xids=lists["ignoredXids"],
        additional_ignored_xids=lists["additionalIgnoredXids"],
        critical_xids=lists["criticalXids"],
        recovery=recovery,
        recovery_delay_s=delay,
        hang_timeout_s=hang,
    )


_MIG_STRATEGIES = {s.value: s for s in MigStrategy}


def _mig(r: _Reader, value: object) -> MigConfig:
    section = r.section(value, "mig", _MIG_KEYS)
    if "strategy" not in section:
        return MigConfig()
    shown = ", ".join(_MIG_STRATEGIES)
    strategy = r.choice(section["strategy"], "mig.strategy", _MIG_STRATEGIES, shown)
    return MigConfig(strategy=strategy or MigStrategy.NONE)


def _parse_vgpu(r: _Reader, data: object) -> Config:
    top = r.section(data, "", _TOP_KEYS)
    defaults = Config()
    version = defaults.version
    if "version" in top:
        version = r.version(top["version"], "version") or version
    resource_name = defaults.resource_name
    if "resourceName" in top:
        resource_name = r.resource_name(top["resourceName"], "resourceName") or resource_name
    return Config(
        version=version,
        resource_name=resource_name,
        slicing=_slicing(r, top.get("slicing")),
        allocation=_allocation(r, top.get("allocation")),
        enforcement=_enforcement(r, top.get("enforcement")),
        mps=_mps(r, top.get("mps")),
        health=_health(r, top.get("health")),
        node_labels=_node_labels(r, top.get("nodeLabels")),
        mig=_mig(r, top.get("mig")),
    )


# --- NVIDIA k8s-device-plugin's config format -------------------------------------------------
#
# Users bring the file they already have (api/config/v1 of NVIDIA/k8s-device-plugin). What vgpu
# can act on is mapped; settings it does not act on are accepted and reported as warnings when they
# differ from NVIDIA's defaults, so that a default-valued dump of NVIDIA's config reads quietly.

_NVIDIA_PREFIX = "nvidia.com"
_NVIDIA_SHARED_SUFFIX = ".shared"
_NV_TOP_KEYS = ("version", "flags", "resources", "sharing", "imex", "health")
_NV_FLAGS_KEYS = (
    "migStrategy",
    "failOnInitError",
    "restartOnDeviceUnhealthy",
    "nvidiaDriverRoot",
    "nvidiaDevRoot",
    "mpsRoot",
    "gdsEnabled",
    "gdrcopyEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
    "deviceDiscoveryStrategy",
    "plugin",
    "gfd",
)
_NV_PLUGIN_KEYS = (
    "passDeviceSpecs",
    "deviceListStrategy",
    "deviceIDStrategy",
    "containerDriverRoot",
    "cdiAnnotationPrefix",
    "nvidiaCTKPath",
    "nvidiaDevRoot",
    "sharedDevicesAllocationPolicy",
)
_NV_RESOURCES_KEYS = ("gpus", "mig")
_NV_SHARING_KEYS = ("timeSlicing", "mps")
_NV_REPLICATED_KEYS = ("renameByDefault", "failRequestsGreaterThanOne", "resources")
_NV_RESOURCE_KEYS = ("name", "replicas", "rename", "devices")
_NV_HEALTH_KEYS = ("disabled", "eventTypes", "ignoredXIDs", "criticalXIDs")
_NV_EVENT_TYPES = (
    "EventTypeXidCriticalError",
    "EventTypeDoubleBitEccError",
    "EventTypeSingleBitEccError",
)


@dataclass(frozen=True, slots=True)
class _IgnoredSetting:
    """An NVIDIA setting vgpu accepts but does not act on. `choices` limits a string's values."""

    key: str
    nvidia_default: bool | str
    instead: str
    choices: tuple[str, ...] = ()


_DRIVER_INSTEAD = "vgpu uses the NVIDIA driver and device nodes visible in its own container"
_NV_IGNORED_FLAGS = (
    _IgnoredSetting(
        "failOnInitError",
        True,
        "vgpu always exits with an error when it cannot start its GPU backend",
    ),
    _IgnoredSetting(
        "restartOnDeviceUnhealthy",
        False,
        "vgpu marks the slices of an unhealthy GPU unhealthy and keeps running",
    ),
    _IgnoredSetting("nvidiaDriverRoot", "/", _DRIVER_INSTEAD),
    _IgnoredSetting("nvidiaDevRoot", "/", _DRIVER_INSTEAD),
    _IgnoredSetting(
        "gdsEnabled",
        False,
        "vgpu does not pass GPUDirect Storage devices to containers",
    ),
    _IgnoredSetting(
        "gdrcopyEnabled",
        False,
        "vgpu does not pass GDRCopy devices to containers",
    ),
    _IgnoredSetting(
        "mofedEnabled",
        False,
        "vgpu does not pass MOFED devices to containers",
    ),
    _IgnoredSetting(
        "useNodeFeatureAPI",
        False,
        "vgpu does not label nodes; that is gpu-feature-discovery's job",
    ),
    _IgnoredSetting(
        "deviceDiscoveryStrategy",
        "auto",
        "vgpu always discovers GPUs through NVML",
        ("auto", "nvml", "tegra"),
    ),
)
_NV_IGNORED_PLUGIN = (
    _IgnoredSetting(
        "deviceIDStrategy",
        "uuid",
        "vgpu always passes GPUs by UUID",
        ("uuid", "index"),
    ),
    _IgnoredSetting("containerDriverRoot", "/driver-root", _DRIVER_INSTEAD),
    _IgnoredSetting(
        "cdiAnnotationPrefix",
        "cdi.k8s.io/",
        "vgpu always uses the cdi.k8s.io/ annotation prefix",
    ),
    _IgnoredSetting(
        "nvidiaCTKPath",
        "/usr/bin/nvidia-ctk",
        "vgpu does not run nvidia-ctk",
    ),
    _IgnoredSetting("nvidiaDevRoot", "/", _DRIVER_INSTEAD),
)


def _ignored_settings(
    r: _Reader, section: Mapping[str, object], path: str, settings: Sequence[_IgnoredSetting]
) -> None:
    """Type-check NVIDIA settings vgpu does not act on; warn about those set to a non-default."""
    for setting in settings:
        if setting.key not in section:
            continue
        value = section[setting.key]
        key_path = _join(path, setting.key)
        if isinstance(setting.nvidia_default, bool):
            parsed: object = r.boolean(value, key_path)
        elif setting.choices:
            shown = ", ".join(setting.choices)
            parsed = r.choice(value, key_path, {c: c for c in setting.choices}, shown)
        elif isinstance(value, str):
            parsed = value
        else:
            r.error(key_path, f"{_show(value)} is not a string")
            parsed = None
        if parsed is not None and parsed != setting.nvidia_default:
            r.warn(f"{key_path}: {_show(parsed)} is ignored: {setting.instead}.")


def _nvidia_resource_name(r: _Reader, value: object, path: str, suffix: str = "") -> str | None:
    """NVIDIA's resource names get the nvidia.com/ prefix when they have no domain."""
    name = r.string(value, path)
    if name is None:
        return None
    full = (name if "/" in name else f"{_NVIDIA_PREFIX}/{name}") + suffix
    problem = _resource_name_problem(full)
    if problem is not None:
        r.error(path, problem)
        return None
    return full


def _nvidia_devices(r: _Reader, value: object, path: str) -> None:
    """`devices`: "all", a positive count, or a list of GPU indices and UUIDs. vgpu slices every
    GPU, so anything but "all" is a warning."""
    ignored = (
        f"{path} is ignored: vgpu slices every GPU of the node (vgpu's own slicing.overrides"
        " can give GPUs different replicas)."
    )
    if value == "all":
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            r.error(path, f"{value} is too small (a count of devices must be >= 1)")
        else:
            r.warn(ignored)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int | str):
                r.error(f"{path}[{i}]", f"{_show(item)} is not a GPU index or UUID")
        r.warn(ignored)
        return
    r.error(path, f'{_show(value)} is not "all", a count or a list of GPU indices and UUIDs')


@dataclass(frozen=True, slots=True)
class _NvidiaSharing:
    resource_name: str | None  # as advertised: after rename or renameByDefault
    replicas: int | None
    base_name: str | None  # as named, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb
    path: str


def _nvidia_replicated(r: _Reader, value: object, path: str) -> list[_NvidiaSharing]:
    """sharing.timeSlicing or sharing.mps: its resources, in the file's order."""
    section = r.section(value, path, _NV_REPLICATED_KEYS)
    rename_by_default = False
    if "renameByDefault" in section:
        rename_by_default = bool(
            r.boolean(section["renameByDefault"], _join(path, "renameByDefault"))
        )
    if "failRequestsGreaterThanOne" in section:
        key_path = _join(path, "failRequestsGreaterThanOne")
        if r.boolean(section["failRequestsGreaterThanOne"], key_path):
            r.warn(
                f"{key_path}: true is ignored:"
                " vgpu accepts requests for several slices and gives the container"
                " the memory and compute of all of them.",
            )
    resources_path = _join(path, "resources")
    resources = r.items(section.get("resources"), resources_path)
    chosen: list[_NvidiaSharing] = []
    for i, item in enumerate(resources):
        item_path = f"{resources_path}[{i}]"
        resource = r.section(item, item_path, _NV_RESOURCE_KEYS)
        if not isinstance(item, dict):
            continue
        name: str | None = None
        base: str | None = None
        if "rename" in resource:
            name = _nvidia_resource_name(r, resource["rename"], _join(item_path, "rename"))
        if "name" not in resource:
            r.error(item_path, "needs a name, e.g. name: nvidia.com/gpu")
        else:
            suffix = _NVIDIA_SHARED_SUFFIX if rename_by_default else ""
            base = _nvidia_resource_name(r, resource["name"], _join(item_path, "name"))
            name = name or (base + suffix if base is not None else None)
        replicas: int | None = None
        if "replicas" not in resource:
            r.error(item_path, "needs replicas, e.g. replicas: 4")
        else:
            replicas = r.integer(
                resource["replicas"], _join(item_path, "replicas"), 1, MAX_REPLICAS
            )
        if "devices" in resource:
            _nvidia_devices(r, resource["devices"], _join(item_path, "devices"))
        chosen.append(_NvidiaSharing(name, replicas, base, item_path))
    return chosen


def _nvidia_mps_root(r: _Reader, flags: Mapping[str, object]) -> str | None:
    """flags.mpsRoot, where set (NVIDIA writes an unset one as "")."""
    value = flags.get("mpsRoot")
    if value is None or value == "":
        return None
    return _mps_root(r, value, "flags.mpsRoot")


def _nvidia_flags(
    r: _Reader, value: object
) -> tuple[AllocationPolicy | None, tuple[DeviceListStrategy, ...] | None, bool]:
    """flags: the allocation policy, device list strategies and passDeviceSpecs, where set."""
    flags = r.section(value, "flags", _NV_FLAGS_KEYS)
    _ignored_settings(r, flags, "flags", _NV_IGNORED_FLAGS)
    gfd = flags.get("gfd")
    if gfd is not None and not isinstance(gfd, dict):
        r.error("flags.gfd", f"expected a mapping, got {_kind(gfd)}")
    elif gfd:
        r.warn("flags.gfd is ignored: it configures gpu-feature-discovery, not vgpu.")
    plugin = r.section(flags.get("plugin"), "flags.plugin", _NV_PLUGIN_KEYS)
    _ignored_settings(r, plugin, "flags.plugin", _NV_IGNORED_PLUGIN)
    policy: AllocationPolicy | None = None
    if "sharedDevicesAllocationPolicy" in plugin:
        policy = r.choice(
            plugin["sharedDevicesAllocationPolicy"],
            "flags.plugin.sharedDevicesAllocationPolicy",
            _POLICIES,
            "packed, distributed (vgpu's pack, spread are accepted too)",
        )
    strategies: tuple[DeviceListStrategy, ...] | None = None
    if "deviceListStrategy" in plugin:
        strategies = r.strategies(plugin["deviceListStrategy"], "flags.plugin.deviceListStrategy")
    pass_specs = False
    if "passDeviceSpecs" in plugin:
        pass_specs = bool(r.boolean(plugin["passDeviceSpecs"], "flags.plugin.passDeviceSpecs"))
    return policy, strategies, pass_specs


def _nvidia_health(r: _Reader, value: object) -> HealthConfig:
    """NVIDIA's `health` section (api/config/v1/health.go): `disabled` and `ignoredXIDs` map to
    vgpu's enabled and ignoredXids; `criticalXIDs` "all" is vgpu's behaviour. A list of critical
    Xids (only those act) and a narrower `eventTypes` are accepted with a warning."""
    path = "health"
    section = r.section(value, path, _NV_HEALTH_KEYS)
    defaults = HealthConfig()
    enabled = defaults.enabled
    if "disabled" in section:
        disabled = r.boolean(section["disabled"], _join(path, "disabled"))
        enabled = enabled if disabled is None else not disabled
    ignored = defaults.ignored_xids
    if "ignoredXIDs" in section:
        parsed = r.xids(section["ignoredXIDs"], _join(path, "ignoredXIDs"))
        # As in NVIDIA's plugin, an empty list keeps the default list.
        ignored = parsed or ignored
    if "eventTypes" in section:
        types_path = _join(path, "eventTypes")
        chosen: set[str] = set()
        for i, item in enumerate(r.items(section["eventTypes"], types_path)):
            event_type = r.choice(
                item,
                f"{types_path}[{i}]",
                {t: t for t in _NV_EVENT_TYPES},
                ", ".join(_NV_EVENT_TYPES),
            )
            if event_type is not None:
                chosen.add(event_type)
        if chosen and "EventTypeXidCriticalError" not in chosen:
            r.warn(
                f"{types_path} is ignored: vgpu always watches Xid and double-bit ECC events"
                " (health.disabled: true turns the watch off)."
            )
    if "criticalXIDs" in section:
        critical_path = _join(path, "criticalXIDs")
        critical = section["criticalXIDs"]
        if isinstance(critical, str) and critical.lower() == "all":
            pass
        elif isinstance(critical, list):
            if r.xids(critical, critical_path):
                r.warn(
                    f"{critical_path}: a list is ignored: vgpu treats every Xid that is not in"
                    " ignoredXIDs as critical."
                )
        else:
            r.error(critical_path, f'{_show(critical)} is not "all" or a list of Xid numbers')
    return replace(defaults, enabled=enabled, ignored_xids=ignored)


def _parse_nvidia(r: _Reader, data: Mapping[str, object]) -> Config:
    top = r.section(data, "", _NV_TOP_KEYS)
    defaults = Config()
    if "version" in top:
        r.version(top["version"], "version")

    policy, strategies, pass_specs = _nvidia_flags(r, top.get("flags"))
    device_list = strategies or defaults.allocation.device_list_strategy
    if pass_specs and DeviceListStrategy.DEVICE_SPECS not in device_list:
        device_list = (*device_list, DeviceListStrategy.DEVICE_SPECS)

    resources = r.section(top.get("resources"), "resources", _NV_RESOURCES_KEYS)
    for key, value in resources.items():
        if r.items(value, _join("resources", key)):
            r.warn(
                f"resources.{key} is ignored: vgpu advertises every GPU under the one resource"
                " name of the sharing section.",
            )
    if top.get("imex"):
        r.warn("imex is ignored: vgpu does not pass IMEX channels.")
    health = _nvidia_health(r, top.get("health"))

    mig_strategy = _nvidia_mig_strategy(r, top.get("flags"))
    sharing = r.section(top.get("sharing"), "sharing", _NV_SHARING_KEYS)
    time_slicing = _nvidia_replicated(r, sharing.get("timeSlicing"), "sharing.timeSlicing")
    mps = _nvidia_replicated(r, sharing.get("mps"), "sharing.mps")
    if time_slicing and mps:
        r.error(
            "sharing",
            "timeSlicing and mps both list resources; vgpu shares GPUs one way, so keep one",
        )
    chosen = mps or time_slicing
    flags = top.get("flags")
    mps_root = _nvidia_mps_root(r, flags) if isinstance(flags, dict) else None
    if mps:
        r.warn(
            "sharing.mps: vgpu runs one MPS control daemon for the node, with its pipe directory"
            " at <mps root>/pipe (not NVIDIA's <mps root>/<resource>/pipe), and does not set"
            " the GPUs' compute mode to EXCLUSIVE_PROCESS: a process that bypasses MPS still"
            " reaches the GPU, and the poller enforces its container's limits."
        )
    elif mps_root is not None:
        r.warn(
            "flags.mpsRoot is ignored: vgpu runs MPS only for a sharing.mps resource,"
            " and none is listed."
        )
    resource_name = defaults.resource_name
    slicing = defaults.slicing
    mig = MigConfig(strategy=mig_strategy)
    if not chosen:
        r.warn(
            "sharing: no timeSlicing or mps resource is listed, so vgpu uses its defaults:"
            f" {defaults.resource_name} with {DEFAULT_REPLICAS} slices per GPU.",
        )
    else:
        resource_name, slicing, mig = _nvidia_resources(r, chosen, mig_strategy)

    return Config(
        resource_name=resource_name,
        slicing=slicing,
        allocation=AllocationConfig(
            policy=policy or defaults.allocation.policy, device_list_strategy=device_list
        ),
        mps=MpsConfig(
            enabled=bool(mps),
            root=(mps_root if mps and mps_root else DEFAULT_MPS_ROOT),
        ),
        health=health,
        mig=mig,
    )


def _nvidia_mig_strategy(r: _Reader, value: object) -> MigStrategy:
    """flags.migStrategy (NVIDIA's default: none)."""
    flags = value if isinstance(value, dict) else {}
    if flags.get("migStrategy") is None:
        return MigStrategy.NONE
    shown = ", ".join(_MIG_STRATEGIES)
    strategy = r.choice(flags["migStrategy"], "flags.migStrategy", _MIG_STRATEGIES, shown)
    return strategy or MigStrategy.NONE


def _nvidia_resources(
    r: _Reader, resources: Sequence[_NvidiaSharing], strategy: MigStrategy
) -> tuple[str, SlicingConfig, MigConfig]:
    """The shared resources of NVIDIA's file: one name for full GPUs (`nvidia.com/gpu` or any
    name that is not a MIG profile's), and with the mixed strategy one `mig-<profile>` name per
    MIG profile, each with its replicas. With the single strategy the full GPUs' replicas apply to
    MIG devices too, as in NVIDIA's plugin, where MIG devices are then `nvidia.com/gpu`."""
    resource_name = DEFAULT_RESOURCE_NAME
    default = SlicingConfig().default
    gpu_names: list[str] = []
    overrides: list[SliceOverride] = []
    renames: list[tuple[str, str]] = []
    seen: set[str] = set()
    for resource in resources:
        if resource.base_name is None or resource.resource_name is None:
            continue
        if resource.base_name in seen:
            r.error(resource.path, f"{resource.base_name} is listed twice; keep one entry")
            continue
        seen.add(resource.base_name)
        if resource.base_name.startswith(MIG_RESOURCE_PREFIX):
            profile = resource.base_name.removeprefix(MIG_RESOURCE_PREFIX)
            if strategy is not MigStrategy.MIXED:
                r.error(
                    _join(resource.path, "name"),
                    f"{resource.base_name} names a MIG profile, which is advertised on its own"
                    f" only with flags.migStrategy: mixed (it is {strategy.value})",
                )
                continue
            if resource.replicas is not None:
                overrides.append(
                    SliceOverride(GpuMatch(profile=profile), SliceRule(replicas=resource.replicas))
                )
            if resource.resource_name != resource.base_name:
                renames.append((profile, resource.resource_name))
            continue
        gpu_names.append(resource.resource_name)
        resource_name = resource.resource_name
        if resource.replicas is not None:
            default = SliceRule(replicas=resource.replicas)
    if len(gpu_names) > 1:
        r.error(
            resources[0].path.rpartition("[")[0],
            f"lists {len(gpu_names)} resources for full GPUs ({', '.join(gpu_names)}); vgpu"
            " advertises full GPUs under one name, so keep one (MIG profiles may each have"
            " their own nvidia.com/mig-<profile> entry with flags.migStrategy: mixed)",
        )
    if strategy is MigStrategy.SINGLE and gpu_names:
        overrides.append(SliceOverride(GpuMatch(profile="*"), default))
    return (
        resource_name,
        SlicingConfig(default=default, overrides=tuple(overrides)),
        MigConfig(strategy=strategy, renames=tuple(renames)),
    )


def parse_config(data: object, source: str = "config") -> Config:
    """A Config from YAML-loaded data (None: all defaults). Both vgpu's format and NVIDIA
    k8s-device-plugin's (recognised by a top-level `sharing` or `flags` key) are read.

    Raises ConfigError listing every problem, each naming its key path and the bad value. Settings
    that are valid but that vgpu does not act on are returned in `Config.warnings`."""
    if isinstance(data, dict) and ("sharing" in data or "flags" in data):
        hint = (
            " (this file is read as NVIDIA k8s-device-plugin config because it has a top-level"
            ' "sharing" or "flags" key; vgpu keys cannot be mixed into it)'
        )
        reader = _Reader(null_is_absent=True, top_level_hints=dict.fromkeys(_TOP_KEYS, hint))
        config = _parse_nvidia(reader, data)
    else:
        reader = _Reader()
        config = _parse_vgpu(reader, data)
    if reader.problems:
        raise ConfigError(reader.problems, source)
    return replace(config, warnings=tuple(reader.warnings))


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key written twice in one mapping (PyYAML would silently keep
    the last one, hiding a setting the user believes is in force)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {_show(key)}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and parse a config file (YAML; JSON is YAML). Every failure is a ConfigError whose
    source is the path: an unreadable file, a YAML syntax error (with its line and column), or the
    problems parse_config finds."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            content = file.read()
    except OSError as e:
        raise ConfigError([f"cannot read the file: {e.strerror or e}"], source) from e
    return config_from_bytes(content, source)


def config_from_bytes(content: bytes, source: str) -> Config:
    """Parse a config file's content, as load_config does once it has read the file."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"is not UTF-8 text (byte {e.start})"], source) from e
    loader = _UniqueKeyLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = e.problem or e.context or "invalid YAML"
        raise ConfigError([f"{where}{what}"], source) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"invalid YAML: {e}"], source) from e
    except RecursionError as e:
        raise ConfigError(["invalid YAML: nested too deep"], source) from e
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise ConfigError([f"invalid YAML: {_show(str(e))}"], source) from e
    finally:
        loader.dispose()
    return parse_config(data, source)


def default_config_yaml(*, node_labels_path: str = "") -> str:
    """The full default config as commented YAML, for the DaemonSet's ConfigMap and the docs.
    It parses back to Config(), but for `nodeLabels.path` when given (the DaemonSet's config sets
    it to NFD_FEATURE_FILE)."""
    d = Config()
    e = d.enforcement
    replicas = d.slicing.default.replicas
    strategies = ", ".join(s.value for s in d.allocation.device_list_strategy)
    h = d.health

    def xids(values: tuple[int, ...]) -> str:
        return ", ".join(str(x) for x in values)

    return f"""\
# vgpu device plugin configuration. Every key is optional: the values below are the defaults.
# Durations take a unit (500ms, 2s, 1m); sizes take binary (Ki, Mi, Gi) or decimal (K, M, G) units.
# NVIDIA k8s-device-plugin's config file (sharing.timeSlicing / sharing.mps) is accepted too.
version: v1

# The extended resource pods request, e.g. resources.limits: {{{d.resource_name}: 1}}.
resourceName: {d.resource_name}

slicing:
  # Each GPU is split into this many slices; a slice gets 1/replicas of the GPU's memory and
  # compute. A container holding k slices of a GPU gets k times that.
  replicas: {replicas}
  # Or size slices by memory instead of replicas (replicas = GPU memory / memoryPerSlice):
  # memoryPerSlice: 10Gi
  # Per-GPU exceptions, matched by model (a glob on the GPU name), index or uuid; the first
  # override that matches a GPU wins. Each sets replicas or memoryPerSlice.
  overrides: []
  # overrides:
  #   - match: {{model: "*A100*"}}
  #     replicas: 8
  #   - match: {{index: 1}}
  #     memoryPerSlice: 20Gi

allocation:
  # pack: put a container's slices on the GPU that already has the most used slices;
  # spread: on the least used GPU. (NVIDIA's names packed and distributed are accepted too.)
  policy: {d.allocation.policy.value}
  # How a container gets its GPUs, any of: envvar, volume-mounts, cdi-annotations, cdi-cri,
  # device-specs.
  deviceListStrategy: [{strategies}]
  # Tell frameworks that reserve GPU memory up front their share, so that they fit their
  # slices: XLA_PYTHON_CLIENT_MEM_FRACTION (JAX), TF_FORCE_GPU_ALLOW_GROWTH (TensorFlow) and
  # VGPU_MEMORY_FRACTION_<i> per GPU (PyTorch, vLLM: set in code or on the command line).
  frameworkHints: {"true" if d.allocation.framework_hints else "false"}
  # Left out of those fractions for the CUDA context and libraries outside the framework's pool.
  contextReserve: {format_size(d.allocation.context_reserve_bytes)}

enforcement:
  # How often GPU memory and utilisation are measured.
  pollInterval: {format_duration(e.poll_interval_s)}
  # Decide, log and count every enforcement action, but send no signal to any process.
  dryRun: {"true" if e.dry_run else "false"}
  memory:
    # kill: SIGKILL the largest GPU process of a container that stays above its memory limit for
    # longer than gracePeriod; monitor: only record the violation.
    action: {e.memory.action.value}
    gracePeriod: {format_duration(e.memory.grace_period_s)}
  compute:
    # throttle: pause and resume (SIGSTOP/SIGCONT) the GPU processes of a container that uses more
    # than its compute share while others wait; monitor: only record the violation.
    action: {e.compute.action.value}
    # Utilisation is averaged over window; period is the length of one pause/resume cycle.
    window: {format_duration(e.compute.window_s)}
    period: {format_duration(e.compute.period_s)}
    # Let containers use GPU time that no other container wants, beyond their share.
    workConserving: {"true" if e.compute.work_conserving else "false"}

mps:
  # Run and supervise the node's CUDA MPS control daemon and share the GPUs through it: each
  # MPS client process is held to one slice's memory and compute by the GPU itself, and
  # containers get the pipe directory and their limits. Needs the DaemonSet's MPS component.
  enabled: {"true" if d.mps.enabled else "false"}
  # The MPS pipe (<root>/pipe), log (<root>/log) and shared memory (<root>/shm) directories.
  root: {d.mps.root}
  # The MPS control program, started with -d and sent its commands on stdin.
  controlCommand: {d.mps.control_command}

health:
  # Watch NVML's Xid and double-bit ECC events, and take a GPU out of service (its slices turn
  # Unhealthy) on a critical one. A GPU that NVML reports lost, or whose NVML calls hang for
  # hangTimeout, is taken out of service even when this is false.
  enabled: {"true" if h.enabled else "false"}
  # Xids caused by applications, not by the GPU: they leave the GPU in service. This list replaces
  # the default; additionalIgnoredXids adds to it; criticalXids wins over both.
  ignoredXids: [{xids(h.ignored_xids)}]
  additionalIgnoredXids: [{xids(h.additional_ignored_xids)}]
  criticalXids: [{xids(h.critical_xids)}]
  # manual: a GPU taken out of service stays out until the daemon restarts; auto: it returns once
  # it has answered correctly, with no critical Xid, for recoveryDelay.
  recovery: {h.recovery.value}
  recoveryDelay: {format_duration(h.recovery_delay_s)}
  hangTimeout: {format_duration(h.hang_timeout_s)}

nodeLabels:
  # Keep a node feature discovery feature file here (NFD v0.15 or newer turns its lines into node
  # labels nvidia.com/vgpu.count, .replicas, .memory-per-slice-mib, .product, .mig-strategy; all
  # but the last describe resourceName's slices); "" (the built-in default) keeps none; the
  # DaemonSet's config names NFD's features.d directory.
  path: {json.dumps(node_labels_path)}

mig:
  # GPUs in MIG mode. none: left out. single: every MIG device is sliced like a GPU and advertised
  # under resourceName (all MIG devices of the node must share one profile). mixed: each profile
  # is its own resource, nvidia.com/mig-<profile> (e.g. nvidia.com/mig-1g.10gb), as with NVIDIA's
  # plugin. A MIG device is one slice unless a slicing override matches its profile, e.g.
  # {{match: {{profile: "1g.10gb"}}, replicas: 2}}. Memory limits are enforced per MIG device; NVML
  # measures no utilisation per MIG device, so compute shares are not enforced on them.
  strategy: {d.mig.strategy.value}
"""
