"""vgpu's own config format (`version: v1`), read into a Config from the keys' declarations
(`keys`, `model`): each key's value is read by its kind, within its bounds, into the field that
declares it. Written by hand here: the checks of strings (`_CHECKS`), the sections whose keys
depend on each other (slicing, nodeLabels: `_SECTIONS`) and the rules across keys (`_RULES`).
Every problem is recorded on the _Reader with its key path; parse_config raises them together.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from deviceplugin.config.health import HealthConfig
from deviceplugin.config.keys import (
    Boolean,
    Choice,
    Const,
    Duration,
    Group,
    Integer,
    Node,
    OneOrMore,
    Section,
    Size,
    Text,
    XidList,
    keys_of,
)
from deviceplugin.config.memory import MemoryLimitsConfig, ResourceMemoryLimit
from deviceplugin.config.model import (
    DEFAULT_MPS_CONTROL_COMMAND,
    DEFAULT_MPS_ROOT,
    NFD_FEATURE_NAME,
    AllocationConfig,
    ComputeEnforcement,
    Config,
    GpuMatch,
    NodeLabelsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.config.reader import (
    _join,
    _Reader,
    _resource_name_problem,
    _show,
    format_duration,
    format_size,
)
from deviceplugin.config.values import (
    MAX_REPLICAS,
    MIN_MEMORY_PER_SLICE_BYTES,
    AllocationPolicy,
    DeviceListStrategy,
    MigStrategy,
)


def _names(nodes: tuple[Node, ...]) -> tuple[str, ...]:
    return tuple(node.name for node in nodes)


_TOP_KEYS = _names(keys_of(Config))
_SLICING_KEYS = _names(keys_of(SlicingConfig))
_OVERRIDE_KEYS = _names(keys_of(SliceOverride))
_MEMORY_LIMIT_KEYS = _names(keys_of(ResourceMemoryLimit))


def _declared_size(cls: type, name: str) -> Size:
    """The Size a key of `cls` is declared with."""
    kind = next(n.declared.kind for n in keys_of(cls) if n.name == name)
    assert isinstance(kind, Size), f"{name} is not a size"
    return kind


_LIMIT_PER_SLICE = _declared_size(ResourceMemoryLimit, "limitPerSlice")
_MATCH_KEYS = _names(keys_of(GpuMatch))
_NODE_LABELS_KEYS = _names(keys_of(NodeLabelsConfig))
# What NVIDIA's format shares with vgpu's: the allocation policies (with NVIDIA's names) and the
# MIG strategies.
_POLICY = next(n.declared.kind for n in keys_of(AllocationConfig) if n.name == "policy")
assert isinstance(_POLICY, Choice)
_POLICIES = {name: AllocationPolicy(value) for name, value in _POLICY.options().items()}
_MIG_STRATEGIES = {s.value: s for s in MigStrategy}
# A DRA driver's name: a DNS subdomain (the kubelet's plugin name, a ResourceSlice's driver).
_DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


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


def _slicing(r: _Reader, value: object, path: str) -> SlicingConfig:
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


def _memory_limits(r: _Reader, value: object, path: str) -> MemoryLimitsConfig:
    """memoryLimits: each resource once, with its limit per slice."""
    section = r.section(value, path, ("resources",))
    found: list[ResourceMemoryLimit] = []
    items_path = _join(path, "resources")
    for i, item in enumerate(r.items(section.get("resources"), items_path)):
        item_path = f"{items_path}[{i}]"
        rule = r.section(item, item_path, _MEMORY_LIMIT_KEYS)
        if not isinstance(item, dict):
            continue
        missing = [k for k in _MEMORY_LIMIT_KEYS if k not in rule]
        if missing:
            r.error(item_path, f"needs {' and '.join(missing)}")
            continue
        resource = _checked(r, rule["resource"], f"{item_path}.resource", _resource_name_problem)
        limit = _size(r, rule["limitPerSlice"], f"{item_path}.limitPerSlice", _LIMIT_PER_SLICE)
        if resource is None or limit is None:
            continue
        if any(f.resource == resource for f in found):
            r.error(item_path, f"resource {resource} is listed twice")
            continue
        found.append(ResourceMemoryLimit(resource, limit))
    return MemoryLimitsConfig(resources=tuple(found))


def _mps_root_problem(root: str) -> str | None:
    if not root.startswith("/"):
        return f"{_show(root)} is not an absolute path (e.g. {DEFAULT_MPS_ROOT})"
    # Containers get <root>/pipe at the same path: keep it a plain, normalised path.
    if os.path.normpath(root) != root or any(c in root for c in ",:\n"):
        return f"{_show(root)} is not a normalised path without commas or colons"
    return None


def _mps_root(r: _Reader, value: object, path: str) -> str | None:
    """mps.root, or NVIDIA's flags.mpsRoot: an absolute, normalised path."""
    return _checked(r, value, path, _mps_root_problem)


def feature_file_name_problem(name: str) -> str | None:
    """Why `name` cannot name the node feature file (a file name, not a path), or None."""
    if "/" in name:
        return "is a path, not a file name: the file is written in the daemon's --node-features-dir"
    if name.startswith("."):
        return "starts with a dot (NFD skips hidden files; the daemon's temporary files are hidden)"
    if len(name) > 200:
        return "is longer than 200 characters"
    if not name.isascii() or not all(c.isalnum() or c in "-_." for c in name):
        return "has characters other than letters, digits, '-', '_' and '.'"
    return None


def _node_labels(r: _Reader, value: object, where: str) -> NodeLabelsConfig:
    section = r.section(value, where, _NODE_LABELS_KEYS)
    if "file" in section and section.get("path", "") != "":
        r.error("nodeLabels", "sets both file and path; keep file (path is the old spelling)")
        return NodeLabelsConfig()
    if section.get("file", "") != "":
        name = r.string(section["file"], "nodeLabels.file")
        problem = None if name is None else feature_file_name_problem(name)
        if problem is not None:
            r.error("nodeLabels.file", f"{_show(name)} {problem}; use e.g. {NFD_FEATURE_NAME}")
            return NodeLabelsConfig()
        return NodeLabelsConfig(file=name or "")
    if section.get("path", "") == "":
        return NodeLabelsConfig()
    path = r.string(section["path"], "nodeLabels.path")
    if path is None:
        return NodeLabelsConfig()
    directory, _, name = path.rpartition("/")
    problem = feature_file_name_problem(name) if name else "has no file name"
    if not path.startswith("/") or os.path.normpath(path) != path or problem is not None:
        r.error(
            "nodeLabels.path",
            f"{_show(path)} is not an absolute, normalised path to a file"
            f"{'' if problem is None else f' (its file name {problem})'}; "
            f"use nodeLabels.file: {NFD_FEATURE_NAME} instead",
        )
        return NodeLabelsConfig()
    r.warn(
        f"nodeLabels.path is the old spelling: it is read as nodeLabels.file: {name}, and the "
        f"file is written only when the daemon's --node-features-dir is {directory or '/'}; "
        f"write nodeLabels.file: {name} instead"
    )
    return NodeLabelsConfig(file=name, legacy_directory=directory or "/")


# The API server's limit on a DRA driver's name.
MAX_DRIVER_NAME_LENGTH = 63


def driver_name_problem(name: str) -> str | None:
    """Why `name` cannot be a DRA driver's name here; None when it can. Besides the API
    server's rules (a DNS subdomain of at most 63 characters), it names the CDI kind of each
    claim's spec (`<name>/claim`), and a CDI vendor must start with a letter."""
    if not _DRIVER_NAME.fullmatch(name):
        return f"{_show(name)} is not a DNS subdomain like vgpu.dev"
    if len(name) > MAX_DRIVER_NAME_LENGTH:
        return f"{_show(name)} is longer than {MAX_DRIVER_NAME_LENGTH} characters"
    if not name[0].isalpha():
        return (
            f"{_show(name)} starts with a digit: it names the CDI kind of each claim's spec "
            f"({name}/claim), and a CDI vendor must start with a letter, so the container "
            "runtime would refuse every claim's container; use a name that starts with a "
            "letter, like gpu.example.com"
        )
    return None


def _read_section(r: _Reader, cls: type[Any], value: object, path: str) -> Any:
    """The section `cls` declares, read from `value`; a key whose value is bad keeps its
    default (the problem is recorded)."""
    if cls in _SECTIONS:
        return _SECTIONS[cls](r, value, path)
    nodes = keys_of(cls)
    section = r.section(value, path, _names(nodes))
    values: dict[str, object] = {}
    _read_keys(r, nodes, section, path, values, rules=_RULES.get(cls, {}))
    return replace(cls(), **values)


def _read_keys(
    r: _Reader,
    nodes: tuple[Node, ...],
    section: Mapping[str, object],
    path: str,
    values: dict[str, object],
    *,
    rules: Mapping[str, Rule],
) -> None:
    """Each key of `nodes` given in `section` into `values`, by field; a rule across keys runs
    after the key it follows."""
    for node in nodes:
        key_path = _join(path, node.name)
        kind = node.declared.kind
        if isinstance(kind, Section):
            values[node.attribute] = _read_section(r, kind.of, section.get(node.name), key_path)
        elif isinstance(kind, Group):
            group = r.section(section.get(node.name), key_path, _names(node.children))
            _read_keys(r, node.children, group, key_path, values, rules={})
        elif node.name in section:
            value = _read_value(r, node, section[node.name], key_path)
            if value is not None:
                values[node.attribute] = value
        if node.name in rules:
            rules[node.name](r, path, section, values)


def _read_value(r: _Reader, node: Node, value: object, path: str) -> object:
    """A key's value as its kind reads it, or None (the problem recorded)."""
    kind = node.declared.kind
    if isinstance(kind, Boolean):
        return r.boolean(value, path)
    if isinstance(kind, Integer):
        return r.integer(value, path, kind.minimum, kind.maximum)
    if isinstance(kind, Duration):
        return r.duration(value, path, kind.minimum_s, kind.maximum_s)
    if isinstance(kind, Size):
        return _size(r, value, path, kind)
    if isinstance(kind, Choice):
        return r.choice(value, path, kind.options(), kind.shown())
    if isinstance(kind, OneOrMore):
        assert kind.values is DeviceListStrategy, "the reader knows deviceListStrategy's list"
        return r.strategies(value, path)
    if isinstance(kind, XidList):
        return r.xids(value, path)
    if isinstance(kind, Const):
        return r.const(value, path, kind.value)
    assert isinstance(kind, Text), f"{path}: no reader for {kind}"
    return _checked(r, value, path, _CHECKS.get(path))


def _size(r: _Reader, value: object, path: str, kind: Size) -> int | None:
    if kind.zero and ((value == 0 and not isinstance(value, bool)) or value == "0"):
        return 0
    size = r.size(value, path)
    if size is not None and size < kind.minimum_bytes:
        r.error(path, f"{_show(value)} is too small (must be >= {format_size(kind.minimum_bytes)})")
        return None
    return size


def _checked(
    r: _Reader, value: object, path: str, problem_of: Callable[[str], str | None] | None
) -> str | None:
    """A non-empty string, and what `problem_of` finds wrong with it, if anything."""
    text = r.string(value, path)
    problem = None if text is None or problem_of is None else problem_of(text)
    if problem is not None:
        r.error(path, problem)
        return None
    return text


# Rules across keys: each runs after the key it is listed under, as (reader, the section's path,
# its raw keys, the values read so far by field).
Rule = Callable[[_Reader, str, Mapping[str, object], dict[str, object]], None]


def _window_holds_a_period(
    r: _Reader, path: str, section: Mapping[str, object], values: dict[str, object]
) -> None:
    """enforcement.compute: the window must hold at least one duty cycle."""
    defaults = ComputeEnforcement()
    # A key given with a bad value is None here: its problem is already recorded.
    window = values.get("window_s", None if "window" in section else defaults.window_s)
    period = values.get("period_s", None if "period" in section else defaults.period_s)
    if isinstance(window, float) and isinstance(period, float) and window < period:
        r.error(
            _join(path, "window"),
            f"{format_duration(window)} is shorter than period {format_duration(period)}"
            " (the window must hold at least one duty cycle)",
        )


def _xids_listed_once(
    r: _Reader, path: str, section: Mapping[str, object], values: dict[str, object]
) -> None:
    """health: criticalXids wins over the default ignore list; an Xid written both as ignored
    and as critical is a contradiction."""
    defaults = HealthConfig()
    critical = values.get("critical_xids", defaults.critical_xids)
    for key, attribute in (
        ("ignoredXids", "ignored_xids"),
        ("additionalIgnoredXids", "additional_ignored_xids"),
    ):
        if key not in section:
            continue
        listed = values.get(attribute, getattr(defaults, attribute))
        assert isinstance(critical, tuple)
        assert isinstance(listed, tuple)
        both = [x for x in critical if x in listed]
        if both:
            shown = ", ".join(str(x) for x in both)
            r.error(
                _join(path, "criticalXids"),
                f"{shown} also listed in {_join(path, key)}; list each Xid in one of them",
            )


def _control_command_problem(command: str) -> str | None:
    if not command.strip():
        return f"is empty (the default is {DEFAULT_MPS_CONTROL_COMMAND})"
    return None


def _canary_command_problem(command: str) -> str | None:
    try:
        shlex.split(command)
    except ValueError as e:
        return f"is not a command line: {e}"
    return None


_RULES: dict[type, dict[str, Rule]] = {
    ComputeEnforcement: {"period": _window_holds_a_period},
    HealthConfig: {"criticalXids": _xids_listed_once},
}
# What the parser checks of a string key beyond its being a non-empty string, by key path.
_CHECKS: dict[str, Callable[[str], str | None]] = {
    "resourceName": _resource_name_problem,
    "mps.root": _mps_root_problem,
    "mps.controlCommand": _control_command_problem,
    "mps.canaryCommand": _canary_command_problem,
    "dra.driverName": driver_name_problem,
}
# Sections read by hand: their keys depend on each other.
_SECTIONS: dict[type, Callable[[_Reader, object, str], Any]] = {
    SlicingConfig: _slicing,
    NodeLabelsConfig: _node_labels,
    MemoryLimitsConfig: _memory_limits,
}


def _parse_vgpu(r: _Reader, data: object) -> Config:
    config: Config = _read_section(r, Config, data, "")
    return config
