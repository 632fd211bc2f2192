"""NVIDIA k8s-device-plugin's `flags` and `health` sections.

What vgpu can act on is mapped (allocation policy, device list and device ID strategies,
migStrategy, mpsRoot, the Xid lists); settings it does not act on are type-checked and reported
as warnings when they differ from NVIDIA's defaults, so that a default-valued dump of NVIDIA's
config reads quietly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from deviceplugin.config.health import (
    HealthConfig,
)
from deviceplugin.config.reader import (
    _join,
    _kind,
    _Reader,
    _show,
)
from deviceplugin.config.values import (
    AllocationPolicy,
    DeviceIdStrategy,
    DeviceListStrategy,
    MigStrategy,
)
from deviceplugin.config.vgpu import _MIG_STRATEGIES, _POLICIES, _mps_root

_NV_FLAGS_KEYS = (
    "migStrategy",
    "failOnInitError",
    "restartOnDeviceUnhealthy",
    "nvidiaDriverRoot",
    "nvidiaDevRoot",
    "mpsRoot",
    "gdsEnabled",
    "gdrcopyEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
    "deviceDiscoveryStrategy",
    "plugin",
    "gfd",
)
_NV_PLUGIN_KEYS = (
    "passDeviceSpecs",
    "deviceListStrategy",
    "deviceIDStrategy",
    "containerDriverRoot",
    "cdiAnnotationPrefix",
    "nvidiaCTKPath",
    "nvidiaDevRoot",
    "sharedDevicesAllocationPolicy",
)
_NV_HEALTH_KEYS = ("disabled", "eventTypes", "ignoredXIDs", "criticalXIDs")
_NV_EVENT_TYPES = (
    "EventTypeXidCriticalError",
    "EventTypeDoubleBitEccError",
    "EventTypeSingleBitEccError",
)


@dataclass(frozen=True, slots=True)
class _IgnoredSetting:
    """An NVIDIA setting vgpu accepts but does not act on. `choices` limits a string's values."""

    key: str
    nvidia_default: bool | str
    instead: str
    choices: tuple[str, ...] = ()


_DRIVER_INSTEAD = "vgpu uses the NVIDIA driver and device nodes visible in its own container"
_NV_IGNORED_FLAGS = (
    _IgnoredSetting(
        "failOnInitError",
        True,
        "vgpu always exits with an error when it cannot start its GPU backend",
    ),
    _IgnoredSetting(
        "restartOnDeviceUnhealthy",
        False,
        "vgpu marks the slices of an unhealthy GPU unhealthy and keeps running",
    ),
    _IgnoredSetting("nvidiaDriverRoot", "/", _DRIVER_INSTEAD),
    _IgnoredSetting("nvidiaDevRoot", "/", _DRIVER_INSTEAD),
    _IgnoredSetting(
        "gdsEnabled",
        False,
        "vgpu does not pass GPUDirect Storage devices to containers",
    ),
    _IgnoredSetting(
        "gdrcopyEnabled",
        False,
        "vgpu does not pass GDRCopy devices to containers",
    ),
    _IgnoredSetting(
        "mofedEnabled",
        False,
        "vgpu does not pass MOFED devices to containers",
    ),
    _IgnoredSetting(
        "useNodeFeatureAPI",
        False,
        "vgpu does not label nodes; that is gpu-feature-discovery's job",
    ),
    _IgnoredSetting(
        "deviceDiscoveryStrategy",
        "auto",
        "vgpu always discovers GPUs through NVML",
        ("auto", "nvml", "tegra"),
    ),
)
_NV_IGNORED_PLUGIN = (
    _IgnoredSetting("containerDriverRoot", "/driver-root", _DRIVER_INSTEAD),
    _IgnoredSetting(
        "cdiAnnotationPrefix",
        "cdi.k8s.io/",
        "vgpu always uses the cdi.k8s.io/ annotation prefix",
    ),
    _IgnoredSetting(
        "nvidiaCTKPath",
        "/usr/bin/nvidia-ctk",
        "vgpu does not run nvidia-ctk",
    ),
    _IgnoredSetting("nvidiaDevRoot", "/", _DRIVER_INSTEAD),
)


def _ignored_settings(
    r: _Reader, section: Mapping[str, object], path: str, settings: Sequence[_IgnoredSetting]
) -> None:
    """Type-check NVIDIA settings vgpu does not act on; warn about those set to a non-default."""
    for setting in settings:
        if setting.key not in section:
            continue
        value = section[setting.key]
        key_path = _join(path, setting.key)
        if isinstance(setting.nvidia_default, bool):
            parsed: object = r.boolean(value, key_path)
        elif setting.choices:
            shown = ", ".join(setting.choices)
            parsed = r.choice(value, key_path, {c: c for c in setting.choices}, shown)
        elif isinstance(value, str):
            parsed = value
        else:
            r.error(key_path, f"{_show(value)} is not a string")
            parsed = None
        if parsed is not None and parsed != setting.nvidia_default:
            r.warn(f"{key_path}: {_show(parsed)} is ignored: {setting.instead}.")


def _nvidia_mps_root(r: _Reader, flags: Mapping[str, object]) -> str | None:
    """flags.mpsRoot, where set (NVIDIA writes an unset one as "")."""
    value = flags.get("mpsRoot")
    if value is None or value == "":
        return None
    return _mps_root(r, value, "flags.mpsRoot")


def _nvidia_flags_section(r: _Reader, value: object) -> dict[str, object]:
    """flags, its keys matched ignoring case as NVIDIA's plugin matches them."""
    return r.section(value, "flags", _NV_FLAGS_KEYS, fold_case=True)


@dataclass(frozen=True, slots=True)
class _NvidiaAllocation:
    """What NVIDIA's flags say about Allocate; None where the file does not say."""

    policy: AllocationPolicy | None = None
    strategies: tuple[DeviceListStrategy, ...] | None = None
    pass_device_specs: bool = False
    device_ids: DeviceIdStrategy | None = None


def _nvidia_flags(r: _Reader, flags: Mapping[str, object]) -> _NvidiaAllocation:
    """flags (as _nvidia_flags_section read it): the allocation policy, device list strategies,
    passDeviceSpecs and deviceIDStrategy, where set."""
    _ignored_settings(r, flags, "flags", _NV_IGNORED_FLAGS)
    gfd = flags.get("gfd")
    if gfd is not None and not isinstance(gfd, dict):
        r.error("flags.gfd", f"expected a mapping, got {_kind(gfd)}")
    elif gfd:
        r.warn("flags.gfd is ignored: it configures gpu-feature-discovery, not vgpu.")
    plugin = r.section(flags.get("plugin"), "flags.plugin", _NV_PLUGIN_KEYS, fold_case=True)
    _ignored_settings(r, plugin, "flags.plugin", _NV_IGNORED_PLUGIN)
    policy: AllocationPolicy | None = None
    if "sharedDevicesAllocationPolicy" in plugin:
        policy = r.choice(
            plugin["sharedDevicesAllocationPolicy"],
            "flags.plugin.sharedDevicesAllocationPolicy",
            _POLICIES,
            "packed, distributed (vgpu's pack, spread are accepted too)",
        )
    strategies: tuple[DeviceListStrategy, ...] | None = None
    if "deviceListStrategy" in plugin:
        strategies = r.strategies(plugin["deviceListStrategy"], "flags.plugin.deviceListStrategy")
    pass_specs = False
    if "passDeviceSpecs" in plugin:
        pass_specs = bool(r.boolean(plugin["passDeviceSpecs"], "flags.plugin.passDeviceSpecs"))
    device_ids: DeviceIdStrategy | None = None
    if plugin.get("deviceIDStrategy") is not None:
        # NVIDIA's plugin refuses any other value ("invalid --device-id-strategy option").
        device_ids = r.device_id_strategy(
            plugin["deviceIDStrategy"], "flags.plugin.deviceIDStrategy"
        )
    return _NvidiaAllocation(policy, strategies, pass_specs, device_ids)


def _nvidia_health(r: _Reader, value: object) -> HealthConfig:
    """NVIDIA's `health` section (api/config/v1/health.go): `disabled` and `ignoredXIDs` map to
    vgpu's enabled and ignoredXids; `criticalXIDs` "all" is vgpu's behaviour. A list of critical
    Xids (only those act) and a narrower `eventTypes` are accepted with a warning."""
    path = "health"
    section = r.section(value, path, _NV_HEALTH_KEYS, fold_case=True)
    defaults = HealthConfig()
    enabled = defaults.enabled
    if "disabled" in section:
        disabled = r.boolean(section["disabled"], _join(path, "disabled"))
        enabled = enabled if disabled is None else not disabled
    ignored = defaults.ignored_xids
    if "ignoredXIDs" in section:
        parsed = r.xids(section["ignoredXIDs"], _join(path, "ignoredXIDs"))
        # As in NVIDIA's plugin, an empty list keeps the default list.
        ignored = parsed or ignored
    if "eventTypes" in section:
        types_path = _join(path, "eventTypes")
        chosen: set[str] = set()
        for i, item in enumerate(r.items(section["eventTypes"], types_path)):
            event_type = r.choice(
                item,
                f"{types_path}[{i}]",
                {t: t for t in _NV_EVENT_TYPES},
                ", ".join(_NV_EVENT_TYPES),
            )
            if event_type is not None:
                chosen.add(event_type)
        if chosen and "EventTypeXidCriticalError" not in chosen:
            r.warn(
                f"{types_path} is ignored: vgpu always watches Xid and double-bit ECC events"
                " (health.disabled: true turns the watch off)."
            )
    if "criticalXIDs" in section:
        critical_path = _join(path, "criticalXIDs")
        critical = section["criticalXIDs"]
        if isinstance(critical, str) and critical.lower() == "all":
            pass
        elif isinstance(critical, list):
            listed = r.xids(critical, critical_path)
            both = [x for x in listed or () if "ignoredXIDs" in section and x in ignored]
            if both:
                r.error(
                    critical_path,
                    f"NVIDIA's plugin refuses it (XID {both[0]} is in both ignored and critical"
                    " lists)",
                )
            elif listed:
                r.warn(
                    f"{critical_path}: a list is ignored: vgpu treats every Xid that is not in"
                    " ignoredXIDs as critical."
                )
        else:
            r.error(critical_path, f'{_show(critical)} is not "all" or a list of Xid numbers')
    return replace(defaults, enabled=enabled, ignored_xids=ignored)


def _nvidia_mig_strategy(r: _Reader, flags: Mapping[str, object]) -> MigStrategy:
    """flags.migStrategy (NVIDIA's default: none)."""
    if flags.get("migStrategy") is None:
        return MigStrategy.NONE
    shown = ", ".join(_MIG_STRATEGIES)
    strategy = r.choice(flags["migStrategy"], "flags.migStrategy", _MIG_STRATEGIES, shown)
    return strategy or MigStrategy.NONE
