"""A config as commented YAML, written from the keys' declarations (`keys`, `model`): every key
of vgpu's format with its description, its value, and an example where it has no default. The
built-in defaults so written are the DaemonSet's ConfigMap (tools/gen_daemonset_config.py) and
parse back to the defaults of `model`.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from enum import StrEnum

import yaml

from deviceplugin.config.keys import (
    Duration,
    Group,
    Node,
    Section,
    Size,
    Text,
    keys_of,
)
from deviceplugin.config.model import Config, NodeLabelsConfig
from deviceplugin.config.reader import format_duration, format_size

_HEADER = """\
# vgpu device plugin configuration. Every key is optional: the values below are the defaults.
# Durations take a unit (500ms, 2s, 1m); sizes take binary (Ki, Mi, Gi) or decimal (K, M, G) units.
# NVIDIA k8s-device-plugin's config file (sharing.timeSlicing / sharing.mps) is accepted too.
"""
_WIDTH = 100


def default_config_yaml(*, node_labels_file: str = "") -> str:
    """The full default config as commented YAML, for the DaemonSet's ConfigMap and the docs.
    It parses back to Config(), but for `nodeLabels.file` when given (the DaemonSet's config sets
    it to NFD_FEATURE_NAME)."""
    return config_yaml(replace(Config(), node_labels=NodeLabelsConfig(file=node_labels_file)))


def config_yaml(config: Config) -> str:
    """`config` as commented YAML: every key, with its description, at the value `config` has."""
    lines = _HEADER.splitlines()
    for node in keys_of(type(config), config):
        lines += ["", *_lines(node, "")]  # a blank line before each top-level key
    return "\n".join(lines) + "\n"


def _lines(node: Node, indent: str) -> list[str]:
    """A key's lines: its description as a comment, then the key and its value; a key without a
    value is written as a commented example, or not at all."""
    declared = node.declared
    if declared.deprecated:
        return []
    comment = [
        f"{indent}# {line}"
        for line in textwrap.wrap(declared.description, _WIDTH - len(indent) - 2)
    ]
    if isinstance(declared.kind, Section | Group):
        inside = [line for child in node.children for line in _lines(child, indent + "  ")]
        return [*comment, f"{indent}{node.name}:", *inside]
    lines: list[str] = []
    if node.default is not None:
        lines.append(f"{indent}{node.name}: {yaml_value(node)}")
    if declared.example:
        lines.append(f"{indent}# {node.name}: {declared.example}")
    return [*comment, *lines] if lines else []


def yaml_value(node: Node) -> str:
    """A key's value (its default, or the value of the config walked) as YAML."""
    kind, value = node.declared.kind, node.default
    if isinstance(kind, Duration) and isinstance(value, float | int):
        return format_duration(value)
    if isinstance(kind, Size) and isinstance(value, int):
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(kind, Text) and isinstance(value, str):
        return _plain(value)
    return str(value)


def _plain(value: object) -> str:
    """A scalar as YAML: a string unquoted where YAML reads it back as that string."""
    text = value.value if isinstance(value, StrEnum) else str(value)
    if isinstance(value, str) and yaml.safe_load(text) != text:
        return json.dumps(text)
    return text
