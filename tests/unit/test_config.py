"""The config file (docs/design.md §7): defaults, the vgpu format, NVIDIA's format, and the
messages a user sees when a file is wrong."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.config import (
    AllocationConfig,
    AllocationPolicy,
    ComputeAction,
    ComputeEnforcement,
    Config,
    DeviceIdStrategy,
    DeviceListStrategy,
    EnforcementConfig,
    GpuMatch,
    HealthConfig,
    MemoryAction,
    MemoryEnforcement,
    MpsConfig,
    RecoveryPolicy,
    SliceOverride,
    SliceRule,
    SlicingConfig,
    default_config_yaml,
    format_duration,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from deviceplugin.config.keys import Group, Node, Section, keys_of
from deviceplugin.errors import ConfigError

GI = 1024**3


def parse_yaml(text: str) -> Config:
    return parse_config(yaml.safe_load(textwrap.dedent(text)))


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_yaml(text)
    return raised.value.problems


# --- defaults and a full file -------------------------------------------------------------------


@pytest.mark.parametrize("data", [None, {}, yaml.safe_load(""), yaml.safe_load("# only a comment")])
def test_an_empty_file_gives_the_defaults(data: object) -> None:
    config = parse_config(data)

    assert config == Config()
    assert config.resource_name == "nvidia.com/vgpu"
    assert config.slicing.default == SliceRule(replicas=4)
    assert config.allocation.policy is AllocationPolicy.PACK
    assert config.allocation.device_list_strategy == (DeviceListStrategy.ENVVAR,)
    assert config.enforcement.poll_interval_s == 0.5
    assert config.enforcement.memory == MemoryEnforcement(MemoryAction.KILL, 2.0)
    assert config.enforcement.compute == ComputeEnforcement(ComputeAction.THROTTLE, 5.0, 0.25, True)
    assert config.mps.enabled is False
    assert config.health == HealthConfig(
        enabled=True,
        ignored_xids=(13, 31, 43, 45, 68, 109),
        additional_ignored_xids=(),
        critical_xids=(),
        recovery=RecoveryPolicy.MANUAL,
        recovery_delay_s=60.0,
        hang_timeout_s=10.0,
    )
    assert config.warnings == ()


def test_a_full_file_gives_every_setting() -> None:
    config = parse_yaml(
        """
        version: v1
        resourceName: example.com/gpu-slice
        slicing:
          memoryPerSlice: 10Gi
          overrides:
            - match: {model: "*A100*"}
              replicas: 8
            - match: {index: 1, uuid: GPU-1234}
              memoryPerSlice: 512Mi
        allocation:
          policy: spread
          deviceListStrategy: [volume-mounts, cdi-cri, device-specs]
        enforcement:
          pollInterval: 250ms
          idlePollInterval: 3s
          dryRun: true
          memory: {action: monitor, gracePeriod: 1m30s}
          compute: {action: monitor, window: 10s, period: 100ms, workConserving: false}
        mps: {enabled: true}
        health:
          enabled: true
          ignoredXids: [13, 31]
          additionalIgnoredXids: [94]
          criticalXids: [43]
          recovery: auto
          recoveryDelay: 5m
          hangTimeout: 2s
        """
    )

    assert config == Config(
        version="v1",
        resource_name="example.com/gpu-slice",
        slicing=SlicingConfig(
            default=SliceRule(memory_per_slice_bytes=10 * GI),
            overrides=(
                SliceOverride(GpuMatch(model="*A100*"), SliceRule(replicas=8)),
                SliceOverride(
                    GpuMatch(index=1, uuid="GPU-1234"),
                    SliceRule(memory_per_slice_bytes=512 * 1024**2),
                ),
            ),
        ),
        allocation=AllocationConfig(
            policy=AllocationPolicy.SPREAD,
            device_list_strategy=(
                DeviceListStrategy.VOLUME_MOUNTS,
                DeviceListStrategy.CDI_CRI,
                DeviceListStrategy.DEVICE_SPECS,
            ),
        ),
        enforcement=EnforcementConfig(
            poll_interval_s=0.25,
            idle_poll_interval_s=3.0,
            dry_run=True,
            memory=MemoryEnforcement(action=MemoryAction.MONITOR, grace_period_s=90.0),
            compute=ComputeEnforcement(
                action=ComputeAction.MONITOR, window_s=10.0, period_s=0.1, work_conserving=False
            ),
        ),
        mps=MpsConfig(enabled=True),
        health=HealthConfig(
            enabled=True,
            ignored_xids=(13, 31),
            additional_ignored_xids=(94,),
            critical_xids=(43,),
            recovery=RecoveryPolicy.AUTO,
            recovery_delay_s=300.0,
            hang_timeout_s=2.0,
        ),
    )
    assert config.warnings == ()


def test_a_partial_section_keeps_the_other_defaults() -> None:
    config = parse_yaml("enforcement: {compute: {period: 500ms}}\nslicing: {replicas: 2}")

    assert config.enforcement.compute == ComputeEnforcement(period_s=0.5)
    assert config.enforcement.memory == MemoryEnforcement()
    assert config.slicing == SlicingConfig(default=SliceRule(replicas=2))


@pytest.mark.parametrize(
    ("written", "policy"),
    [
        ("pack", AllocationPolicy.PACK),
        ("spread", AllocationPolicy.SPREAD),
        ("packed", AllocationPolicy.PACK),
        ("distributed", AllocationPolicy.SPREAD),
    ],
)
def test_policy_accepts_nvidia_names(written: str, policy: AllocationPolicy) -> None:
    assert parse_yaml(f"allocation: {{policy: {written}}}").allocation.policy is policy


def test_device_list_strategy_may_be_a_single_string() -> None:
    config = parse_yaml("allocation: {deviceListStrategy: cdi-annotations}")

    assert config.allocation.device_list_strategy == (DeviceListStrategy.CDI_ANNOTATIONS,)


def test_a_zero_grace_period_needs_no_unit() -> None:
    assert parse_yaml("enforcement: {memory: {gracePeriod: 0}}").enforcement.memory == (
        MemoryEnforcement(grace_period_s=0.0)
    )


# --- errors: each names the key path and the bad value -------------------------------------------

ERRORS = [
    # (config, key path the problem starts with, what it must show)
    ("version: v2", "version", '"v2"'),
    ("version: 1", "version", "1"),
    ("colour: red", "top level", '"colour"'),
    ("resourceName: vgpu", "resourceName", '"vgpu"'),
    ("resourceName: 42", "resourceName", "42"),
    ("resourceName: kubernetes.io/gpu", "resourceName", '"kubernetes.io/gpu"'),
    ("resourceName: gpu.kubernetes.io/slice", "resourceName", '"gpu.kubernetes.io/slice"'),
    ("resourceName: requests.example.com/gpu", "resourceName", '"requests.example.com/gpu"'),
    ("resourceName: Example.com/gpu", "resourceName", '"Example.com"'),
    ("resourceName: example.com/-gpu", "resourceName", '"-gpu"'),
    ("resourceName: example.com/a/b", "resourceName", '"a/b"'),
    (f"resourceName: example.com/{'g' * 64}", "resourceName", "at most 63"),
    ("slicing: [4]", "slicing", "a list"),
    ("slicing: {replica: 4}", "slicing", '"replica"'),
    ("slicing: {replicas: true}", "slicing.replicas", "true"),
    ("slicing: {replicas: 0}", "slicing.replicas", "0"),
    ("slicing: {replicas: '4'}", "slicing.replicas", '"4"'),
    ("slicing: {replicas: 2.5}", "slicing.replicas", "2.5"),
    ("slicing: {memoryPerSlice: 10Gx}", "slicing.memoryPerSlice", '"10Gx"'),
    ("slicing: {memoryPerSlice: 0}", "slicing.memoryPerSlice", "0"),
    ("slicing: {memoryPerSlice: 1.5}", "slicing.memoryPerSlice", "1.5"),
    ("slicing: {replicas: 2, memoryPerSlice: 1Gi}", "slicing", "not both"),
    ("slicing: {overrides: {match: {index: 0}}}", "slicing.overrides", "a mapping"),
    ("slicing: {overrides: [7]}", "slicing.overrides[0]", "7"),
    ("slicing: {overrides: [{replicas: 2}]}", "slicing.overrides[0]", "needs a match"),
    ("slicing: {overrides: [{match: {index: 0}}]}", "slicing.overrides[0]", "replicas"),
    ("slicing: {overrides: [{match: {}, replicas: 2}]}", "slicing.overrides[0].match", "one of"),
    ("slicing: {overrides: [{match: 0, replicas: 2}]}", "slicing.overrides[0].match", "0"),
    (
        "slicing: {overrides: [{match: {index: 0}, replicas: 2, memoryPerSlice: 1Gi}]}",
        "slicing.overrides[0]",
        "not both",
    ),
    (
        "slicing: {overrides: [{match: {index: 0}, replicas: 2, replica: 3}]}",
        "slicing.overrides[0]",
        '"replica"',
    ),
    (
        "slicing: {overrides: [{match: {index: -1}, replicas: 2}]}",
        "slicing.overrides[0].match.index",
        "-1",
    ),
    (
        "slicing: {overrides: [{match: {index: true}, replicas: 2}]}",
        "slicing.overrides[0].match.index",
        "true",
    ),
    (
        "slicing: {overrides: [{match: {model: ''}, replicas: 2}]}",
        "slicing.overrides[0].match.model",
        "empty",
    ),
    (
        "slicing: {overrides: [{match: {uuid: 5}, replicas: 2}]}",
        "slicing.overrides[0].match.uuid",
        "5",
    ),
    (
        "slicing: {overrides: [{match: {index: 0}, replicas: 0}]}",
        "slicing.overrides[0].replicas",
        "0",
    ),
    (
        "slicing: {overrides: [{match: {index: 0}, memoryPerSlice: 3x}]}",
        "slicing.overrides[0].memoryPerSlice",
        '"3x"',
    ),
    ("allocation: {policy: fill}", "allocation.policy", '"fill"'),
    ("allocation: {policies: pack}", "allocation", '"policies"'),
    ("allocation: {deviceListStrategy: []}", "allocation.deviceListStrategy", "empty"),
    ("allocation: {deviceListStrategy: 3}", "allocation.deviceListStrategy", "3"),
    ("allocation: {deviceListStrategy: nvml}", "allocation.deviceListStrategy", '"nvml"'),
    ("allocation: {deviceIDStrategy: serial}", "allocation.deviceIDStrategy", '"serial"'),
    ("allocation: {deviceIDStrategy: [index]}", "allocation.deviceIDStrategy", "uuid, index"),
    (
        "allocation: {deviceListStrategy: [envvar, nvml]}",
        "allocation.deviceListStrategy[1]",
        '"nvml"',
    ),
    (
        "allocation: {deviceListStrategy: [envvar, cdi-cri, envvar]}",
        "allocation.deviceListStrategy[2]",
        '"envvar" is listed twice',
    ),
    ("enforcement: {pollInterval: 10ms}", "enforcement.pollInterval", '"10ms"'),
    ("enforcement: {dryRun: sometimes}", "enforcement.dryRun", '"sometimes"'),
    ("enforcement: {idlePollInterval: 2m}", "enforcement.idlePollInterval", '"2m"'),
    ("enforcement: {idlePollInterval: 1}", "enforcement.idlePollInterval", "1 has no unit"),
    ("enforcement: {pollInterval: 2}", "enforcement.pollInterval", "2 has no unit"),
    ("enforcement: {pollInterval: '500'}", "enforcement.pollInterval", '"500" has no unit'),
    ("enforcement: {pollInterval: fast}", "enforcement.pollInterval", '"fast"'),
    ("enforcement: {interval: 1s}", "enforcement", '"interval"'),
    ("enforcement: {memory: {action: warn}}", "enforcement.memory.action", '"warn"'),
    ("enforcement: {memory: {gracePeriod: 2x}}", "enforcement.memory.gracePeriod", '"2x"'),
    ("enforcement: {memory: {gracePeriod: -1s}}", "enforcement.memory.gracePeriod", '"-1s"'),
    ("enforcement: {memory: kill}", "enforcement.memory", "a string"),
    ("enforcement: {compute: {action: kill}}", "enforcement.compute.action", '"kill"'),
    ("enforcement: {compute: {period: 10ms}}", "enforcement.compute.period", '"10ms"'),
    ("enforcement: {compute: {window: 100ms}}", "enforcement.compute.window", "100ms"),
    ("enforcement: {compute: {window: 1s, period: 2s}}", "enforcement.compute.window", "1s"),
    (
        "enforcement: {compute: {workConserving: 'yes'}}",
        "enforcement.compute.workConserving",
        '"yes"',
    ),
    ("enforcement: {compute: {workConserving: 1}}", "enforcement.compute.workConserving", "1"),
    ("mps: {enabled: 1}", "mps.enabled", "1"),
    ("mps: true", "mps", "true"),
    ("mps: {enable: true}", "mps", '"enable"'),
    ("health: {enabled: 'no'}", "health.enabled", '"no"'),
    ("health: {ignoredXids: 13}", "health.ignoredXids", "expected a list of Xid numbers"),
    ("health: {ignoredXids: [13, x]}", "health.ignoredXids[1]", '"x" is not an integer'),
    ("health: {ignoredXids: [13, 0]}", "health.ignoredXids[1]", "0 is too small"),
    ("health: {additionalIgnoredXids: [94, 94]}", "health.additionalIgnoredXids[1]", "twice"),
    ("health: {criticalXids: [true]}", "health.criticalXids[0]", "true is not an integer"),
    (
        "health: {additionalIgnoredXids: [94, 95], criticalXids: [95]}",
        "health.criticalXids",
        "95 also listed in health.additionalIgnoredXids",
    ),
    (
        "health: {ignoredXids: [13, 31], criticalXids: [31, 13]}",
        "health.criticalXids",
        "31, 13 also listed in health.ignoredXids",
    ),
    ("health: {recovery: sometimes}", "health.recovery", '"sometimes" is not one of manual, auto'),
    ("health: {recoveryDelay: 60}", "health.recoveryDelay", "60 has no unit"),
    ("health: {recoveryDelay: -1s}", "health.recoveryDelay", '"-1s" is too short'),
    ("health: {hangTimeout: 10ms}", "health.hangTimeout", '"10ms" is too short'),
    ("health: {disabled: true}", "health", '"disabled"'),
    ("health: false", "health", "false"),
    ("[1, 2]", "top level", "a list"),
]


@pytest.mark.parametrize(("text", "path", "shown"), ERRORS, ids=[e[0] for e in ERRORS])
def test_an_invalid_value_is_reported_with_its_path_and_value(
    text: str, path: str, shown: str
) -> None:
    problems = problems_of(text)

    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: "), problems[0]
    assert shown in problems[0]


def test_health_lists_may_be_empty_or_null() -> None:
    config = parse_yaml("health: {ignoredXids: [], additionalIgnoredXids: null, criticalXids: []}")

    assert config.health == HealthConfig(ignored_xids=())


def test_health_can_be_turned_off() -> None:
    config = parse_yaml("health: {enabled: false}")

    assert config.health == HealthConfig(enabled=False)
    assert not config.health.is_critical(79)


@pytest.mark.parametrize(
    ("health", "critical", "ignored"),
    [
        (
            HealthConfig(),
            (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 999),
            (13, 31, 43, 45, 68, 109),
        ),
        (HealthConfig(additional_ignored_xids=(94, 92)), (48, 79), (13, 92, 94)),
        (HealthConfig(critical_xids=(13, 68)), (13, 68, 79), (31, 43, 45, 109)),
        (HealthConfig(ignored_xids=(79,)), (13, 31, 48), (79,)),
        (HealthConfig(enabled=False), (), (13, 48, 79)),
    ],
    ids=["defaults", "additional", "critical-wins", "replaced", "disabled"],
)
def test_which_xids_are_critical(
    health: HealthConfig, critical: tuple[int, ...], ignored: tuple[int, ...]
) -> None:
    assert [x for x in critical if not health.is_critical(x)] == []
    assert [x for x in ignored if health.is_critical(x)] == []


def test_critical_xids_may_name_a_default_ignored_xid() -> None:
    config = parse_yaml("health: {criticalXids: [13, 68]}")

    assert config.health.critical_xids == (13, 68)
    assert config.health.is_critical(13)


def test_an_unknown_key_lists_the_expected_keys() -> None:
    problems = problems_of(
        """
        slicing:
          overrides:
            - {match: {model: "*A100*"}, replicas: 8}
            - {match: {modle: "*H100*"}, replicas: 2}
        """
    )

    assert problems == [
        'slicing.overrides[1].match: unknown key "modle"'
        " (expected one of: index, model, profile, uuid)"
    ]


def test_the_duration_message_says_what_format_is_expected() -> None:
    assert problems_of("enforcement: {memory: {gracePeriod: 2x}}") == [
        'enforcement.memory.gracePeriod: "2x" is not a duration (use e.g. 500ms, 2s)'
    ]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(
            yaml.safe_load(
                textwrap.dedent(
                    """
                    version: v2
                    slicing: {replicas: true}
                    allocation: {policy: fill}
                    enforcement: {memory: {gracePeriod: 2x}, compute: {period: 1ms}}
                    mps: {enabled: maybe}
                    extra: 1
                    """
                )
            ),
            source="/etc/vgpu/config.yaml",
        )

    paths = sorted(p.split(": ")[0] for p in raised.value.problems)
    assert paths == [
        "allocation.policy",
        "enforcement.compute.period",
        "enforcement.memory.gracePeriod",
        "mps.enabled",
        "slicing.replicas",
        "top level",
        "version",
    ]
    assert raised.value.source == "/etc/vgpu/config.yaml"
    assert str(raised.value).startswith("/etc/vgpu/config.yaml: ")


# --- durations and sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("2s", 2.0),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("1m", 60.0),
        ("1h", 3600.0),
        ("1m30s", 90.0),
        ("250us", 0.00025),
        ("100ns", 1e-7),
        (" 2s ", 2.0),
        ("0", 0.0),
        (0, 0.0),
        ("-1s", -1.0),
    ],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2", "no unit"),
        (2, "no unit"),
        (1.5, "no unit"),
        ("2x", "is not a duration (use e.g. 500ms, 2s)"),
        ("2 s", "is not a duration"),
        ("s", "is not a duration"),
        ("", "is not a duration"),
        ("1d", "is not a duration"),
        ("ms500", "is not a duration"),
        (True, "is not a duration"),
    ],
)
def test_parse_duration_rejects(value: str | int | float, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_duration(value)


@given(st.integers(min_value=1, max_value=10**12))
def test_format_duration_reads_back(micros: int) -> None:
    seconds = micros / 1_000_000

    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-9)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.5, "500ms"), (2.0, "2s"), (90.0, "90s"), (120.0, "2m"), (1.5, "1.5s")]
)
def test_format_duration_is_short(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("10Gi", 10 * GI),
        ("512Mi", 512 * 1024**2),
        ("1Ki", 1024),
        ("2Ti", 2 * 1024**4),
        ("80GiB", 80 * GI),
        ("1.5Gi", 3 * GI // 2),
        ("1G", 10**9),
        ("4k", 4000),
        ("3M", 3 * 10**6),
        ("1T", 10**12),
        ("1024", 1024),
        (1024, 1024),
        ("10 Gi", 10 * GI),
        (0, 0),
    ],
)
def test_parse_size(value: str | int, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize(
    "value", ["10Gx", "10gi", "Gi", "", "-1Gi", "1.5", "0.3Ki", "1e9", -5, True]
)
def test_parse_size_rejects(value: str | int) -> None:
    with pytest.raises(ValueError, match=r"size|bytes"):
        parse_size(value)


@pytest.mark.parametrize(
    ("value", "binary", "decimal"),
    [("10GB", "10Gi", "10G"), ("512MB", "512Mi", "512M"), ("1TB", "1Ti", "1T")],
)
def test_a_size_in_gb_is_refused_with_both_readings(value: str, binary: str, decimal: str) -> None:
    with pytest.raises(ValueError, match="ambiguous") as refused:
        parse_size(value)
    assert f"write {binary} " in str(refused.value)
    assert f"or {decimal} (decimal)" in str(refused.value)


def test_parse_size_message_shows_the_expected_format() -> None:
    with pytest.raises(ValueError, match=r'"10Gx" is not a size \(use e\.g\. 10Gi'):
        parse_size("10Gx")


# --- allocation hints and MPS (NVIDIA's format: test_config_nvidia.py) ---------------------


def test_vgpu_allocation_hints_and_mps_settings() -> None:
    config = parse_yaml(
        """
        allocation: {frameworkHints: false, contextReserve: 1Gi}
        mps: {enabled: true, root: /var/run/mps, controlCommand: /opt/bin/mps-control}
        """
    )
    assert config.allocation.framework_hints is False
    assert config.allocation.context_reserve_bytes == 1 << 30
    assert config.mps == MpsConfig(True, "/var/run/mps", "/opt/bin/mps-control")
    assert parse_yaml("allocation: {contextReserve: 0}").allocation.context_reserve_bytes == 0
    assert parse_yaml("allocation: {}").allocation == AllocationConfig()


def test_vgpu_device_id_strategy_is_uuid_unless_index_is_asked_for() -> None:
    assert parse_yaml("allocation: {}").allocation.device_id_strategy is DeviceIdStrategy.UUID
    config = parse_yaml("allocation: {deviceIDStrategy: index, deviceListStrategy: cdi-cri}")
    assert config.allocation.device_id_strategy is DeviceIdStrategy.INDEX
    assert config.allocation.device_list_strategy == (DeviceListStrategy.CDI_CRI,)
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("text", "path", "shown"),
    [
        ("allocation: {frameworkHints: yes please}", "allocation.frameworkHints", '"yes please"'),
        ("allocation: {contextReserve: lots}", "allocation.contextReserve", '"lots"'),
        ("allocation: {contextReserve: -1}", "allocation.contextReserve", "-1"),
        ("mps: {root: run/mps}", "mps.root", '"run/mps"'),
        ("mps: {root: /run/../mps}", "mps.root", '"/run/../mps"'),
        ("mps: {root: '/run/a,b'}", "mps.root", '"/run/a,b"'),
        ("mps: {controlCommand: 3}", "mps.controlCommand", "3"),
        ("mps: {controlCommand: ' '}", "mps.controlCommand", "empty"),
    ],
)
def test_bad_hint_and_mps_settings_are_named(text: str, path: str, shown: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_yaml(text)
    (problem,) = raised.value.problems
    assert problem.startswith(f"{path}: "), problem
    assert shown in problem


# --- load_config ------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_load_config_reads_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "slicing: {replicas: 3}\nmps: {enabled: true}\n")

    config = load_config(path)

    assert config == Config(slicing=SlicingConfig(SliceRule(replicas=3)), mps=MpsConfig(True))


def test_load_config_reads_json(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 5}]}}}),
        "config.json",
    )

    assert load_config(path) == Config(
        resource_name="nvidia.com/gpu", slicing=SlicingConfig(SliceRule(replicas=5))
    )


def test_load_config_of_an_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_load_config_names_the_file_and_line_of_a_syntax_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        version: v1
        slicing:
          replicas: 4
         overrides: []
        """,
    )

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert raised.value.source == str(path)
    assert len(raised.value.problems) == 1
    assert raised.value.problems[0].startswith("line 4, column 2: ")
    assert str(raised.value).startswith(f"{path}: line 4")


def test_load_config_refuses_a_key_written_twice(tmp_path: Path) -> None:
    path = write(tmp_path, "slicing:\n  replicas: 4\n  replicas: 8\n")

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert raised.value.problems == ['line 3, column 3: duplicate key "replicas"']


def test_load_config_allows_yaml_merge_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        enforcement:
          memory: &quiet {action: monitor, gracePeriod: 1s}
          compute:
            <<: *quiet
            action: monitor
        """,
    )

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    # The merge itself is fine; the merged gracePeriod is not a compute key.
    assert raised.value.problems == [
        'enforcement.compute: unknown key "gracePeriod"'
        " (expected one of: action, period, window, workConserving)"
    ]


def test_load_config_of_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert raised.value.source == str(path)
    assert raised.value.problems == ["cannot read the file: No such file or directory"]


def test_load_config_of_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"version: v1\n\xff\xfe\n")

    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def test_load_config_reports_problems_under_the_file_name(tmp_path: Path) -> None:
    path = write(tmp_path, "slicing: {replicas: 0}\n")

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert str(raised.value) == f"{path}: slicing.replicas: 0 is too small (must be >= 1)"


# --- the default config text ----------------------------------------------------------------------


def test_default_config_yaml_parses_to_the_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, default_config_yaml()))

    assert config == Config()
    assert config.warnings == ()


def declared_keys(nodes: tuple[Node, ...], prefix: str = "") -> dict[str, Node]:
    """Every key declared for vgpu's format, by path, but those inside a list item."""
    found: dict[str, Node] = {}
    for node in nodes:
        path = f"{prefix}.{node.name}" if prefix else node.name
        if isinstance(node.declared.kind, Section | Group):
            found |= declared_keys(node.children, path)
        else:
            found[path] = node
    return found


def test_default_config_yaml_shows_every_setting() -> None:
    data = yaml.safe_load(default_config_yaml())

    def keys(value: object, prefix: str = "") -> set[str]:
        if not isinstance(value, dict):
            return {prefix}
        found: set[str] = set()
        for key, item in value.items():
            found |= keys(item, f"{prefix}.{key}" if prefix else key)
        return found

    declared = declared_keys(keys_of(Config))
    # Each key with a default is written with it; one without is a commented example.
    assert keys(data) == {
        path
        for path, node in declared.items()
        if node.default is not None and not node.declared.deprecated
    }
    assert "slicing.replicas" in keys(data)
    assert "enforcement.compute.workConserving" in keys(data)
    assert "dra.memory.min" in keys(data)
    for path, node in declared.items():
        if node.default is None and not node.declared.deprecated:
            assert f"# {node.name}: {node.declared.example}" in default_config_yaml(), path


def place(path: str, value: object) -> dict[str, object]:
    config: dict[str, object] = {}
    here = config
    *sections, name = path.split(".")
    for section in sections:
        here = here.setdefault(section, {})  # type: ignore[assignment]
    here[name] = value
    return config


def test_every_example_is_a_valid_value_of_its_key() -> None:
    examples = {
        path: node.declared.example
        for path, node in declared_keys(keys_of(Config)).items()
        if node.declared.example
    }
    assert {"slicing.memoryPerSlice", "slicing.overrides"} <= examples.keys()
    for path, example in examples.items():
        parse_config(place(path, yaml.safe_load(example)))

    config = parse_config(place("slicing.overrides", yaml.safe_load(examples["slicing.overrides"])))
    assert config.slicing.overrides == (
        SliceOverride(GpuMatch(model="*A100*"), SliceRule(replicas=8)),
        SliceOverride(GpuMatch(index=1), SliceRule(memory_per_slice_bytes=20 * GI)),
    )
