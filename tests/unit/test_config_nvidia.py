"""NVIDIA k8s-device-plugin's config files mean what NVIDIA's plugin (v0.20) makes of them
(docs/design.md §7): the corpus in tests/nvidia_configs/, written from NVIDIA's documented schema,
README, chart values and its own test cases, each with what NVIDIA's plugin does with it; and the
finer points of the format around it."""

from __future__ import annotations

import io
import json
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from deviceplugin.check import EXIT_OK, check_config
from deviceplugin.config import (
    HAS_LIBYAML,
    AllocationConfig,
    AllocationPolicy,
    Config,
    ConfigFormat,
    DeviceIdStrategy,
    DeviceListStrategy,
    GpuMatch,
    HealthConfig,
    MigStrategy,
    MpsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
    is_nvidia_config,
    load_config,
    parse_config,
)
from deviceplugin.errors import ConfigError
from tests.blackbox.daemon_harness import TWO_GPUS, Node, registered
from tests.blackbox.test_enforcement_daemon import Serve

CORPUS = Path(__file__).resolve().parents[1] / "nvidia_configs"
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Meaning:
    """What NVIDIA's plugin makes of a file, as vgpu must make it too.

    refused: (key path, a piece of NVIDIA's reason) of each problem, in order; empty when the file
    is accepted. nvidia_takes: a refusal of vgpu's own, where NVIDIA's plugin takes the file.
    Then: the resource full GPUs are served as, with its replicas per GPU, MPS or not, the MIG
    strategy, the replicas of MIG profiles (mixed), what the container runtime is
    told a GPU is called, and the key path each warning starts with, in order (no other
    warning)."""

    refused: tuple[tuple[str, str], ...] = ()
    # Refused by vgpu only: NVIDIA's plugin takes the file, and the refusal says what it does.
    nvidia_takes: bool = False
    resource: str = GPU
    replicas: int = 1
    mps: bool = False
    mig: MigStrategy = MigStrategy.NONE
    profiles: dict[str, int] = field(default_factory=dict)
    device_ids: DeviceIdStrategy = DeviceIdStrategy.UUID
    warnings: tuple[str, ...] = ()


def refused(*problems: tuple[str, str]) -> Meaning:
    return Meaning(refused=problems)


def vgpu_refuses(*problems: tuple[str, str]) -> Meaning:
    """Refused by vgpu, where NVIDIA's plugin takes the file (docs/migrating.md lists these)."""
    return Meaning(refused=problems, nvidia_takes=True)


TS = "sharing.timeSlicing"
TS0 = f"{TS}.resources[0]"
MPS_DIFF = "sharing.mps:"
MPS_FAIL = "sharing.mps.failRequestsGreaterThanOne:"

CASES: dict[str, Meaning] = {
    # Whole GPUs: the most common NVIDIA config has flags and no sharing.
    "readme-flags-only.yaml": Meaning(),
    "helm-map-default.yaml": Meaning(),
    "helm-map-mig-single.yaml": Meaning(mig=MigStrategy.SINGLE),
    "helm-map-mig-mixed.yaml": Meaning(mig=MigStrategy.MIXED),
    "imex-only.yaml": Meaning(warnings=("imex is ignored",)),
    "resources-only.yaml": Meaning(warnings=("resources is ignored",)),
    "version-empty.yaml": Meaning(),
    "gfd-flags.yaml": Meaning(warnings=("flags.gfd is ignored",)),
    "flags-unknown-key.yaml": Meaning(warnings=("flags.migStrategyy is ignored",)),
    "flags-case.yaml": Meaning(mig=MigStrategy.SINGLE, warnings=("flags.MIGStrategy: read as",)),
    # Time-slicing.
    "time-slicing-10.yaml": Meaning(replicas=10),
    "time-slicing-rename-by-default.yaml": Meaning(resource=f"{GPU}.shared", replicas=4),
    "time-slicing-fail-requests.yaml": Meaning(
        replicas=4, warnings=(f"{TS}.failRequestsGreaterThanOne: true: as NVIDIA",)
    ),
    "time-slicing-mig-mixed.yaml": Meaning(
        replicas=2,
        mig=MigStrategy.MIXED,
        profiles={"1g.5gb": 2, "2g.10gb": 2, "3g.20gb": 3, "7g.40gb": 7},
    ),
    "time-slicing-mig-single.yaml": Meaning(replicas=3, mig=MigStrategy.SINGLE),
    "tab-indented.json": Meaning(replicas=2),
    "tab-indented-trailing-comma.json": Meaning(replicas=2),
    "tab-indented-unknown-names.json": Meaning(
        warnings=(f"{TS0}.name: nvidia.com/valid1 is ignored", f"{TS}.resources[1].name")
    ),
    "running-config-dump.json": Meaning(replicas=4, warnings=("resources is ignored",)),
    "replicas-whole-float.yaml": Meaning(replicas=2),
    "rename-gpu.yaml": Meaning(replicas=4, warnings=(f"{TS}.resources: rename is ignored",)),
    "rename-is-the-default-shared-name.yaml": Meaning(resource=f"{GPU}.shared", replicas=2),
    "devices-all.yaml": Meaning(replicas=2),
    "devices-count.yaml": Meaning(replicas=2, warnings=(f"{TS}.resources: devices is ignored",)),
    "devices-list.yaml": Meaning(replicas=2, warnings=(f"{TS}.resources: devices is ignored",)),
    "device-list-strategies.yaml": Meaning(replicas=2),
    # NVIDIA_VISIBLE_DEVICES=0,1 and 0:1 for a MIG device, as NVIDIA's plugin names them.
    "device-id-strategy-index.yaml": Meaning(
        replicas=2, mig=MigStrategy.MIXED, device_ids=DeviceIdStrategy.INDEX
    ),
    "sharing-case.yaml": Meaning(
        replicas=3, warnings=("Sharing: read as sharing", "sharing.TimeSlicing: read as")
    ),
    "time-slicing-old-strategy-key.yaml": Meaning(
        warnings=(f"{TS}.strategy is ignored", f"{TS0}.name: nvidia.com/valid is ignored")
    ),
    "mig-name-without-mixed.yaml": Meaning(
        warnings=(f"{TS0}.name: nvidia.com/mig-1g.10gb is ignored",)
    ),
    # MPS.
    "mps-10.yaml": Meaning(replicas=10, mps=True, warnings=(MPS_DIFF, MPS_FAIL)),
    "mps-fail-requests-false.yaml": Meaning(replicas=2, mps=True, warnings=(MPS_DIFF,)),
    "mps-and-time-slicing.yaml": Meaning(
        replicas=2, mps=True, warnings=(f"{TS} is ignored: with sharing.mps", MPS_DIFF)
    ),
    # What NVIDIA's plugin refuses, with its reason.
    "mps-mig-mixed.yaml": refused(("flags.migStrategy", "mixed is not supported with MPS")),
    "replicas-1.yaml": refused((f"{TS0}.replicas", "number of replicas must be >= 2")),
    "replicas-0.yaml": refused((f"{TS0}.replicas", "number of replicas must be >= 2")),
    "replicas-negative.yaml": refused((f"{TS0}.replicas", "number of replicas must be >= 2")),
    "no-replicas.yaml": refused((TS0, "no replicas specified")),
    "no-name.yaml": refused((TS0, "no resource name specified")),
    "resource-empty-mapping.yaml": refused(
        (TS0, "no resource name specified"), (TS0, "no replicas specified")
    ),
    "name-outside-nvidia.yaml": refused(
        (f"{TS0}.name", 'incorrect format for resource name "nvidia.com/example.com/gpu"')
    ),
    "name-invalid.yaml": refused((f"{TS0}.name", "incorrect format for resource name")),
    "rename-invalid.yaml": refused((f"{TS0}.rename", "incorrect format for resource name")),
    "name-too-long.yaml": refused((f"{TS0}.name", "must be 63 characters or less")),
    "time-slicing-empty.yaml": refused((TS, "no resources specified")),
    "time-slicing-resources-empty.yaml": refused((f"{TS}.resources", "no resources specified")),
    "mps-empty.yaml": refused(("sharing.mps", "no resources specified")),
    "time-slicing-null.yaml": refused((TS, "no resources specified")),
    "replicas-fraction.yaml": refused((f"{TS0}.replicas", "2.5 is not an integer")),
    "devices-null.yaml": refused((f"{TS0}.devices", "unrecognized type for devices spec")),
    "top-level-resources-list.yaml": refused(("resources", "expected a mapping")),
    "resources-without-pattern.yaml": refused(
        ("resources.gpus[0]", "resources must have a 'pattern' field set")
    ),
    "devices-not-all.yaml": refused((f"{TS0}.devices", 'the only valid string is "all"')),
    "devices-count-negative.yaml": refused((f"{TS0}.devices", "count of devices must be > 0")),
    "devices-float.yaml": refused((f"{TS0}.devices", "unrecognized type for devices spec")),
    "devices-index-negative.yaml": refused((f"{TS0}.devices[0]", "unsupported device")),
    "devices-index-negative-string.yaml": refused((f"{TS0}.devices[0]", "unsupported device")),
    "devices-invalid-uuid.yaml": refused((f"{TS0}.devices[0]", "unsupported device")),
    "devices-gpu-uuid-placeholder.yaml": refused((f"{TS0}.devices[0]", "unsupported device")),
    "devices-mig-uuid-placeholder.yaml": refused((f"{TS0}.devices[0]", "unsupported device")),
    "devices-mig-gpu-uuid-without-indices.yaml": refused(
        (f"{TS0}.devices[0]", "unsupported device")
    ),
    "version-v2.yaml": refused(("version", '"v2" is not supported')),
    "mig-strategy-unknown.yaml": refused(("flags.migStrategy", '"all" is not one of')),
    "device-id-strategy-unknown.yaml": refused(
        ("flags.plugin.deviceIDStrategy", '"serial" is not one of')
    ),
    # What vgpu refuses and NVIDIA's plugin takes, saying so. vgpu's keys are not read from
    # NVIDIA's file: refused, so nobody believes them in force.
    "vgpu-key-mixed-in.yaml": vgpu_refuses(("top level", 'unknown key "nodeLabels"')),
    "replicas-2000.yaml": vgpu_refuses((f"{TS0}.replicas", "vgpu serves at most 1024 per GPU")),
    "resource-listed-twice.yaml": vgpu_refuses((f"{TS}.resources[1]", "is listed twice")),
}


def test_every_file_of_the_corpus_has_its_meaning_written_down() -> None:
    assert sorted(p.name for p in CORPUS.iterdir()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_nvidia_file_means_what_nvidias_plugin_makes_of_it(name: str) -> None:
    meaning = CASES[name]
    if meaning.refused:
        with pytest.raises(ConfigError) as raised:
            load_config(CORPUS / name)
        problems = raised.value.problems
        assert len(problems) == len(meaning.refused), problems
        for problem, (path, reason) in zip(problems, meaning.refused, strict=True):
            assert problem.startswith(f"{path}: "), problem
            assert reason in problem
            # A refusal NVIDIA's plugin does not make says what NVIDIA's plugin does instead.
            if meaning.nvidia_takes:
                assert "NVIDIA's plugin" in problem, problem
                assert "NVIDIA's plugin refuses" not in problem, problem
        return

    config = load_config(CORPUS / name)

    assert config.format is ConfigFormat.NVIDIA
    assert config.resource_name == meaning.resource
    assert config.slicing.default == SliceRule(replicas=meaning.replicas)
    assert config.mps.enabled is meaning.mps
    assert config.mig.strategy is meaning.mig
    profiles = {
        o.match.profile: o.rule.replicas for o in config.slicing.overrides if o.match.profile
    }
    if meaning.mig is MigStrategy.SINGLE and meaning.replicas > 1:
        assert profiles == {"*": meaning.replicas}  # MIG devices are nvidia.com/gpu too
    else:
        assert profiles == meaning.profiles
    assert config.allocation.device_id_strategy is meaning.device_ids
    assert len(config.warnings) == len(meaning.warnings), config.warnings
    for warning, start in zip(config.warnings, meaning.warnings, strict=True):
        assert warning.startswith(start), warning


def test_nvidias_reader_is_libyaml_here() -> None:
    # The tab-indented files above read as NVIDIA's plugin reads them only through libyaml.
    assert HAS_LIBYAML


def test_tab_indented_json_is_read_where_the_pure_python_scanner_refuses_it() -> None:
    text = (CORPUS / "tab-indented.json").read_text()
    with pytest.raises(yaml.YAMLError, match="cannot start any token"):
        yaml.load(text, Loader=yaml.SafeLoader)

    assert load_config(CORPUS / "tab-indented.json").slicing.default == SliceRule(replicas=2)


def test_a_tab_that_libyaml_refuses_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("flags:\n\tmigStrategy: none\n")

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert raised.value.problems[0].startswith("line 2, column 1: ")


# --- which format a file is -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        {"flags": {}},
        {"version": "v1", "flags": {"migStrategy": "none"}},
        {"sharing": None},
        {"resources": {"gpus": []}},
        {"imex": {"channelIDs": [0]}},
        {"Sharing": {}},
        {"version": "v1", "health": {"disabled": True}, "imex": {}},
    ],
)
def test_any_of_nvidias_own_top_level_keys_makes_an_nvidia_file(data: object) -> None:
    assert is_nvidia_config(data)
    assert parse_config(data).format is ConfigFormat.NVIDIA


def test_every_top_level_key_only_nvidias_format_has_makes_an_nvidia_file() -> None:
    from deviceplugin.config.nvidia import _NV_TOP_KEYS
    from deviceplugin.config.vgpu import _TOP_KEYS

    for key in set(_NV_TOP_KEYS) - set(_TOP_KEYS):
        assert is_nvidia_config({key.upper(): {}}), key


@pytest.mark.parametrize(
    "data", [None, {}, {"version": "v1"}, {"health": {"enabled": False}}, {"slicing": {}}]
)
def test_a_file_without_them_is_vgpus(data: object) -> None:
    assert not is_nvidia_config(data)
    assert parse_config(data).format is ConfigFormat.VGPU


def parse(text: str) -> Config:
    return parse_config(yaml.safe_load(textwrap.dedent(text)))


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse(text)
    return raised.value.problems


# --- the finer points -------------------------------------------------------------------------


def test_a_flags_only_file_serves_whole_gpus_as_nvidias_plugin_does() -> None:
    config = parse("version: v1\nflags: {migStrategy: none}")

    assert config == Config(resource_name=GPU, slicing=SlicingConfig(SliceRule(replicas=1)))
    assert config.warnings == ()


def test_nvidia_time_slicing_config() -> None:
    config = parse(
        """
        version: v1
        sharing:
          timeSlicing:
            resources:
            - name: nvidia.com/gpu
              replicas: 10
        """
    )

    assert config == Config(resource_name=GPU, slicing=SlicingConfig(SliceRule(replicas=10)))
    assert config.warnings == ()


def test_nvidia_mps_root_and_what_vgpu_does_differently_are_said() -> None:
    config = parse(
        """
        version: v1
        flags: {mpsRoot: /run/nvidia/mps}
        sharing:
          mps:
            resources:
            - name: nvidia.com/gpu
              replicas: 4
        """
    )

    assert config.mps == MpsConfig(enabled=True, root="/run/nvidia/mps")
    assert config.slicing.default == SliceRule(replicas=4)
    difference, fail_requests = config.warnings
    assert difference.startswith("sharing.mps: ")
    assert "<mps root>/pipe" in difference
    assert "EXCLUSIVE_PROCESS" in difference
    assert "mpsRoot is not set" not in difference
    # NVIDIA defaults failRequestsGreaterThanOne to true with MPS: the difference is named.
    assert fail_requests.startswith("sharing.mps.failRequestsGreaterThanOne: not set, so true")
    assert "more than 1 of nvidia.com/gpu" in fail_requests


@pytest.mark.parametrize(("written", "warned"), [("true", True), ("false", False)])
def test_mps_fail_requests_written_out(written: str, warned: bool) -> None:
    config = parse(
        f"sharing: {{mps: {{failRequestsGreaterThanOne: {written},"
        " resources: [{name: gpu, replicas: 2}]}}"
    )

    fail = [w for w in config.warnings if w.startswith("sharing.mps.failRequestsGreaterThanOne")]
    assert bool(fail) is warned
    if warned:
        assert fail[0].startswith("sharing.mps.failRequestsGreaterThanOne: true: ")


def test_nvidia_mps_root_without_mps_is_ignored_with_a_warning() -> None:
    config = parse(
        """
        flags: {mpsRoot: /run/nvidia/mps}
        sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}
        """
    )
    assert config.mps == MpsConfig()
    assert [w.split(" ")[0] for w in config.warnings] == ["flags.mpsRoot"]


@pytest.mark.parametrize(
    ("resource", "rename_by_default", "advertised"),
    [
        ("{name: nvidia.com/gpu, replicas: 2}", "true", "nvidia.com/gpu.shared"),
        ("{name: gpu, replicas: 2}", "false", GPU),
        ("{name: gpu, replicas: 2}", "true", "nvidia.com/gpu.shared"),
        # rename is ignored by NVIDIA's plugin, with its warning.
        ("{name: nvidia.com/gpu, replicas: 2, rename: gpu-small}", "true", "nvidia.com/gpu.shared"),
        ("{name: nvidia.com/gpu, replicas: 2, rename: nvidia.com/tiny}", "false", GPU),
    ],
)
def test_nvidia_resource_names(resource: str, rename_by_default: str, advertised: str) -> None:
    sharing = f"timeSlicing: {{renameByDefault: {rename_by_default}, resources: [{resource}]}}"
    config = parse(f"sharing: {{{sharing}}}")

    assert config.resource_name == advertised
    assert bool(config.warnings) is ("rename" in resource)


def test_mixed_mig_profiles_are_replicated_and_renamed_by_default() -> None:
    config = parse(
        """
        flags: {migStrategy: mixed}
        sharing:
          timeSlicing:
            renameByDefault: true
            resources:
            - {name: mig-1g.10gb, replicas: 2}
        """
    )

    # No nvidia.com/gpu entry: full GPUs stay whole, as nvidia.com/gpu.
    assert config.resource_name == GPU
    assert config.slicing == SlicingConfig(
        SliceRule(replicas=1), (SliceOverride(GpuMatch(profile="1g.10gb"), SliceRule(replicas=2)),)
    )
    assert config.mig.resource_for("1g.10gb") == "nvidia.com/mig-1g.10gb.shared"
    assert config.warnings == ()


def test_nvidia_flags_map_to_allocation() -> None:
    config = parse(
        """
        flags:
          plugin:
            passDeviceSpecs: true
            deviceListStrategy: volume-mounts
            sharedDevicesAllocationPolicy: distributed
        sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 3}]}}
        """
    )

    assert config.allocation == AllocationConfig(
        policy=AllocationPolicy.SPREAD,
        device_list_strategy=(DeviceListStrategy.VOLUME_MOUNTS, DeviceListStrategy.DEVICE_SPECS),
    )
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("text", "device_ids"),
    [
        ("flags: {plugin: {deviceIDStrategy: index}}", DeviceIdStrategy.INDEX),
        ("flags: {plugin: {deviceIDStrategy: uuid}}", DeviceIdStrategy.UUID),
        ("flags: {plugin: {deviceIDStrategy: null}}", DeviceIdStrategy.UUID),
        ("flags: {plugin: {DeviceIdStrategy: index}}", DeviceIdStrategy.INDEX),
    ],
)
def test_nvidia_device_id_strategy_maps_to_allocation(
    text: str, device_ids: DeviceIdStrategy
) -> None:
    config = parse(text)

    assert config.allocation.device_id_strategy is device_ids
    assert not [w for w in config.warnings if "ignored" in w]


def test_nvidia_pass_device_specs_keeps_the_default_strategy() -> None:
    config = parse(
        "flags: {plugin: {passDeviceSpecs: true, sharedDevicesAllocationPolicy: packed}}"
    )

    assert config.allocation == AllocationConfig(
        policy=AllocationPolicy.PACK,
        device_list_strategy=(DeviceListStrategy.ENVVAR, DeviceListStrategy.DEVICE_SPECS),
    )


def test_nvidias_running_config_dump_is_accepted() -> None:
    dump = json.loads((CORPUS / "running-config-dump.json").read_text())

    config = parse_config(dump)

    assert config == Config(resource_name=GPU)
    assert [w.split(" ")[0] for w in config.warnings] == ["resources"]


NVIDIA_WARNINGS = [
    # (NVIDIA config, the setting the warning names)
    ("flags: {failOnInitError: false}", "flags.failOnInitError"),
    ("flags: {nvidiaDriverRoot: /run/nvidia/driver}", "flags.nvidiaDriverRoot"),
    ("flags: {mpsRoot: /run/nvidia/mps}", "flags.mpsRoot"),
    ("flags: {gdsEnabled: true}", "flags.gdsEnabled"),
    ("flags: {mofedEnabled: true}", "flags.mofedEnabled"),
    ("flags: {useNodeFeatureAPI: true}", "flags.useNodeFeatureAPI"),
    ("flags: {deviceDiscoveryStrategy: tegra}", "flags.deviceDiscoveryStrategy"),
    ("flags: {plugin: {cdiAnnotationPrefix: example.com/}}", "flags.plugin.cdiAnnotationPrefix"),
    ("flags: {plugin: {nvidiaCTKPath: /opt/nvidia-ctk}}", "flags.plugin.nvidiaCTKPath"),
    ("flags: {plugin: {containerDriverRoot: /drv}}", "flags.plugin.containerDriverRoot"),
    ("flags: {plugin: {passDeviceSpec: true}}", "flags.plugin.passDeviceSpec"),
    ("flags: {gfd: {oneshot: true, sleepInterval: 60s}}", "flags.gfd"),
    ("resources: {mig: [{pattern: '1g.10gb', name: mig-small}]}", "resources"),
    ("resources: {gpu: []}", "resources.gpu"),
    ("imex: {channelIDs: [0], required: true}", "imex"),
    ("health: {criticalXIDs: [48, 79]}", "health.criticalXIDs"),
    ("health: {eventTypes: [EventTypeSingleBitEccError]}", "health.eventTypes"),
    ("health: {ignoredXids: [13]}", "health.ignoredXids"),
    ("sharing: {timeSlicing: {strategy: packed}}", "sharing.timeSlicing.strategy"),
    ("sharing: {timeSlicingg: {}}", "sharing.timeSlicingg"),
]


@pytest.mark.parametrize(("text", "setting"), NVIDIA_WARNINGS, ids=[w[1] for w in NVIDIA_WARNINGS])
def test_nvidia_settings_vgpu_ignores_are_warned_about(text: str, setting: str) -> None:
    shared = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}"
    data = yaml.safe_load(text)
    if "timeSlicingg" not in str(data.get("sharing", "")):
        data.setdefault("sharing", {}).setdefault("timeSlicing", {}).update(
            yaml.safe_load(shared)["sharing"]["timeSlicing"]
        )
    data.setdefault("flags", {})

    config = parse_config(data)

    assert len(config.warnings) == 1, config.warnings
    warning = config.warnings[0]
    assert warning.startswith((f"{setting}: ", f"{setting} is ignored")), warning
    assert "ignored" in warning or "read as" in warning


@pytest.mark.parametrize(
    ("text", "health"),
    [
        ("health: {disabled: true}", HealthConfig(enabled=False)),
        ("health: {disabled: false}", HealthConfig()),
        ("health: {ignoredXIDs: [13, 79]}", HealthConfig(ignored_xids=(13, 79))),
        ("health: {ignoredXIDs: []}", HealthConfig()),
        ("health: {criticalXIDs: all}", HealthConfig()),
        ("health: {criticalXIDs: ALL}", HealthConfig()),
        ("health: {criticalXIDs: []}", HealthConfig()),
        (
            "health: {eventTypes: [EventTypeXidCriticalError, EventTypeDoubleBitEccError,"
            " EventTypeSingleBitEccError]}",
            HealthConfig(),
        ),
        ("health: {eventTypes: [EventTypeXidCriticalError]}", HealthConfig()),
        ("health: null", HealthConfig()),
    ],
)
def test_nvidia_health_maps_what_vgpu_acts_on(text: str, health: HealthConfig) -> None:
    config = parse(f"sharing: {{timeSlicing: {{resources: [{{name: gpu, replicas: 2}}]}}}}\n{text}")

    assert config.health == health
    assert config.warnings == ()


NVIDIA_ERRORS = [
    (
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}, {name: gpu, replicas: 4}]}}",
        "sharing.timeSlicing.resources[1]",
        "listed twice",
    ),
    (
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: true}]}}",
        "sharing.timeSlicing.resources[0].replicas",
        "true",
    ),
    (
        "sharing: {timeSlicing: {resources: [{name: 'my gpu', replicas: 2}]}}",
        "sharing.timeSlicing.resources[0].name",
        '"my gpu"',
    ),
    (
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 5000}]}}",
        "sharing.timeSlicing.resources[0].replicas",
        "at most 1024",
    ),
    ("sharing: {timeSlicing: {resources: [gpu]}}", "sharing.timeSlicing.resources[0]", "a string"),
    ("sharing: {timeslicing: {}}", "sharing.timeSlicing", "no resources specified"),
    (
        "sharing: {mps: {renameByDefault: 'yes', resources: [{name: gpu, replicas: 2}]}}",
        "sharing.mps.renameByDefault",
        '"yes"',
    ),
    ("flags: {migStrategy: all}", "flags.migStrategy", '"all"'),
    ("flags: {failOnInitError: 'no'}", "flags.failOnInitError", '"no"'),
    ("flags: {nvidiaDriverRoot: 5}", "flags.nvidiaDriverRoot", "5"),
    (
        "flags: {plugin: {deviceListStrategy: [envvar, nvml]}}",
        "flags.plugin.deviceListStrategy[1]",
        '"nvml"',
    ),
    (
        "flags: {plugin: {sharedDevicesAllocationPolicy: roundrobin}}",
        "flags.plugin.sharedDevicesAllocationPolicy",
        '"roundrobin"',
    ),
    ("flags: {mpsRoot: relative}", "flags.mpsRoot", '"relative"'),
    ("flags: {gfd: yes}", "flags.gfd", "true"),
    ("flags: {}\nversion: v2", "version", '"v2"'),
    ("flags: {}\nhealth: {disabled: 1}", "health.disabled", "1"),
    ("flags: {}\nhealth: {ignoredXIDs: [x]}", "health.ignoredXIDs[0]", '"x"'),
    ("flags: {}\nhealth: {criticalXIDs: some}", "health.criticalXIDs", '"some"'),
    ("flags: {}\nhealth: {criticalXIDs: [0]}", "health.criticalXIDs[0]", "0 is too small"),
    ("flags: {}\nhealth: {eventTypes: [Xid]}", "health.eventTypes[0]", '"Xid"'),
    (
        "flags: {}\nhealth: {ignoredXIDs: [13, 79], criticalXIDs: [48, 79]}",
        "health.criticalXIDs",
        "XID 79 is in both ignored and critical lists",
    ),
    ("imex: {channelIDs: [x]}", "imex.channelIDs[0]", '"x"'),
    ("imex: {required: maybe}", "imex.required", '"maybe"'),
]


@pytest.mark.parametrize(
    ("text", "path", "shown"), NVIDIA_ERRORS, ids=[e[0] for e in NVIDIA_ERRORS]
)
def test_an_invalid_nvidia_value_is_reported_with_its_path(
    text: str, path: str, shown: str
) -> None:
    problems = problems_of(text)

    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: "), problems[0]
    assert shown in problems[0]


def test_vgpu_keys_in_an_nvidia_file_are_errors_that_explain_why() -> None:
    problems = problems_of(
        """
        sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}
        slicing: {replicas: 8}
        """
    )

    assert len(problems) == 1
    assert problems[0].startswith('top level: unknown key "slicing"')
    assert "NVIDIA k8s-device-plugin" in problems[0]


def test_an_unknown_top_level_key_is_ignored_as_nvidia_ignores_it() -> None:
    config = parse("flags: {}\nsharingg: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}")

    assert config.resource_name == GPU
    assert config.slicing.default == SliceRule(replicas=1)
    assert [w.split(" ")[0] for w in config.warnings] == ["sharingg"]


# --- what check-config says ---------------------------------------------------------------------


def check(path: Path, *, enforce_nvidia_config: bool = False) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    code = check_config(path, "", out, err, enforce_nvidia_config=enforce_nvidia_config)
    assert code == EXIT_OK, err.getvalue()
    return out.getvalue().splitlines()


def test_check_config_says_devices_are_named_by_index() -> None:
    assert (
        "device list volume-mounts by index," in check(CORPUS / "device-id-strategy-index.yaml")[0]
    )
    assert " by index" not in check(CORPUS / "device-list-strategies.yaml")[0]


def test_the_plan_says_how_an_nvidia_file_is_read_and_what_vgpu_adds() -> None:
    lines = check(CORPUS / "time-slicing-10.yaml")

    assert lines[1] == (
        "read as NVIDIA k8s-device-plugin's config: nvidia.com/gpu, 10 per GPU shared by"
        " time-slicing; MIG strategy none"
    )
    # Monitor mode, until the operator turns enforcement on: said first, then under the plan.
    assert lines[2].startswith(
        "enforcement: monitor mode, as the config is NVIDIA k8s-device-plugin's format: vgpu"
        " decides, logs and counts what it would do (would kill, would throttle) and signals"
        " nothing; to enforce, keeping the file as it is: serve --enforce-nvidia-config true"
    )
    beyond = lines[lines.index("beyond NVIDIA's plugin, vgpu also:") :]
    text = " ".join(beyond)
    assert "would kill a container's largest GPU process after 2s above it" in text
    assert "(logs and counts it as would_kill, signals nothing)" in text
    assert "would pause a container above its compute share" in text
    assert "(logs and counts it as would_throttle)" in text
    assert "monitor mode: to enforce, serve --enforce-nvidia-config true" in text
    assert "per GPU and per container" in text
    # The demo's H100 is in MIG mode: NVIDIA's plugin (migStrategy none) would serve it whole.
    assert "differs from NVIDIA's plugin: GPU 2 in MIG mode is left out" in text
    assert max(len(line) for line in beyond) <= 80


def test_with_enforcement_turned_on_the_plan_says_what_vgpu_enforces() -> None:
    lines = check(CORPUS / "time-slicing-10.yaml", enforce_nvidia_config=True)

    assert lines[2].startswith("enforcement: on for this NVIDIA-format config")
    beyond = lines[lines.index("beyond NVIDIA's plugin, vgpu also:") :]
    text = " ".join(beyond)
    assert "kills a container's largest GPU process after 2s" in text
    assert "pauses a container above its compute share" in text
    assert "would" not in text
    assert max(len(line) for line in beyond) <= 80


def test_the_plan_of_whole_gpus_has_nothing_to_enforce() -> None:
    lines = check(CORPUS / "readme-flags-only.yaml")

    assert "whole GPUs (1 per GPU)" in lines[1]
    assert "  nothing to enforce on whole GPUs: a container has all of its GPU" in lines
    assert not any("kills" in line for line in lines)


def test_a_vgpu_file_gets_no_nvidia_lines(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("slicing: {replicas: 2}\n")

    lines = check(path)

    assert not any("NVIDIA's" in line or "k8s-device-plugin" in line for line in lines)
    # Enforced as it says, whatever the flag: no mode line.
    assert not any(line.startswith("enforcement:") for line in lines)
    assert check(path, enforce_nvidia_config=True) == lines


# --- serve with an NVIDIA file and the daemon's flags -------------------------------------------


@pytest.fixture
async def two_gpu_node(short_tmp: Path) -> AsyncIterator[Node]:
    node = Node(short_tmp, TWO_GPUS)
    await node.sim.start()
    try:
        yield node
    finally:
        await node.sim.stop()


@pytest.mark.parametrize(
    ("name", "resource", "per_gpu"),
    [("readme-flags-only.yaml", GPU, 1), ("tab-indented.json", GPU, 2)],
)
async def test_serve_with_an_unchanged_nvidia_file_serves_what_nvidias_plugin_serves(
    two_gpu_node: Node, name: str, resource: str, per_gpu: int
) -> None:
    serve = Serve(two_gpu_node, (CORPUS / name).read_text())
    try:
        await serve.start()
        await registered(two_gpu_node, 2 * per_gpu, resource)
        pod = await two_gpu_node.sim.admit_pod("p", [("c", 1)], resource_name=resource)
        (grant,) = pod.containers
        assert len(grant.device_ids) == 1
        code, err = await serve.stop()
        assert code == 0, err
    finally:
        await serve.kill_if_running()
