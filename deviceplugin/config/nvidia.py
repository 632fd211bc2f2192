"""NVIDIA k8s-device-plugin's config format (api/config/v1 of NVIDIA/k8s-device-plugin, v0.20).

Users bring the file they already have, and it means what NVIDIA's plugin makes of it: the same
resources with the same replicas, the same refusals with NVIDIA's reason (and a few of vgpu's
own, each saying what NVIDIA's plugin does instead), and NVIDIA's warnings
for what it ignores. Where vgpu cannot do the same, a warning names the difference.

What NVIDIA's plugin makes of a file:

- With no `sharing` resources, every GPU is served whole as `nvidia.com/gpu`, 1 per GPU (with
  `flags.migStrategy: mixed`, each MIG device as `nvidia.com/mig-<profile>`).
- `sharing.timeSlicing` or `sharing.mps` (MPS wins when both are there) replicates the resources
  it names: `nvidia.com/gpu` (a name without a domain gets `nvidia.com/`), and with the mixed
  strategy `nvidia.com/mig-<profile>`. `renameByDefault` serves them as `<name>.shared`; `rename`
  and `devices` are ignored with NVIDIA's warnings. A name NVIDIA's plugin serves no device under
  replicates nothing.
- It refuses a sharing section without resources, `replicas` below 2, a name outside
  `nvidia.com/` or not a DNS subdomain, a bad `devices` value, and MPS with the mixed strategy.
- It ignores keys it does not know (a warning here) and matches the keys of its Go structs
  ignoring case.

`flags` and `health` are read by `nvidia_flags`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.config.model import (
    DEFAULT_MPS_ROOT,
    MIG_RESOURCE_PREFIX,
    AllocationConfig,
    Config,
    GpuMatch,
    MigConfig,
    MpsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.config.nvidia_flags import (
    _nvidia_flags,
    _nvidia_flags_section,
    _nvidia_health,
    _nvidia_mig_strategy,
    _nvidia_mps_root,
)
from deviceplugin.config.reader import (
    _join,
    _kind,
    _Reader,
    _show,
)
from deviceplugin.config.values import (
    MAX_REPLICAS,
    ConfigFormat,
    DeviceListStrategy,
    MigStrategy,
)

NVIDIA_GPU_RESOURCE = "nvidia.com/gpu"
_NVIDIA_PREFIX = "nvidia.com/"
_NVIDIA_SHARED_SUFFIX = ".shared"
_NVIDIA_MAX_NAME_LENGTH = 63
_NV_TOP_KEYS = ("version", "flags", "resources", "sharing", "imex", "health")
_NV_RESOURCES_KEYS = ("gpus", "mig")
_NV_PATTERN_KEYS = ("pattern", "name")
_NV_SHARING_KEYS = ("timeSlicing", "mps")
_NV_IMEX_KEYS = ("channelIDs", "required")
_NV_REPLICATED_KEYS = ("renameByDefault", "failRequestsGreaterThanOne", "resources")
_NV_RESOURCE_KEYS = ("name", "replicas", "rename", "devices")

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_HEX = "[0-9a-fA-F]"
_UUID = rf"({_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}|{_HEX}{{32}})"
# A device of `devices`: a GPU index, a MIG index (gpu:mig), a GPU UUID or a MIG UUID.
_DEVICE_REF = re.compile(rf"\d+|\d+:\d+|GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/\d+/\d+")


def _refused(reason: str) -> str:
    return f"NVIDIA's plugin refuses it ({reason})"


def _nvidia_resource_name(r: _Reader, value: object, path: str) -> str | None:
    """A resource name as NVIDIA's plugin reads it: `nvidia.com/` is put in front of a name
    that does not start with it, and the rest must be a DNS subdomain."""
    if not isinstance(value, str):
        r.error(path, f"{_show(value)} is not a string")
        return None
    full = value if value.startswith(_NVIDIA_PREFIX) else _NVIDIA_PREFIX + value
    short = full.removeprefix(_NVIDIA_PREFIX)
    if len(full) > _NVIDIA_MAX_NAME_LENGTH:
        r.error(
            path,
            f"{_show(value)}: "
            + _refused(
                f"fully-qualified resource name must be {_NVIDIA_MAX_NAME_LENGTH} characters or"
                f" less: {full}"
            ),
        )
        return None
    if not _DNS_SUBDOMAIN.fullmatch(short):
        outside = (
            f"; names are in nvidia.com/, so {_show(value)} is read as {_show(full)}"
            if "/" in short
            else ""
        )
        r.error(
            path,
            f"{_show(value)}: "
            + _refused(
                f"incorrect format for resource name {_show(full)}: the part after nvidia.com/"
                " must be lower-case letters, digits, '-' and '.', starting and ending with a"
                f" letter or digit{outside}"
            ),
        )
        return None
    return full


def _nvidia_devices(r: _Reader, value: object, path: str) -> bool:
    """`devices`: "all", a positive count, or a list of GPU indices, MIG indices and UUIDs, as
    NVIDIA's plugin checks them. True when it is not "all" (NVIDIA's plugin then ignores it)."""
    if isinstance(value, str):
        if value != "all":
            r.error(
                path,
                _refused(f'devices set as {_show(value)} but the only valid string is "all"'),
            )
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            r.error(path, _refused(f"devices set as {value} but a count of devices must be > 0"))
            return False
        return True
    if isinstance(value, list):
        for i, item in enumerate(value):
            valid = (isinstance(item, int) and not isinstance(item, bool) and item >= 0) or (
                isinstance(item, str) and _DEVICE_REF.fullmatch(item) is not None
            )
            if not valid:
                r.error(
                    f"{path}[{i}]",
                    f"{_show(item)}: "
                    + _refused(
                        "unsupported device in devices list: expected a GPU index, a MIG index"
                        " such as 0:1, or a GPU-<uuid> or MIG-<uuid>"
                    ),
                )
        return True
    r.error(path, _refused(f"unrecognized type for devices spec: {_kind(value)}"))
    return False


@dataclass(frozen=True, slots=True)
class _Replicated:
    name: str  # as NVIDIA's plugin names it, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb
    advertised: str  # with renameByDefault, <name>.shared
    replicas: int
    path: str


@dataclass(frozen=True, slots=True)
class _Sharing:
    resources: tuple[_Replicated, ...]
    # None: not written (NVIDIA's default is false for timeSlicing, true for mps).
    fail_requests_greater_than_one: bool | None


def _nvidia_replicated(r: _Reader, value: object, kind: str) -> _Sharing | None:
    """sharing.timeSlicing or sharing.mps: its valid resources, in the file's order; None when
    the section is absent."""
    path = f"sharing.{kind}"
    if value is None:
        return None
    section = r.section(value, path, _NV_REPLICATED_KEYS)
    if not isinstance(value, dict):
        return None
    rename_by_default = False
    if "renameByDefault" in section:
        rename_by_default = bool(
            r.boolean(section["renameByDefault"], _join(path, "renameByDefault"))
        )
    fail: bool | None = None
    if "failRequestsGreaterThanOne" in section:
        fail = r.boolean(
            section["failRequestsGreaterThanOne"], _join(path, "failRequestsGreaterThanOne")
        )
    resources_path = _join(path, "resources")
    items = r.items(section.get("resources"), resources_path)
    if not items and isinstance(section.get("resources", []), list):
        r.error(
            resources_path if "resources" in section else path,
            _refused("no resources specified")
            + "; list at least one, e.g. resources: [{name: nvidia.com/gpu, replicas: 4}],"
            f" or leave {kind} out to serve whole GPUs",
        )
    chosen: list[_Replicated] = []
    renamed = customised_devices = False
    for i, item in enumerate(items):
        item_path = f"{resources_path}[{i}]"
        # NVIDIA's plugin reads a null name, replicas, rename or devices as an empty value,
        # which it refuses: not as an absent one.
        resource = r.section(item, item_path, _NV_RESOURCE_KEYS, keep_null=True)
        if not isinstance(item, dict):
            continue
        name: str | None = None
        if "name" not in resource:
            r.error(item_path, _refused("no resource name specified") + ", e.g. name: gpu")
        else:
            name = _nvidia_resource_name(r, resource["name"], _join(item_path, "name"))
        if "devices" in resource:
            customised_devices |= _nvidia_devices(
                r, resource["devices"], _join(item_path, "devices")
            )
        replicas: int | None = None
        if "replicas" not in resource:
            r.error(item_path, _refused("no replicas specified") + ", e.g. replicas: 4")
        else:
            replicas = _nvidia_replicas(r, resource["replicas"], _join(item_path, "replicas"))
        if "rename" in resource:
            rename = _nvidia_resource_name(r, resource["rename"], _join(item_path, "rename"))
            default = None if name is None else name + _NVIDIA_SHARED_SUFFIX
            if rename is not None and not (rename_by_default and rename == default):
                renamed = True
        if name is not None and replicas is not None:
            advertised = name + _NVIDIA_SHARED_SUFFIX if rename_by_default else name
            chosen.append(_Replicated(name, advertised, replicas, item_path))
    if renamed:
        r.warn(
            f"{resources_path}: rename is ignored, as NVIDIA's plugin ignores it (\"Setting the"
            f" 'rename' field in sharing.{kind}.resources is not yet supported in the config."
            ' Ignoring..."); renameByDefault: true serves <name>.shared.'
        )
    if customised_devices:
        r.warn(
            f"{resources_path}: devices is ignored, as NVIDIA's plugin ignores it (\"Customizing"
            f" the 'devices' field in sharing.{kind}.resources is not yet supported in the"
            ' config. Ignoring..."): every GPU is shared.'
        )
    return _Sharing(tuple(chosen), fail)


def _nvidia_replicas(r: _Reader, value: object, path: str) -> int | None:
    # NVIDIA's plugin turns YAML into JSON first, where 2.0 is written 2: a whole float is read.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        r.error(path, f"{_show(value)} is not an integer")
        return None
    if value < 2:
        r.error(
            path,
            f"{value}: "
            + _refused("number of replicas must be >= 2")
            + "; leave the resource out to serve whole GPUs",
        )
        return None
    if value > MAX_REPLICAS:
        r.error(
            path,
            f"{value} is too large: vgpu serves at most {MAX_REPLICAS} per GPU (each would be held"
            f" to 1/{value} of its GPU's memory), where NVIDIA's plugin takes any number from 2;"
            " use fewer",
        )
        return None
    return value


def _nvidia_pattern_resources(r: _Reader, value: object) -> None:
    """The top-level `resources` (gpus and mig lists of {pattern, name}): checked as NVIDIA's
    plugin checks them, then ignored with its warning, as it ignores them."""
    section = r.section(value, "resources", _NV_RESOURCES_KEYS, fold_case=True)
    customised = False
    for key, listed in section.items():
        list_path = _join("resources", key)
        for i, item in enumerate(r.items(listed, list_path)):
            item_path = f"{list_path}[{i}]"
            resource = r.section(item, item_path, _NV_PATTERN_KEYS, fold_case=True)
            if not isinstance(item, dict):
                continue
            customised = True
            for field in _NV_PATTERN_KEYS:
                if field not in resource:
                    r.error(item_path, _refused(f"resources must have a '{field}' field set"))
            if "pattern" in resource and not isinstance(resource["pattern"], str):
                pattern = resource["pattern"]
                r.error(_join(item_path, "pattern"), f"{_show(pattern)} is not a string")
            if "name" in resource:
                _nvidia_resource_name(r, resource["name"], _join(item_path, "name"))
    if customised:
        r.warn(
            "resources is ignored, as NVIDIA's plugin ignores it (\"Customizing the 'resources'"
            ' field is not yet supported in the config. Ignoring...").'
        )


def _nvidia_imex(r: _Reader, value: object) -> None:
    section = r.section(value, "imex", _NV_IMEX_KEYS, fold_case=True)
    channels = r.items(section.get("channelIDs"), "imex.channelIDs")
    for i, channel in enumerate(channels):
        r.integer(channel, f"imex.channelIDs[{i}]", 0)
    required = r.boolean(section["required"], "imex.required") if "required" in section else None
    if channels or required:
        r.warn("imex is ignored: vgpu does not pass IMEX channels to containers.")


def _parse_nvidia(r: _Reader, data: Mapping[str, object]) -> Config:
    top = r.section(data, "", _NV_TOP_KEYS, fold_case=True)
    defaults = Config()
    if "version" in top and top["version"] != "":
        r.version(top["version"], "version")

    flags = _nvidia_flags_section(r, top.get("flags"))
    nv_allocation = _nvidia_flags(r, flags)
    device_list = nv_allocation.strategies or defaults.allocation.device_list_strategy
    if nv_allocation.pass_device_specs and DeviceListStrategy.DEVICE_SPECS not in device_list:
        device_list = (*device_list, DeviceListStrategy.DEVICE_SPECS)
    mig_strategy = _nvidia_mig_strategy(r, flags)
    mps_root = _nvidia_mps_root(r, flags)

    _nvidia_pattern_resources(r, top.get("resources"))
    _nvidia_imex(r, top.get("imex"))
    health = _nvidia_health(r, top.get("health"))

    # timeSlicing: null is an empty section to NVIDIA's plugin (mps: null is an absent one).
    sharing = r.section(top.get("sharing"), "sharing", _NV_SHARING_KEYS, fold_case=True)
    raw_sharing = top.get("sharing")
    null_time_slicing = isinstance(raw_sharing, dict) and any(
        str(k).lower() == "timeslicing" and v is None for k, v in raw_sharing.items()
    )
    if null_time_slicing and "timeSlicing" not in sharing:
        sharing["timeSlicing"] = {}
    time_slicing = _nvidia_replicated(r, sharing.get("timeSlicing"), "timeSlicing")
    mps = _nvidia_replicated(r, sharing.get("mps"), "mps")
    if mps is not None and time_slicing is not None:
        r.warn(
            "sharing.timeSlicing is ignored: with sharing.mps, NVIDIA's plugin shares GPUs"
            " through MPS only, and so does vgpu."
        )
    chosen = mps or time_slicing
    if mps is not None:
        if mig_strategy is MigStrategy.MIXED:
            r.error(
                "flags.migStrategy",
                '"mixed": ' + _refused("using --mig-strategy=mixed is not supported with MPS"),
            )
        _warn_mps(r, mps, mps_root)
    elif mps_root is not None:
        r.warn(
            "flags.mpsRoot is ignored: vgpu runs MPS only for a sharing.mps resource,"
            " and none is listed."
        )
    elif time_slicing is not None and time_slicing.fail_requests_greater_than_one:
        _warn_fail_requests(r, time_slicing, "sharing.timeSlicing", "true")
    resource_name, slicing, mig = _nvidia_resources(
        r, chosen.resources if chosen else (), mig_strategy
    )
    return Config(
        resource_name=resource_name,
        slicing=slicing,
        allocation=AllocationConfig(
            policy=nv_allocation.policy or defaults.allocation.policy,
            device_list_strategy=device_list,
            device_id_strategy=(nv_allocation.device_ids or defaults.allocation.device_id_strategy),
            # NVIDIA's default: true with MPS, false with time-slicing.
            fail_requests_greater_than_one=(
                mps.fail_requests_greater_than_one is not False
                if mps is not None
                else time_slicing is not None and bool(time_slicing.fail_requests_greater_than_one)
            ),
        ),
        mps=MpsConfig(
            enabled=mps is not None,
            root=mps_root if mps is not None and mps_root else DEFAULT_MPS_ROOT,
        ),
        health=health,
        mig=mig,
        format=ConfigFormat.NVIDIA,
    )


def _warn_mps(r: _Reader, mps: _Sharing, mps_root: str | None) -> None:
    """What vgpu's MPS does differently from NVIDIA's, said once per file."""
    root = (
        ""
        if mps_root
        else f" flags.mpsRoot is not set (NVIDIA's chart passes /run/nvidia/mps), so vgpu uses"
        f" {DEFAULT_MPS_ROOT}."
    )
    r.warn(
        "sharing.mps: vgpu runs one MPS control daemon for the node, with its pipe directory"
        " at <mps root>/pipe (not NVIDIA's <mps root>/<resource>/pipe), and does not set"
        " the GPUs' compute mode to EXCLUSIVE_PROCESS: a process that bypasses MPS still"
        " reaches the GPU, and the poller enforces its container's limits." + root
    )
    if mps.fail_requests_greater_than_one is not False:
        written = (
            "true"
            if mps.fail_requests_greater_than_one
            else "not set, so true (NVIDIA's default with MPS)"
        )
        _warn_fail_requests(r, mps, "sharing.mps", written)


def _warn_fail_requests(r: _Reader, sharing: _Sharing, path: str, written: str) -> None:
    """failRequestsGreaterThanOne in effect: what a container asking for more meets."""
    names = ", ".join(sorted({m.advertised for m in sharing.resources})) or "a shared resource"
    r.warn(
        f"{path}.failRequestsGreaterThanOne: {written}: as NVIDIA's plugin does, vgpu"
        f" refuses a container that asks for more than 1 of {names} (its pod fails with"
        " UnexpectedAdmissionError); write failRequestsGreaterThanOne: false to give such a"
        " container the memory and compute of every slice it asks for."
    )


def _nvidia_resources(
    r: _Reader, resources: Sequence[_Replicated], strategy: MigStrategy
) -> tuple[str, SlicingConfig, MigConfig]:
    """What NVIDIA's plugin serves: full GPUs as nvidia.com/gpu, whole or with the replicas of a
    nvidia.com/gpu entry; with the mixed strategy each MIG profile as nvidia.com/mig-<profile>,
    whole or with its entry's replicas; with the single strategy MIG devices as nvidia.com/gpu,
    with the full GPUs' replicas. An entry under any other name replicates nothing."""
    resource_name = NVIDIA_GPU_RESOURCE
    default = SliceRule(replicas=1)
    overrides: list[SliceOverride] = []
    renames: list[tuple[str, str]] = []
    seen: set[str] = set()
    gpu_listed = False
    for resource in resources:
        if resource.name in seen:
            r.error(
                resource.path,
                f"{resource.name} is listed twice; keep one entry (vgpu refuses it, where"
                " NVIDIA's plugin serves the larger of the two replica counts)",
            )
            continue
        seen.add(resource.name)
        if resource.name == NVIDIA_GPU_RESOURCE:
            gpu_listed = True
            resource_name = resource.advertised
            default = SliceRule(replicas=resource.replicas)
        elif resource.name.startswith(MIG_RESOURCE_PREFIX) and strategy is MigStrategy.MIXED:
            profile = resource.name.removeprefix(MIG_RESOURCE_PREFIX)
            overrides.append(
                SliceOverride(GpuMatch(profile=profile), SliceRule(replicas=resource.replicas))
            )
            if resource.advertised != resource.name:
                renames.append((profile, resource.advertised))
        else:
            served = NVIDIA_GPU_RESOURCE + (
                " and nvidia.com/mig-<profile>" if strategy is MigStrategy.MIXED else ""
            )
            r.warn(
                f"{resource.path}.name: {resource.name} is ignored: with flags.migStrategy"
                f" {strategy.value} NVIDIA's plugin serves no device under that name (it serves"
                f" {served}), so it replicates nothing, and neither does vgpu."
            )
    if strategy is MigStrategy.SINGLE and gpu_listed:
        overrides.append(SliceOverride(GpuMatch(profile="*"), default))
    return (
        resource_name,
        SlicingConfig(default=default, overrides=tuple(overrides)),
        MigConfig(strategy=strategy, renames=tuple(renames)),
    )
