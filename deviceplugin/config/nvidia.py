"""NVIDIA k8s-device-plugin's config format (api/config/v1 of NVIDIA/k8s-device-plugin).

Users bring the file they already have. What vgpu can act on is mapped: the resources of
`sharing.timeSlicing` or `sharing.mps` become the resource name, slicing and MIG resources;
`flags` and `health` are read by `nvidia_flags`. Settings vgpu does not act on are accepted and
reported as warnings when they differ from NVIDIA's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.config.model import (
    DEFAULT_MPS_ROOT,
    DEFAULT_REPLICAS,
    DEFAULT_RESOURCE_NAME,
    MAX_REPLICAS,
    MIG_RESOURCE_PREFIX,
    AllocationConfig,
    Config,
    DeviceListStrategy,
    GpuMatch,
    MigConfig,
    MigStrategy,
    MpsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.config.nvidia_flags import (
    _nvidia_flags,
    _nvidia_health,
    _nvidia_mig_strategy,
    _nvidia_mps_root,
)
from deviceplugin.config.reader import (
    _join,
    _Reader,
    _resource_name_problem,
    _show,
)

_NVIDIA_PREFIX = "nvidia.com"
_NVIDIA_SHARED_SUFFIX = ".shared"
_NV_TOP_KEYS = ("version", "flags", "resources", "sharing", "imex", "health")
_NV_RESOURCES_KEYS = ("gpus", "mig")
_NV_SHARING_KEYS = ("timeSlicing", "mps")
_NV_REPLICATED_KEYS = ("renameByDefault", "failRequestsGreaterThanOne", "resources")
_NV_RESOURCE_KEYS = ("name", "replicas", "rename", "devices")


def _nvidia_resource_name(r: _Reader, value: object, path: str, suffix: str = "") -> str | None:
    """NVIDIA's resource names get the nvidia.com/ prefix when they have no domain."""
    name = r.string(value, path)
    if name is None:
        return None
    full = (name if "/" in name else f"{_NVIDIA_PREFIX}/{name}") + suffix
    problem = _resource_name_problem(full)
    if problem is not None:
        r.error(path, problem)
        return None
    return full


def _nvidia_devices(r: _Reader, value: object, path: str) -> None:
    """`devices`: "all", a positive count, or a list of GPU indices and UUIDs. vgpu slices every
    GPU, so anything but "all" is a warning."""
    ignored = (
        f"{path} is ignored: vgpu slices every GPU of the node (vgpu's own slicing.overrides"
        " can give GPUs different replicas)."
    )
    if value == "all":
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            r.error(path, f"{value} is too small (a count of devices must be >= 1)")
        else:
            r.warn(ignored)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int | str):
                r.error(f"{path}[{i}]", f"{_show(item)} is not a GPU index or UUID")
        r.warn(ignored)
        return
    r.error(path, f'{_show(value)} is not "all", a count or a list of GPU indices and UUIDs')


@dataclass(frozen=True, slots=True)
class _NvidiaSharing:
    resource_name: str | None  # as advertised: after rename or renameByDefault
    replicas: int | None
    base_name: str | None  # as named, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb
    path: str


def _nvidia_replicated(r: _Reader, value: object, path: str) -> list[_NvidiaSharing]:
    """sharing.timeSlicing or sharing.mps: its resources, in the file's order."""
    section = r.section(value, path, _NV_REPLICATED_KEYS)
    rename_by_default = False
    if "renameByDefault" in section:
        rename_by_default = bool(
            r.boolean(section["renameByDefault"], _join(path, "renameByDefault"))
        )
    if "failRequestsGreaterThanOne" in section:
        key_path = _join(path, "failRequestsGreaterThanOne")
        if r.boolean(section["failRequestsGreaterThanOne"], key_path):
            r.warn(
                f"{key_path}: true is ignored:"
                " vgpu accepts requests for several slices and gives the container"
                " the memory and compute of all of them.",
            )
    resources_path = _join(path, "resources")
    resources = r.items(section.get("resources"), resources_path)
    chosen: list[_NvidiaSharing] = []
    for i, item in enumerate(resources):
        item_path = f"{resources_path}[{i}]"
        resource = r.section(item, item_path, _NV_RESOURCE_KEYS)
        if not isinstance(item, dict):
            continue
        name: str | None = None
        base: str | None = None
        if "rename" in resource:
            name = _nvidia_resource_name(r, resource["rename"], _join(item_path, "rename"))
        if "name" not in resource:
            r.error(item_path, "needs a name, e.g. name: nvidia.com/gpu")
        else:
            suffix = _NVIDIA_SHARED_SUFFIX if rename_by_default else ""
            base = _nvidia_resource_name(r, resource["name"], _join(item_path, "name"))
            name = name or (base + suffix if base is not None else None)
        replicas: int | None = None
        if "replicas" not in resource:
            r.error(item_path, "needs replicas, e.g. replicas: 4")
        else:
            replicas = r.integer(
                resource["replicas"], _join(item_path, "replicas"), 1, MAX_REPLICAS
            )
        if "devices" in resource:
            _nvidia_devices(r, resource["devices"], _join(item_path, "devices"))
        chosen.append(_NvidiaSharing(name, replicas, base, item_path))
    return chosen


def _parse_nvidia(r: _Reader, data: Mapping[str, object]) -> Config:
    top = r.section(data, "", _NV_TOP_KEYS)
    defaults = Config()
    if "version" in top:
        r.version(top["version"], "version")

    policy, strategies, pass_specs = _nvidia_flags(r, top.get("flags"))
    device_list = strategies or defaults.allocation.device_list_strategy
    if pass_specs and DeviceListStrategy.DEVICE_SPECS not in device_list:
        device_list = (*device_list, DeviceListStrategy.DEVICE_SPECS)

    resources = r.section(top.get("resources"), "resources", _NV_RESOURCES_KEYS)
    for key, value in resources.items():
        if r.items(value, _join("resources", key)):
            r.warn(
                f"resources.{key} is ignored: vgpu advertises every GPU under the one resource"
                " name of the sharing section.",
            )
    if top.get("imex"):
        r.warn("imex is ignored: vgpu does not pass IMEX channels.")
    health = _nvidia_health(r, top.get("health"))

    mig_strategy = _nvidia_mig_strategy(r, top.get("flags"))
    sharing = r.section(top.get("sharing"), "sharing", _NV_SHARING_KEYS)
    time_slicing = _nvidia_replicated(r, sharing.get("timeSlicing"), "sharing.timeSlicing")
    mps = _nvidia_replicated(r, sharing.get("mps"), "sharing.mps")
    if time_slicing and mps:
        r.error(
            "sharing",
            "timeSlicing and mps both list resources; vgpu shares GPUs one way, so keep one",
        )
    chosen = mps or time_slicing
    flags = top.get("flags")
    mps_root = _nvidia_mps_root(r, flags) if isinstance(flags, dict) else None
    if mps:
        r.warn(
            "sharing.mps: vgpu runs one MPS control daemon for the node, with its pipe directory"
            " at <mps root>/pipe (not NVIDIA's <mps root>/<resource>/pipe), and does not set"
            " the GPUs' compute mode to EXCLUSIVE_PROCESS: a process that bypasses MPS still"
            " reaches the GPU, and the poller enforces its container's limits."
        )
    elif mps_root is not None:
        r.warn(
            "flags.mpsRoot is ignored: vgpu runs MPS only for a sharing.mps resource,"
            " and none is listed."
        )
    resource_name = defaults.resource_name
    slicing = defaults.slicing
    mig = MigConfig(strategy=mig_strategy)
    if not chosen:
        r.warn(
            "sharing: no timeSlicing or mps resource is listed, so vgpu uses its defaults:"
            f" {defaults.resource_name} with {DEFAULT_REPLICAS} slices per GPU.",
        )
    else:
        resource_name, slicing, mig = _nvidia_resources(r, chosen, mig_strategy)

    return Config(
        resource_name=resource_name,
        slicing=slicing,
        allocation=AllocationConfig(
            policy=policy or defaults.allocation.policy, device_list_strategy=device_list
        ),
        mps=MpsConfig(
            enabled=bool(mps),
            root=(mps_root if mps and mps_root else DEFAULT_MPS_ROOT),
        ),
        health=health,
        mig=mig,
    )


def _nvidia_resources(
    r: _Reader, resources: Sequence[_NvidiaSharing], strategy: MigStrategy
) -> tuple[str, SlicingConfig, MigConfig]:
    """The shared resources of NVIDIA's file: one name for full GPUs (`nvidia.com/gpu` or any
    name that is not a MIG profile's), and with the mixed strategy one `mig-<profile>` name per
    MIG profile, each with its replicas. With the single strategy the full GPUs' replicas apply to
    MIG devices too, as in NVIDIA's plugin, where MIG devices are then `nvidia.com/gpu`."""
    resource_name = DEFAULT_RESOURCE_NAME
    default = SlicingConfig().default
    gpu_names: list[str] = []
    overrides: list[SliceOverride] = []
    renames: list[tuple[str, str]] = []
    seen: set[str] = set()
    for resource in resources:
        if resource.base_name is None or resource.resource_name is None:
            continue
        if resource.base_name in seen:
            r.error(resource.path, f"{resource.base_name} is listed twice; keep one entry")
            continue
        seen.add(resource.base_name)
        if resource.base_name.startswith(MIG_RESOURCE_PREFIX):
            profile = resource.base_name.removeprefix(MIG_RESOURCE_PREFIX)
            if strategy is not MigStrategy.MIXED:
                r.error(
                    _join(resource.path, "name"),
                    f"{resource.base_name} names a MIG profile, which is advertised on its own"
                    f" only with flags.migStrategy: mixed (it is {strategy.value})",
                )
                continue
            if resource.replicas is not None:
                overrides.append(
                    SliceOverride(GpuMatch(profile=profile), SliceRule(replicas=resource.replicas))
                )
            if resource.resource_name != resource.base_name:
                renames.append((profile, resource.resource_name))
            continue
        gpu_names.append(resource.resource_name)
        resource_name = resource.resource_name
        if resource.replicas is not None:
            default = SliceRule(replicas=resource.replicas)
    if len(gpu_names) > 1:
        r.error(
            resources[0].path.rpartition("[")[0],
            f"lists {len(gpu_names)} resources for full GPUs ({', '.join(gpu_names)}); vgpu"
            " advertises full GPUs under one name, so keep one (MIG profiles may each have"
            " their own nvidia.com/mig-<profile> entry with flags.migStrategy: mixed)",
        )
    if strategy is MigStrategy.SINGLE and gpu_names:
        overrides.append(SliceOverride(GpuMatch(profile="*"), default))
    return (
        resource_name,
        SlicingConfig(default=default, overrides=tuple(overrides)),
        MigConfig(strategy=strategy, renames=tuple(renames)),
    )
