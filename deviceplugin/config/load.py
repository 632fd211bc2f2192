"""From a file to a Config: parse_config, which tells vgpu's format from NVIDIA's, and the
reading of a file's bytes as YAML with its safety checks (UTF-8, no key written twice, bounded
nesting, no integer too long to convert), each failure a ConfigError naming the file.

The YAML is read by libyaml (PyYAML's C loader), the scanner NVIDIA's plugin uses too (Go's
yaml.v2 is a port of it): both skip a tab between tokens inside a flow collection or after a
key's colon, so that tab-indented JSON, which PyYAML's pure-Python scanner refuses, reads the same
in vgpu as in NVIDIA's plugin. Without libyaml the pure-Python loader is used.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import yaml

from deviceplugin.config.model import (
    Config,
)
from deviceplugin.config.reader import (
    _Reader,
    _show,
)
from deviceplugin.config.vgpu import _TOP_KEYS, _parse_vgpu
from deviceplugin.errors import ConfigError

# Top-level keys that only NVIDIA k8s-device-plugin's format has (Go matches them ignoring case):
# nvidia.py's _NV_TOP_KEYS less vgpu's _TOP_KEYS, written out so that reading a vgpu file does
# not import NVIDIA's format (the daemon's start-up is that much shorter).
_NVIDIA_ONLY_KEYS = frozenset({"flags", "resources", "sharing", "imex"})


def is_nvidia_config(data: object) -> bool:
    """Whether YAML-loaded data is NVIDIA k8s-device-plugin's format: it has a top-level key of
    NVIDIA's that vgpu's format lacks (flags, sharing, resources or imex, in any case, as NVIDIA's
    plugin matches them). version and health are in both formats; a file with only those is
    vgpu's."""
    return isinstance(data, dict) and any(str(k).lower() in _NVIDIA_ONLY_KEYS for k in data)


def parse_config(data: object, source: str = "config") -> Config:
    """A Config from YAML-loaded data (None: all defaults). Both vgpu's format and NVIDIA
    k8s-device-plugin's (see is_nvidia_config) are read; an NVIDIA file means what NVIDIA's
    plugin makes of it, or a warning names the difference.

    Raises ConfigError listing every problem, each naming its key path and the bad value. Settings
    that are valid but that vgpu does not act on are returned in `Config.warnings`."""
    if is_nvidia_config(data):
        from deviceplugin.config.nvidia import _NV_TOP_KEYS, _parse_nvidia  # noqa: PLC0415

        assert isinstance(data, dict)
        hint = (
            " (this file is read as NVIDIA k8s-device-plugin config because it has a top-level"
            " flags, sharing, resources or imex key; vgpu keys cannot be mixed into it: NVIDIA's"
            " plugin would ignore them, vgpu refuses them so that none seems in force that is"
            " not; to use them, write the file in vgpu's format)"
        )
        reader = _Reader(
            null_is_absent=True,
            top_level_hints=dict.fromkeys([k for k in _TOP_KEYS if k not in _NV_TOP_KEYS], hint),
            lenient_keys=True,
        )
        config = _parse_nvidia(reader, data)
    else:
        reader = _Reader()
        config = _parse_vgpu(reader, data)
    if reader.problems:
        raise ConfigError(reader.problems, source)
    return replace(config, warnings=tuple(reader.warnings))


# libyaml where PyYAML has it (the wheels on PyPI do); the tests check that it is there.
try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]
HAS_LIBYAML: bool = yaml.__with_libyaml__


class _UniqueKeyLoader(_SafeLoader):
    """The safe loader that refuses a key written twice in one mapping (PyYAML would silently keep
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


def is_empty_document(content: bytes) -> bool:
    """Whether the content holds no YAML value (nothing, blanks, comments, `---`, `null`): what a
    file being written or truncated reads as. `{}` is not empty."""
    try:
        loader = _UniqueKeyLoader(content.decode("utf-8"))
    except UnicodeDecodeError:
        return False
    try:
        return loader.get_single_data() is None
    except (yaml.YAMLError, RecursionError, ValueError):
        return False
    finally:
        loader.dispose()


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
        if "maximum nesting depth" in what:  # libyaml's bound
            what = "invalid YAML: nested too deep"
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
