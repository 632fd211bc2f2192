"""The config's JSON Schema agrees with the parser, key by key and value by value, both ways.

The parser (deviceplugin.config) is the authority; the schema is for editors and check-jsonschema.
Each test walks the schema, so a key added to one and not the other fails here: the parser names
the keys it expects in its "unknown key" message, and every leaf gets values that both must
accept and values that both must refuse."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from deviceplugin.config import default_config_yaml, format_duration, parse_config
from deviceplugin.config.schema import _SIZE_PATTERN as SIZE_PATTERN
from deviceplugin.config.schema import config_schema
from deviceplugin.errors import ConfigError
from tests.deploy.support import DEPLOY, ROOT

CHART = DEPLOY / "chart"

SCHEMA = config_schema()
VGPU = SCHEMA["$defs"]["vgpu"]
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
# An override needs a match and a rule; tests that place a key inside one start from this.
OVERRIDE = {"match": {"index": 0}, "replicas": 2}
# A memory limit needs its resource and its limit per slice.
MEMORY_LIMIT = {"resource": "nvidia.com/vgpu", "limitPerSlice": "20Gi"}
# The item a key's list starts from, by the list's key.
ITEMS: dict[str, dict[str, Any]] = {"overrides": OVERRIDE, "resources": MEMORY_LIMIT}
# A duration every duration key accepts: above each minimum, between period and window.
SOME_DURATION = "300ms"

Path = tuple[str, ...]


def objects(schema: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every mapping the schema describes, with its key path ("[]" for a list item)."""
    yield path, schema
    for key, sub in schema["properties"].items():
        if "properties" in sub:
            yield from objects(sub, (*path, key))
        elif "properties" in sub.get("items", {}):
            yield from objects(sub["items"], (*path, key, "[]"))


def leaves(schema: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, dict[str, Any]]]:
    for key, sub in schema["properties"].items():
        if "properties" in sub:
            yield from leaves(sub, (*path, key))
        elif "properties" in sub.get("items", {}):
            yield from leaves(sub["items"], (*path, key, "[]"))
        else:
            yield (*path, key), sub


def place(path: Path, value: object) -> dict[str, Any]:
    """A config with `value` at `path` and nothing else but what that path needs."""
    config: dict[str, Any] = {}
    here: dict[str, Any] = config
    for i, key in enumerate(path[:-1]):
        if key == "[]":
            continue
        if i + 1 < len(path) and path[i + 1] == "[]":
            item = copy.deepcopy(ITEMS[key])
            if (
                key == "overrides"
                and path[-1] in ("replicas", "memoryPerSlice")
                and len(path) == i + 3
            ):
                del item["replicas"]
            here[key] = [item]
            here = item
        else:
            here = here.setdefault(key, {})
    here[path[-1]] = value
    return config


def parser_accepts(data: object) -> bool:
    try:
        parse_config(data)
    except ConfigError:
        return False
    return True


def schema_accepts(data: object) -> bool:
    return bool(VALIDATOR.is_valid(data))


def dotted(path: Path) -> str:
    return ".".join(path).replace(".[]", "[0]")


def test_the_schema_is_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("path", [p for p, _ in objects(VGPU)], ids=dotted)
def test_each_mapping_has_the_keys_the_parser_reads(path: Path) -> None:
    schema = dict(objects(VGPU))[path]
    data = place((*path, "notAKey"), 1)
    assert not schema_accepts(data)
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    # The parser names the keys it expects: exactly the schema's keys.
    found = [m for p in caught.value.problems if (m := re.search(r"expected one of: ([^)]*)", p))]
    assert found, caught.value.problems
    assert set(found[0].group(1).split(", ")) == set(schema["properties"])


def samples(path: Path, schema: dict[str, Any]) -> tuple[list[object], list[object]]:
    """Values the parser and the schema must both accept, and ones both must refuse."""
    good: list[object] = []
    bad: list[object] = [{"a": 1}]
    if "default" in schema:
        good.append(schema["default"])
    if "enum" in schema:
        good += schema["enum"]
        bad += ["notAChoice", 1]
    if "const" in schema:
        good.append(schema["const"])
        bad += ["v0", 1]
    if schema.get("type") == "boolean":
        good += [True, False]
        bad += ["yes", 1]
    if schema.get("type") == "integer":
        good += [schema["minimum"], schema["minimum"] + 7]
        bad += [schema["minimum"] - 1, 1.5, "2", True]
    if schema.get("type") == "string" and "pattern" not in schema:
        good += ["*A100*", "GPU-0a1b"]
        bad += ["", 5]
    if any(a.get("pattern") == SIZE_PATTERN for a in schema.get("anyOf", [])):  # a size
        minimum = schema.get("x-minimumBytes", 1)
        good += ["10Gi", "512Mi", "1G", "1.5Gi", max(minimum, 1024 * 1024)]
        bad += ["10Q", "Gi", -1, True]
        if {"const": 0} in schema["anyOf"]:  # or 0
            good += [0, "0"]
        else:
            bad.append(0)
        if minimum > 1:
            bad += [1024, minimum - 1]
    if "x-minimumSeconds" in schema:  # a duration
        good += [SOME_DURATION, "1m30s" if path[-1] == "window" else SOME_DURATION]
        bad += ["2", "2 seconds", "-1s", True, [1]]
    if path[-1] == "root":
        good += ["/run/vgpu/mps", "/mps"]
        bad += ["run/mps", "/a,b", "/a:b", 5]
    if path[-1] == "path":
        good += ["/etc/kubernetes/node-feature-discovery/features.d/vgpu", ""]
        bad += ["features.d/vgpu", 5]
    if path[-1] == "deviceListStrategy":
        good += ["envvar", ["volume-mounts", "cdi-cri"], list(schema["anyOf"][0]["enum"])]
        bad += [[], ["envvar", "envvar"], "bogus", ["bogus"], 3]
    if path[-1].endswith("Xids"):
        good += [[], None, [200, 201]]
        bad += [[0], [200, 200], ["13"], "13"]
    if path[-1] == "resourceName":
        good += ["example.com/gpu", "vgpu.example.com/slice_1"]
        bad += ["gpu", "kubernetes.io/gpu", "requests.example.com/gpu", "Example.com/gpu", ""]
        bad.append("example.com/" + "a" * 64)
    if path[-1] == "root":  # mps.root
        good += ["/run/vgpu/mps", "/var/run/mps"]
        bad += ["", "run/mps", "/run/../mps", "/run/mps/", "/run//mps", "/a,b", "/a:b", 5]
    if path == ("mps", "controlCommand"):
        bad += ["   "]
    if path == ("nodeLabels", "file"):
        good += ["", "vgpu", "vgpu.features", "a-b_c"]
        bad += ["features.d/vgpu", "/vgpu", ".vgpu", "vg pu", "x" * 201, 5]
    if path == ("nodeLabels", "path"):
        good += ["", "/etc/kubernetes/node-feature-discovery/features.d/vgpu"]
        bad += ["features.d/vgpu", 5, None]
    if path == ("dra", "driverName"):
        good += ["vgpu.dev", "gpu.example.com"]
        bad += ["Not_A_Name", "", "vgpu.dev.", 5]
    if path[-2:] == ("[]", "resource"):  # memoryLimits.resources[].resource
        good += ["nvidia.com/vgpu", "example.com/gpu"]
        bad += ["gpu", "kubernetes.io/gpu", "", 5]
    if path[-1] == "overrides":
        good += [[], None, [OVERRIDE]]
        bad += [[{"replicas": 2}], [{"match": {}, "replicas": 2}], [{"match": {"index": 0}}]]
    return good, bad


@pytest.mark.parametrize("path", [p for p, _ in leaves(VGPU)], ids=dotted)
def test_each_key_takes_the_values_the_parser_takes(path: Path) -> None:
    schema = dict(leaves(VGPU))[path]
    good, bad = samples(path, schema)
    assert len(good) >= 2, f"no valid samples for {dotted(path)}"
    assert len(bad) >= 3, f"no invalid samples for {dotted(path)}"
    for value in good:
        data = place(path, value)
        assert parser_accepts(data), f"the parser refuses {dotted(path)}: {value!r}"
        assert schema_accepts(data), f"the schema refuses {dotted(path)}: {value!r}"
    for value in bad:
        data = place(path, value)
        assert not parser_accepts(data), f"the parser accepts {dotted(path)}: {value!r}"
        assert not schema_accepts(data), f"the schema accepts {dotted(path)}: {value!r}"


@pytest.mark.parametrize(
    "path", [p for p, s in leaves(VGPU) if s.get("x-minimumSeconds", 0) > 0], ids=dotted
)
def test_duration_minimums_are_the_parsers(path: Path) -> None:
    minimum_s = dict(leaves(VGPU))[path]["x-minimumSeconds"]
    at = format_duration(minimum_s)
    below = f"{round(minimum_s * 1e6) - 1}us"
    assert parser_accepts(place(path, at))
    assert not parser_accepts(place(path, below))
    assert f"At least {format_duration(minimum_s)}" in dict(leaves(VGPU))[path]["description"]


@pytest.mark.parametrize(
    "path", [p for p, s in leaves(VGPU) if "x-maximumSeconds" in s], ids=dotted
)
def test_duration_maximums_are_the_parsers(path: Path) -> None:
    maximum_s = dict(leaves(VGPU))[path]["x-maximumSeconds"]

    def at(value: str) -> dict[str, Any]:
        data = place(path, value)
        if path[-1] == "period":  # a period may not exceed its window
            data["enforcement"]["compute"]["window"] = format_duration(maximum_s)
        return data

    assert parser_accepts(at(format_duration(maximum_s)))
    assert not parser_accepts(at(f"{round(maximum_s * 1000) + 1}ms"))
    assert f"At most {format_duration(maximum_s)}" in dict(leaves(VGPU))[path]["description"]


def test_defaults_in_the_schema_are_the_parsers_defaults() -> None:
    document: dict[str, Any] = {}
    for path, schema in leaves(VGPU):
        if "default" in schema and "[]" not in path:
            document = _merge(document, place(path, schema["default"]))
    assert schema_accepts(document)
    assert parse_config(document) == parse_config(None)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    merged = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def test_rules_across_keys_agree() -> None:
    both = {"slicing": {"replicas": 2, "memoryPerSlice": "10Gi"}}
    assert not parser_accepts(both)
    assert not schema_accepts(both)
    override_both = {"slicing": {"overrides": [{**OVERRIDE, "memoryPerSlice": "10Gi"}]}}
    assert not parser_accepts(override_both)
    assert not schema_accepts(override_both)


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)


def example_configs() -> list[tuple[str, object]]:
    examples: list[tuple[str, object]] = [("default_config_yaml()", default_config_yaml())]
    for doc in (ROOT / "README.md", ROOT / "docs" / "design.md", DEPLOY / "README.md"):
        for i, block in enumerate(yaml_blocks(doc.read_text())):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data.get("version") == "v1":
                examples.append((f"{doc.relative_to(ROOT)} block {i}", block))
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.is_relative_to(CHART / "templates") or path.name == "Chart.yaml":
            continue  # Helm templates: YAML only once rendered (tests/deploy renders them)
        if path.is_relative_to(CHART):
            # A values file's `config:` map becomes the daemon's config file.
            values = yaml.safe_load(path.read_text())
            config = values.get("config") if isinstance(values, dict) else None
            if isinstance(config, dict) and isinstance(config.get("map"), dict):
                # NVIDIA's chart knobs: named configs, each a file's content (or a map).
                for key, named in config["map"].items():
                    text = named if isinstance(named, str) else yaml.safe_dump(named)
                    examples.append((f"{path.relative_to(ROOT)} config.map.{key}", text))
            elif config:
                examples.append((f"{path.relative_to(ROOT)} config", yaml.safe_dump(config)))
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "version" in doc and "kind" not in doc:
                examples.append((str(path.relative_to(ROOT)), path.read_text()))  # a config file
            if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
                for key, text in doc.get("data", {}).items():
                    if key.endswith((".yaml", ".yml")):
                        examples.append((f"{path.relative_to(ROOT)} {key}", text))
    return examples


@pytest.mark.parametrize(("name", "text"), example_configs(), ids=[n for n, _ in example_configs()])
def test_every_example_config_is_valid_for_both(name: str, text: str) -> None:
    data = yaml.safe_load(text)
    assert parser_accepts(data), name
    errors = [e.message for e in VALIDATOR.iter_errors(data)]
    assert not errors, f"{name}: {errors}"


def test_nvidia_files_are_told_apart_and_validate() -> None:
    nvidia = {
        "version": "v1",
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}},
    }
    assert parser_accepts(nvidia)
    assert schema_accepts(nvidia)
    mixed = {**nvidia, "slicing": {"replicas": 2}}
    assert not parser_accepts(mixed)
    assert not schema_accepts(mixed)


def test_an_empty_file_is_valid_for_both() -> None:
    assert parser_accepts(None)
    assert schema_accepts(None)


@pytest.mark.parametrize(
    "nvidia",
    [
        {"imex": {"channelIDs": [0]}},
        {"resources": {"gpus": [{"pattern": "*", "name": "gpu"}]}},
        {"version": "v1", "flags": {"migStrategy": "none"}, "unknownToNvidia": 1},
    ],
)
def test_every_nvidia_only_key_tells_the_formats_apart_in_both(nvidia: dict[str, object]) -> None:
    assert parser_accepts(nvidia)
    assert schema_accepts(nvidia)
    assert not parser_accepts({**nvidia, "nodeLabels": {"path": ""}})
    assert not schema_accepts({**nvidia, "nodeLabels": {"path": ""}})
