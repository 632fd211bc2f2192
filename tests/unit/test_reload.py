"""The reload module's pure parts: reading and hashing a config, what changed, its metrics."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from deviceplugin.config import Config, load_config
from deviceplugin.errors import ConfigError
from deviceplugin.reload import ReloadMetrics, config_hash, describe_changes, read_config


def test_read_config_parses_as_load_config_and_hashes_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    content = b"slicing:\n  replicas: 3\nallocation:\n  policy: spread\n"
    path.write_bytes(content)
    loaded = read_config(path)
    assert loaded.config == load_config(path)
    assert loaded.hash == hashlib.sha256(content).hexdigest()[:16] == config_hash(content)


@pytest.mark.parametrize(
    "content",
    [b"slicing:\n  replicas: 0\n", b"slicing: [\n", b"\xff\xfe", b"resourceName: nope\n"],
    ids=["bad value", "bad yaml", "not utf-8", "bad name"],
)
def test_read_config_refuses_with_load_configs_problems(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as expected:
        load_config(path)
    with pytest.raises(ConfigError) as got:
        read_config(path)
    assert got.value.problems == expected.value.problems
    assert got.value.source == str(path)


def test_a_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        read_config(tmp_path / "gone.yaml")


def test_describe_changes_names_the_sections_that_differ(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("resourceName: example.com/gpu\nslicing:\n  replicas: 2\n")
    assert describe_changes(Config(), read_config(path).config) == ["resource_name", "slicing"]
    assert describe_changes(Config(), Config()) == []


def test_reload_metrics_start_at_zero_and_show_one_running_hash() -> None:
    registry = CollectorRegistry()
    metrics = ReloadMetrics(registry, "n1", "aaaa")

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"node": "n1", **labels})

    assert value("vgpu_config_reloads_total", result="applied") == 0
    assert value("vgpu_config_reloads_total", result="refused") == 0
    assert value("vgpu_config_info", hash="aaaa") == 1
    metrics.counted("refused")
    metrics.counted("applied")
    metrics.running("bbbb")
    assert value("vgpu_config_reloads_total", result="refused") == 1
    assert value("vgpu_config_reloads_total", result="applied") == 1
    assert value("vgpu_config_info", hash="bbbb") == 1
    assert value("vgpu_config_info", hash="aaaa") is None


@pytest.mark.parametrize(
    ("content", "empty"),
    [
        (b"", True),
        (b"\n  \n", True),
        (b"# only a comment\n", True),
        (b"---\n", True),
        (b"{}\n", False),
        (b"version: v1\n", False),
        (b"slicing:\n", False),
        (b"\xff", False),  # not UTF-8: refused as such, not as empty
    ],
)
def test_an_empty_document_is_told_from_the_defaults_asked_for(content: bytes, empty: bool) -> None:
    from deviceplugin.config import is_empty_document

    assert is_empty_document(content) is empty
