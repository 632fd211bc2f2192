"""A config key is declared once, on the field that holds its value, and everything else is made
from that declaration: a key added there alone is read by the parser within its bounds, described
by the JSON Schema, written in the commented defaults and listed in the docs' key table."""

from __future__ import annotations

from dataclasses import dataclass

import jsonschema
import pytest
import yaml

from deviceplugin.config import Config, parse_config
from deviceplugin.config.defaults import config_yaml
from deviceplugin.config.keys import Duration, Integer, key, keys_of, section
from deviceplugin.config.reader import _Reader
from deviceplugin.config.schema import vgpu_schema
from deviceplugin.config.vgpu import _read_section
from deviceplugin.errors import ConfigError
from tools.gen_docs_tables import config_table


@dataclass(frozen=True, slots=True)
class Bursts:
    """A section no config has: the test's own."""

    length_s: float = key(
        "length", 1.5, Duration(0.1, 10.0), "How long a burst may last beyond its share."
    )
    count: int = key("count", 3, Integer(1, 9), "How many bursts a window allows.")


@dataclass(frozen=True, slots=True)
class Extended(Config):
    """Config with one more section, declared as every section is."""

    bursts: Bursts = section("bursts", Bursts, "Short bursts above a container's share.")


def parse(data: object) -> Extended:
    reader = _Reader()
    config: Extended = _read_section(reader, Extended, data, "")
    if reader.problems:
        raise ConfigError(reader.problems)
    return config


def test_the_parser_reads_a_new_key_within_its_bounds() -> None:
    assert parse(None).bursts == Bursts()
    config = parse({"bursts": {"length": "250ms", "count": 9}})
    assert config.bursts == Bursts(length_s=0.25, count=9)
    with pytest.raises(ConfigError) as refused:
        parse({"bursts": {"length": "20s", "count": 0, "size": 1}})
    assert refused.value.problems == [
        'bursts: unknown key "size" (expected one of: count, length)',
        'bursts.length: "20s" is too long (must be <= 10s)',
        "bursts.count: 0 is too small (must be >= 1)",
    ]


def test_the_schema_describes_a_new_key() -> None:
    schema = vgpu_schema(Extended)
    bursts = schema["properties"]["bursts"]
    assert bursts["description"] == "Short bursts above a container's share."
    assert bursts["properties"]["length"]["default"] == "1.5s"
    assert bursts["properties"]["length"]["x-maximumSeconds"] == 10.0
    assert bursts["properties"]["count"] == {
        "description": "How many bursts a window allows.",
        "type": "integer",
        "minimum": 1,
        "maximum": 9,
        "default": 3,
    }
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"bursts": {"count": 4}})
    assert not validator.is_valid({"bursts": {"count": 10}})
    assert not validator.is_valid({"bursts": {"size": 1}})


def test_the_commented_defaults_hold_a_new_key() -> None:
    text = config_yaml(Extended())
    assert "# Short bursts above a container's share.\nbursts:\n" in text
    assert "  # How many bursts a window allows.\n  count: 3\n" in text
    assert parse(yaml.safe_load(text)) == Extended()


def test_the_docs_table_lists_a_new_key() -> None:
    table = config_table(keys_of(Extended))
    assert (
        "| `bursts.length` | `1.5s` | a duration, 100ms to 10s "
        "| How long a burst may last beyond its share. |"
    ) in table
    assert "| `bursts.count` | `3` | a whole number, 1 to 9 |" in table


def test_config_itself_is_unchanged_by_the_test() -> None:
    assert "bursts" not in {node.name for node in keys_of(Config)}
    with pytest.raises(ConfigError):
        parse_config({"bursts": {}})
