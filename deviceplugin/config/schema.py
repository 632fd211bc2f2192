"""The JSON Schema of the config file (docs/design.md §7), for editors and `check-jsonschema`.

`vgpu-device-plugin config-schema` prints it. It is written from the keys' declarations (`keys`,
`model`), the parser's too: each key's type, choices, default, bounds and description. Only the
rules across keys are written here by hand (`_RULES`). tests/unit/test_config_schema.py checks
schema and parser against each other in both directions: every key the parser reads is here with
the same type, choices and bounds, every key here is one the parser reads, unknown keys are
refused by both, and the example configs validate.

Durations and sizes are strings with a unit, which JSON Schema cannot compare: their bounds
travel as `x-minimumSeconds`, `x-maximumSeconds` and `x-minimumBytes` and are enforced by the
parser (`check-config`). NVIDIA
k8s-device-plugin's format (a file with a top-level `flags`, `sharing`, `resources` or `imex`) is
described at its top level only; `check-config` checks it in full.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from deviceplugin.config.keys import (
    Boolean,
    Choice,
    Const,
    Duration,
    Group,
    Integer,
    Items,
    Node,
    OneOrMore,
    Section,
    Size,
    Text,
    XidList,
    keys_of,
)
from deviceplugin.config.model import Config, GpuMatch, SliceOverride, SlicingConfig
from deviceplugin.config.reader import format_duration, format_size

Schema = dict[str, Any]

_NVIDIA_TOP_KEYS = ("version", "flags", "resources", "sharing", "imex", "health")
# Any of these makes a file NVIDIA's (the parser also matches them ignoring case, as Go does).
_NVIDIA_ONLY_TOP_KEYS = ("flags", "sharing", "resources", "imex")

_DURATION_PATTERN = (
    r"^\s*(\+?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+|[+-]?(0+(\.0*)?|\.0+))\s*$"
)
_SIZE_PATTERN = r"^\s*(\d+(\.\d*)?|\.\d+)\s*(B|k|K|M|G|T|Ki|KiB|Mi|MiB|Gi|GiB|Ti|TiB)?$"

# Rules across the keys of a mapping, by the dataclass that declares them: the hand-written part.
_RULES: dict[type, Schema] = {
    # replicas or memoryPerSlice, not both.
    SlicingConfig: {"not": {"required": ["replicas", "memoryPerSlice"]}},
    # An override is a match and exactly one of replicas and memoryPerSlice.
    SliceOverride: {
        "type": "object",
        "required": ["match"],
        "oneOf": [{"required": ["replicas"]}, {"required": ["memoryPerSlice"]}],
    },
    # A match names at least one thing to match.
    GpuMatch: {"type": "object", "minProperties": 1},
}


def _section(description: str, properties: Schema, **extra: Any) -> Schema:
    """A mapping with exactly these keys; null stands for an empty section, as in the parser."""
    schema: Schema = {"type": ["object", "null"], "properties": properties}
    if description:
        schema["description"] = description
    return {**schema, "additionalProperties": False, **extra}


def _mapping(node: Node) -> Schema:
    """A section's, a group's or a list item's keys."""
    kind = node.declared.kind
    rules = _RULES.get(kind.of, {}) if isinstance(kind, Section | Items) else {}
    properties = {child.name: _key(child) for child in node.children}
    return _section(node.declared.description if node.name else "", properties, **rules)


def _key(node: Node) -> Schema:
    """The schema of one key, from its declaration."""
    kind, default = node.declared.kind, node.default
    if isinstance(kind, Section | Group):
        return _mapping(node)
    schema: Schema = {"description": node.declared.description}
    if isinstance(kind, Items):
        item = Node("", node.declared, None, node.attribute, node.children)
        schema |= {"type": ["array", "null"], "items": _mapping(item)}
    elif isinstance(kind, Duration):
        return _duration(node.declared.description, node.default, kind)
    elif isinstance(kind, Size):
        schema = _size(node.declared.description, kind)
        default = None if default is None else format_size(default)  # type: ignore[arg-type]
    else:
        schema |= _value(kind)
    if isinstance(kind, Text) and kind.what:
        schema["description"] += f" {kind.what[0].upper()}{kind.what[1:]}."
    if node.declared.deprecated:
        schema["deprecated"] = True
    elif default is not None:
        schema["default"] = _json(default)
    return schema


def _value(kind: Any) -> Schema:
    """What a key of a plain kind takes."""
    if isinstance(kind, Boolean):
        return {"type": "boolean"}
    if isinstance(kind, Integer):
        maximum = {} if kind.maximum is None else {"maximum": kind.maximum}
        return {"type": "integer", "minimum": kind.minimum, **maximum}
    if isinstance(kind, Choice):
        return {"enum": list(kind.options())}
    if isinstance(kind, OneOrMore):
        values = [m.value for m in kind.values]
        many = {"type": "array", "items": {"enum": values}, "minItems": 1, "uniqueItems": True}
        return {"anyOf": [{"enum": values}, many]}
    if isinstance(kind, XidList):
        items = {"type": "integer", "minimum": 1}
        return {"type": ["array", "null"], "items": items, "uniqueItems": True}
    if isinstance(kind, Const):
        return {"const": kind.value}
    assert isinstance(kind, Text), kind
    schema: Schema = {"type": "string"}
    if kind.pattern:
        schema["pattern"] = kind.pattern
    if kind.not_pattern:
        schema["not"] = {"pattern": kind.not_pattern}
    if kind.min_length is not None:
        schema["minLength"] = kind.min_length
    if kind.max_length is not None:
        schema["maxLength"] = kind.max_length
    return schema


def _json(value: object) -> object:
    """A default as the file writes it."""
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if isinstance(value, StrEnum):
        return value.value
    return value


def _duration(description: str, default: Any, kind: Duration) -> Schema:
    schema: Schema = {
        "description": f"{description} A duration with a unit: 500ms, 2s, 1m30s.",
        "anyOf": [{"type": "string", "pattern": _DURATION_PATTERN}, {"const": 0}],
        "default": format_duration(default),
        "x-minimumSeconds": kind.minimum_s,
        "x-maximumSeconds": kind.maximum_s,
    }
    if kind.minimum_s > 0:
        schema["description"] += f" At least {format_duration(kind.minimum_s)}."
    schema["description"] += f" At most {format_duration(kind.maximum_s)}."
    return schema


def _size(description: str, kind: Size) -> Schema:
    schema: Schema = {
        "description": f"{description} A size: 10Gi, 512Mi, 1G, or a whole number of bytes.",
        "anyOf": [
            {"type": "string", "pattern": _SIZE_PATTERN},
            {"type": "integer", "minimum": kind.minimum_bytes},
        ],
    }
    if kind.zero:
        schema["anyOf"].append({"const": 0})
    if kind.minimum_bytes > 1:
        schema["x-minimumBytes"] = kind.minimum_bytes
        schema["description"] += f" At least {format_size(kind.minimum_bytes)}."
    return schema


def vgpu_schema(root: type = Config) -> Schema:
    """The schema of vgpu's format: the keys `root` (Config) declares."""
    properties = {node.name: _key(node) for node in keys_of(root)}
    return _section("vgpu's own config format.", properties)


def config_schema() -> Schema:
    """The JSON Schema (draft 2020-12) of a config file, as JSON data."""
    vgpu_only = [k for k in vgpu_schema()["properties"] if k not in _NVIDIA_TOP_KEYS]
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
        "$defs": {"vgpu": vgpu_schema(), "nvidia": nvidia},
        "if": {
            "type": "object",
            "anyOf": [{"required": [key]} for key in _NVIDIA_ONLY_TOP_KEYS],
        },
        "then": {"$ref": "#/$defs/nvidia"},
        "else": {"$ref": "#/$defs/vgpu"},
    }
