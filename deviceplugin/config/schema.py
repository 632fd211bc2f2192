"""The JSON Schema of the config file (docs/design.md §7), for editors and `check-jsonschema`.

`vgpu-device-plugin config-schema` prints it. It is written out by hand next to the parser (the
rest of this package), with the parser's own enums, defaults and minimums, and
tests/unit/test_configschema.py checks the two against each other in both directions: every key
the parser reads is here with the same type, choices and bounds, every key here is one the parser
reads, unknown keys are refused by both, and the example configs validate. A key added to the
parser without its schema fails them.

Durations and sizes are strings with a unit, which JSON Schema cannot compare: their bounds
travel as `x-minimumSeconds`, `x-maximumSeconds` and `x-minimumBytes` and are enforced by the
parser (`check-config`). NVIDIA
k8s-device-plugin's format (a file with a top-level `flags`, `sharing`, `resources` or `imex`) is
described at its top level only; `check-config` checks it in full.
"""

from __future__ import annotations

from typing import Any

from deviceplugin.config.model import (
    MAX_DURATION_S,
    MAX_POLL_INTERVAL_S,
    MAX_REPLICAS,
    MIN_COMPUTE_PERIOD_S,
    MIN_HANG_TIMEOUT_S,
    MIN_MEMORY_PER_SLICE_BYTES,
    MIN_POLL_INTERVAL_S,
    AllocationPolicy,
    ComputeAction,
    Config,
    DeviceIdStrategy,
    DeviceListStrategy,
    MemoryAction,
    MigStrategy,
    RecoveryPolicy,
)
from deviceplugin.config.reader import format_duration, format_size

Schema = dict[str, Any]

# NVIDIA's names for the allocation policies, accepted as synonyms.
_POLICY_SYNONYMS = ("packed", "distributed")
_NVIDIA_TOP_KEYS = ("version", "flags", "resources", "sharing", "imex", "health")
# Any of these makes a file NVIDIA's (the parser also matches them ignoring case, as Go does).
_NVIDIA_ONLY_TOP_KEYS = ("flags", "sharing", "resources", "imex")

_DURATION_PATTERN = (
    r"^\s*(\+?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+|[+-]?(0+(\.0*)?|\.0+))\s*$"
)
# An absolute path kept as os.path.normpath writes it (no "//", "." or ".." part, no trailing
# "/"), without commas or colons: the MPS root, which containers get at the same path.
_MPS_ROOT_PATTERN = r"^/[^,:\n]*$"
_NOT_NORMALISED_PATTERN = r"//|/\.\.?(/|$)|./$"
_SIZE_PATTERN = r"^\s*(\d+(\.\d*)?|\.\d+)\s*(B|k|K|M|G|T|Ki|KiB|Mi|MiB|Gi|GiB|Ti|TiB)?$"
# An extended resource name as the kubelet checks it: <DNS subdomain>/<qualified name>.
_RESOURCE_NAME_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def _section(description: str, properties: Schema, **extra: Any) -> Schema:
    """A mapping with exactly these keys; null stands for an empty section, as in the parser."""
    return {
        "type": ["object", "null"],
        "description": description,
        "properties": properties,
        "additionalProperties": False,
        **extra,
    }


def _duration(
    description: str,
    default_s: float,
    minimum_s: float = 0.0,
    maximum_s: float = MAX_DURATION_S,
) -> Schema:
    schema: Schema = {
        "description": f"{description} A duration with a unit: 500ms, 2s, 1m30s.",
        "anyOf": [{"type": "string", "pattern": _DURATION_PATTERN}, {"const": 0}],
        "default": format_duration(default_s),
        "x-minimumSeconds": minimum_s,
        "x-maximumSeconds": maximum_s,
    }
    if minimum_s > 0:
        schema["description"] += f" At least {format_duration(minimum_s)}."
    schema["description"] += f" At most {format_duration(maximum_s)}."
    return schema


def _size(description: str, minimum_bytes: int = 1, zero: bool = False) -> Schema:
    schema: Schema = {
        "description": f"{description} A size: 10Gi, 512Mi, 1G, or a whole number of bytes.",
        "anyOf": [
            {"type": "string", "pattern": _SIZE_PATTERN},
            {"type": "integer", "minimum": minimum_bytes},
        ],
    }
    if zero:
        schema["anyOf"].append({"const": 0})
    if minimum_bytes > 1:
        schema["x-minimumBytes"] = minimum_bytes
        schema["description"] += f" At least {format_size(minimum_bytes)}."
    return schema


def _dra_section(d: Any) -> Schema:
    """`dra`: the DRA driver (docs/dra.md)."""

    def percent(description: str, default: int | None) -> Schema:
        schema: Schema = {
            "description": description,
            "type": "integer",
            "minimum": 1,
            "maximum": 100,
        }
        if default is not None:
            schema["default"] = default
        return schema

    return _section(
        "DRA mode (serve --kubelet-api dra): the driver's name and what a claim may ask of one"
        " device's capacities.",
        {
            "driverName": {
                "description": "The DRA driver's name: a DNS subdomain that starts with a "
                "letter (it is the vendor of the claims' CDI kind).",
                "type": "string",
                "maxLength": 63,
                "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                "default": d.dra.driver_name,
            },
            "memory": _section(
                "Request policy of a device's memory.",
                {
                    "min": _size("The smallest amount a claim gets."),
                    "step": _size("Amounts are rounded up to min + a multiple of this."),
                    "default": _size(
                        "What a claim naming no memory gets; absent: one slice's memory."
                    ),
                },
            ),
            "compute": _section(
                "Request policy of a device's compute, in percent of the device.",
                {
                    "min": percent("The smallest share a claim gets.", d.dra.compute_min),
                    "step": percent(
                        "Shares are rounded up to min + a multiple of this.", d.dra.compute_step
                    ),
                    "default": percent(
                        "What a claim naming no compute gets; absent: one slice's share.", None
                    ),
                },
            ),
        },
    )


def _choice(description: str, options: tuple[str, ...], default: str) -> Schema:
    return {"description": description, "enum": list(options), "default": default}


def _boolean(description: str, default: bool) -> Schema:
    return {"description": description, "type": "boolean", "default": default}


def _xids(description: str, default: tuple[int, ...]) -> Schema:
    return {
        "description": description,
        "type": ["array", "null"],
        "items": {"type": "integer", "minimum": 1},
        "uniqueItems": True,
        "default": list(default),
    }


def _slice_rule() -> Schema:
    return {
        "replicas": {
            "description": "Slices per GPU: each gets 1/replicas of its memory and compute.",
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_REPLICAS,
        },
        "memoryPerSlice": _size(
            "Memory of one slice; replicas follow from the GPU's memory.",
            MIN_MEMORY_PER_SLICE_BYTES,
        ),
    }


def _vgpu_schema() -> Schema:
    d = Config()
    e = d.enforcement
    h = d.health
    strategies = [s.value for s in DeviceListStrategy]
    match = _section(
        "Which GPUs the override applies to; every key given must match.",
        {
            "model": {"description": "A glob on the GPU's name.", "type": "string", "minLength": 1},
            "index": {"description": "The GPU's index.", "type": "integer", "minimum": 0},
            "uuid": {"description": "The GPU's UUID.", "type": "string", "minLength": 1},
            "profile": {
                "description": "A glob on a MIG device's profile, e.g. 1g.10gb; an override with a"
                " profile applies to MIG devices only, one without to full GPUs only.",
                "type": "string",
                "minLength": 1,
            },
        },
        minProperties=1,
    )
    match["type"] = "object"
    override: Schema = {
        "type": "object",
        "properties": {"match": match, **_slice_rule()},
        "additionalProperties": False,
        "required": ["match"],
        "oneOf": [{"required": ["replicas"]}, {"required": ["memoryPerSlice"]}],
    }
    slicing = _section(
        "How each GPU is split into slices.",
        {
            **_slice_rule(),
            "overrides": {
                "description": "Per-GPU exceptions; the first that matches a GPU wins.",
                "type": ["array", "null"],
                "items": override,
                "default": [],
            },
        },
        **{"not": {"required": ["replicas", "memoryPerSlice"]}},
    )
    slicing["properties"]["replicas"]["default"] = d.slicing.default.replicas
    allocation = _section(
        "How slices are chosen and handed to a container.",
        {
            "policy": _choice(
                "pack: onto the GPU with the most used slices; spread: onto as many GPUs as"
                " possible. NVIDIA's packed and distributed are accepted.",
                (*(p.value for p in AllocationPolicy), *_POLICY_SYNONYMS),
                d.allocation.policy.value,
            ),
            "deviceListStrategy": {
                "description": "How a container gets its GPUs: one strategy or a list of them.",
                "anyOf": [
                    {"enum": strategies},
                    {
                        "type": "array",
                        "items": {"enum": strategies},
                        "minItems": 1,
                        "uniqueItems": True,
                    },
                ],
                "default": [s.value for s in d.allocation.device_list_strategy],
            },
            "deviceIDStrategy": _choice(
                "What the container runtime is told a GPU is called: uuid (GPU-..., MIG-...) or"
                " index (NVML's: 0, or 0:1 for a MIG device), as NVIDIA's deviceIDStrategy.",
                tuple(s.value for s in DeviceIdStrategy),
                d.allocation.device_id_strategy.value,
            ),
            "frameworkHints": _boolean(
                "Tell frameworks their share: XLA_PYTHON_CLIENT_MEM_FRACTION,"
                " TF_FORCE_GPU_ALLOW_GROWTH and VGPU_MEMORY_FRACTION_<i>.",
                d.allocation.framework_hints,
            ),
            "contextReserve": {
                **_size(
                    "Memory kept out of the framework hints for the CUDA context; 0 for none.",
                    zero=True,
                ),
                "default": format_size(d.allocation.context_reserve_bytes),
            },
        },
    )
    enforcement = _section(
        "What happens to a container that uses more than its slices.",
        {
            "pollInterval": _duration(
                "How often GPU memory and utilisation are measured.",
                e.poll_interval_s,
                MIN_POLL_INTERVAL_S,
                MAX_POLL_INTERVAL_S,
            ),
            "idlePollInterval": _duration(
                "How often while no slice is allocated and no GPU process runs (never faster "
                "than pollInterval).",
                e.idle_poll_interval_s,
                MIN_POLL_INTERVAL_S,
                MAX_POLL_INTERVAL_S,
            ),
            "dryRun": _boolean("Decide, log and count every action; send no signal.", e.dry_run),
            "memory": _section(
                "A container above its memory limit.",
                {
                    "action": _choice(
                        "kill: SIGKILL its largest GPU process after gracePeriod; monitor: record.",
                        tuple(a.value for a in MemoryAction),
                        e.memory.action.value,
                    ),
                    "gracePeriod": _duration(
                        "How long a container may stay above its limit.", e.memory.grace_period_s
                    ),
                },
            ),
            "compute": _section(
                "A container above its compute share while others want the GPU.",
                {
                    "action": _choice(
                        "throttle: a SIGSTOP/SIGCONT duty cycle; monitor: record.",
                        tuple(a.value for a in ComputeAction),
                        e.compute.action.value,
                    ),
                    "window": _duration(
                        "Utilisation is averaged over this window; at least one period.",
                        e.compute.window_s,
                    ),
                    "period": _duration(
                        "The length of one stop/resume cycle.",
                        e.compute.period_s,
                        MIN_COMPUTE_PERIOD_S,
                    ),
                    "workConserving": _boolean(
                        "Let containers use GPU time nobody else wants.", e.compute.work_conserving
                    ),
                },
            ),
        },
    )
    mps = _section(
        "CUDA MPS: one control daemon for the node, run and supervised by the daemon, and its"
        " pipe directory and limits in each container.",
        {
            "enabled": _boolean("Run the MPS control daemon and hand it out.", d.mps.enabled),
            "root": {
                "description": "Where the pipe, log and shm directories are (<root>/pipe is"
                " mounted into containers at the same path): an absolute, normalised path"
                " without commas or colons.",
                "type": "string",
                "pattern": _MPS_ROOT_PATTERN,
                "not": {"pattern": _NOT_NORMALISED_PATTERN},
                "default": d.mps.root,
            },
            "controlCommand": {
                "description": "The MPS control command, run with -f (in the foreground).",
                "type": "string",
                "minLength": 1,
                "not": {"pattern": r"^\s*$"},
                "default": d.mps.control_command,
            },
        },
    )
    node_labels = _section(
        "Node labels through a node feature discovery feature file.",
        {
            "file": {
                "description": "The feature file's name (no path), e.g. vgpu: written only in"
                " the directory the daemon was started with (--node-features-dir); empty keeps"
                " none.",
                "type": "string",
                "pattern": "^([A-Za-z0-9_-][A-Za-z0-9_.-]*)?$",
                "maxLength": 200,
                "default": d.node_labels.file,
            },
            "path": {
                "description": "The old spelling: an absolute path, read as file: <its name>"
                " and written only when its directory is the daemon's --node-features-dir.",
                "type": "string",
                "pattern": "^(/.*)?$",
                "deprecated": True,
            },
        },
    )
    mig = _section(
        "GPUs in MIG mode.",
        {
            "strategy": _choice(
                "none: left out; single: every MIG device sliced under resourceName (one"
                " profile on the node); mixed: one resource per profile, nvidia.com/mig-<profile>.",
                tuple(m.value for m in MigStrategy),
                d.mig.strategy.value,
            ),
        },
    )
    health = _section(
        "GPU health from NVML's Xid and ECC events (nvml backend).",
        {
            "enabled": _boolean("Take a GPU out of service on a critical event.", h.enabled),
            "ignoredXids": _xids(
                "Xids caused by applications (replaces the default).", h.ignored_xids
            ),
            "additionalIgnoredXids": _xids(
                "Xids to ignore on top of ignoredXids.", h.additional_ignored_xids
            ),
            "criticalXids": _xids("Xids that always take a GPU out of service.", h.critical_xids),
            "recovery": _choice(
                "manual: a failed GPU stays out until restart; auto: back after recoveryDelay.",
                tuple(p.value for p in RecoveryPolicy),
                h.recovery.value,
            ),
            "recoveryDelay": _duration(
                "Fault-free time before a GPU returns (recovery: auto).", h.recovery_delay_s
            ),
            "hangTimeout": _duration(
                "A GPU whose NVML call hangs this long is unhealthy.",
                h.hang_timeout_s,
                MIN_HANG_TIMEOUT_S,
            ),
        },
    )
    return _section(
        "vgpu's own config format.",
        {
            "version": {"description": "The format's version.", "const": "v1", "default": "v1"},
            "resourceName": {
                "description": "The extended resource pods request, e.g. nvidia.com/vgpu.",
                "type": "string",
                "pattern": _RESOURCE_NAME_PATTERN,
                "not": {"pattern": r"kubernetes\.io/|^requests\."},
                "default": d.resource_name,
            },
            "slicing": slicing,
            "allocation": allocation,
            "enforcement": enforcement,
            "mps": mps,
            "health": health,
            "nodeLabels": node_labels,
            "mig": mig,
            "dra": _dra_section(d),
        },
    )


def config_schema() -> Schema:
    """The JSON Schema (draft 2020-12) of a config file, as JSON data."""
    vgpu_only = [k for k in _vgpu_schema()["properties"] if k not in _NVIDIA_TOP_KEYS]
    nvidia = {
        "type": "object",
        "description": "NVIDIA k8s-device-plugin's format, read as NVIDIA's plugin reads it"
        " (check-config checks it in full). Keys NVIDIA's plugin does not know are ignored with"
        " a warning, as it ignores them; vgpu's own keys are refused.",
        "properties": {
            **{key: {} for key in _NVIDIA_TOP_KEYS},
            **dict.fromkeys(vgpu_only, False),
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "vgpu device plugin config",
        "description": "Every key is optional; unknown keys are errors. See docs/design.md §7.",
        "$defs": {"vgpu": _vgpu_schema(), "nvidia": nvidia},
        "if": {
            "type": "object",
            "anyOf": [{"required": [key]} for key in _NVIDIA_ONLY_TOP_KEYS],
        },
        "then": {"$ref": "#/$defs/nvidia"},
        "else": {"$ref": "#/$defs/vgpu"},
    }
