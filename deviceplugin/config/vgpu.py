"""vgpu's own config format (`version: v1`): its keys, section by section, read into a Config.
Every problem is recorded on the _Reader with its key path; parse_config raises them together.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from deviceplugin.config.dra import (
    DraConfig,
)
from deviceplugin.config.health import (
    HealthConfig,
)
from deviceplugin.config.model import (
    DEFAULT_MPS_ROOT,
    NFD_FEATURE_NAME,
    AllocationConfig,
    ComputeEnforcement,
    Config,
    EnforcementConfig,
    GpuMatch,
    MemoryEnforcement,
    MigConfig,
    MpsConfig,
    NodeLabelsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.config.reader import (
    _join,
    _Reader,
    _show,
    format_duration,
)
from deviceplugin.config.values import (
    MAX_POLL_INTERVAL_S,
    MAX_REPLICAS,
    MIN_COMPUTE_PERIOD_S,
    MIN_HANG_TIMEOUT_S,
    MIN_MEMORY_PER_SLICE_BYTES,
    MIN_POLL_INTERVAL_S,
    AllocationPolicy,
    ComputeAction,
    MemoryAction,
    MigStrategy,
    RecoveryPolicy,
)

_POLICIES: dict[str, AllocationPolicy] = {
    "pack": AllocationPolicy.PACK,
    "spread": AllocationPolicy.SPREAD,
    # NVIDIA k8s-device-plugin's names for the same policies.
    "packed": AllocationPolicy.PACK,
    "distributed": AllocationPolicy.SPREAD,
}
_MEMORY_ACTIONS: dict[str, MemoryAction] = {a.value: a for a in MemoryAction}
_COMPUTE_ACTIONS: dict[str, ComputeAction] = {a.value: a for a in ComputeAction}
_RECOVERY_POLICIES: dict[str, RecoveryPolicy] = {p.value: p for p in RecoveryPolicy}

_TOP_KEYS = (
    "version",
    "resourceName",
    "slicing",
    "allocation",
    "enforcement",
    "mps",
    "health",
    "nodeLabels",
    "mig",
    "dra",
)
_NODE_LABELS_KEYS = ("file", "path")
_DRA_KEYS = ("driverName", "memory", "compute")
# A DRA driver's name: a DNS subdomain (the kubelet's plugin name, a ResourceSlice's driver).
_DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DRA_AMOUNT_KEYS = ("min", "step", "default")
_SLICING_KEYS = ("replicas", "memoryPerSlice", "overrides")
_OVERRIDE_KEYS = ("match", "replicas", "memoryPerSlice")
_MATCH_KEYS = ("model", "index", "uuid", "profile")
_MIG_KEYS = ("strategy",)
_ALLOCATION_KEYS = (
    "policy",
    "deviceListStrategy",
    "deviceIDStrategy",
    "frameworkHints",
    "contextReserve",
)
_ENFORCEMENT_KEYS = ("pollInterval", "idlePollInterval", "dryRun", "memory", "compute")
_MEMORY_KEYS = ("action", "gracePeriod")
_COMPUTE_KEYS = ("action", "window", "period", "workConserving")
_MPS_KEYS = ("enabled", "root", "controlCommand")
_HEALTH_KEYS = (
    "enabled",
    "ignoredXids",
    "additionalIgnoredXids",
    "criticalXids",
    "recovery",
    "recoveryDelay",
    "hangTimeout",
)


def _slice_rule(r: _Reader, section: Mapping[str, object], path: str) -> SliceRule | None:
    """replicas or memoryPerSlice (exactly one) of a slicing section or an override; None if
    neither is set or a value is invalid."""
    has_replicas = "replicas" in section
    has_memory = "memoryPerSlice" in section
    replicas = (
        r.integer(section["replicas"], _join(path, "replicas"), 1, MAX_REPLICAS)
        if has_replicas
        else None
    )
    memory = (
        r.size(section["memoryPerSlice"], _join(path, "memoryPerSlice")) if has_memory else None
    )
    if memory is not None and memory < MIN_MEMORY_PER_SLICE_BYTES:
        r.error(
            _join(path, "memoryPerSlice"),
            f"{_show(section['memoryPerSlice'])} is too small (must be >= "
            f"{MIN_MEMORY_PER_SLICE_BYTES >> 20}Mi: a slice must hold a CUDA context)",
        )
        return None
    if has_replicas and has_memory:
        r.error(path, "set either replicas or memoryPerSlice, not both")
        return None
    if replicas is not None:
        return SliceRule(replicas=replicas)
    if memory is not None:
        return SliceRule(memory_per_slice_bytes=memory)
    return None


def _gpu_match(r: _Reader, value: object, path: str) -> GpuMatch | None:
    section = r.section(value, path, _MATCH_KEYS)
    if not section:
        if value is None or value == {}:
            r.error(path, f"needs at least one of {', '.join(_MATCH_KEYS)}")
        return None
    model = r.string(section["model"], _join(path, "model")) if "model" in section else None
    index = r.integer(section["index"], _join(path, "index"), 0) if "index" in section else None
    uuid = r.string(section["uuid"], _join(path, "uuid")) if "uuid" in section else None
    profile = r.string(section["profile"], _join(path, "profile")) if "profile" in section else None
    return GpuMatch(model=model, index=index, uuid=uuid, profile=profile)


def _slicing(r: _Reader, value: object) -> SlicingConfig:
    path = "slicing"
    section = r.section(value, path, _SLICING_KEYS)
    default = SlicingConfig().default
    if "replicas" in section or "memoryPerSlice" in section:
        default = _slice_rule(r, section, path) or default
    overrides: list[SliceOverride] = []
    for i, item in enumerate(r.items(section.get("overrides"), _join(path, "overrides"))):
        item_path = f"{path}.overrides[{i}]"
        override = r.section(item, item_path, _OVERRIDE_KEYS)
        if not isinstance(item, dict):
            continue
        match: GpuMatch | None = None
        if "match" in override:
            match = _gpu_match(r, override["match"], _join(item_path, "match"))
        else:
            r.error(item_path, 'needs a match, e.g. match: {model: "*A100*"}')
        if "replicas" not in override and "memoryPerSlice" not in override:
            r.error(item_path, "needs replicas or memoryPerSlice")
        rule = _slice_rule(r, override, item_path)
        if match is not None and rule is not None:
            overrides.append(SliceOverride(match=match, rule=rule))
    return SlicingConfig(default=default, overrides=tuple(overrides))


def _allocation(r: _Reader, value: object) -> AllocationConfig:
    path = "allocation"
    section = r.section(value, path, _ALLOCATION_KEYS)
    defaults = AllocationConfig()
    policy = defaults.policy
    if "policy" in section:
        shown = "pack, spread (NVIDIA's packed, distributed are accepted too)"
        policy = r.choice(section["policy"], _join(path, "policy"), _POLICIES, shown) or policy
    strategies = defaults.device_list_strategy
    if "deviceListStrategy" in section:
        parsed = r.strategies(section["deviceListStrategy"], _join(path, "deviceListStrategy"))
        strategies = parsed or strategies
    id_strategy = defaults.device_id_strategy
    if "deviceIDStrategy" in section:
        id_strategy = (
            r.device_id_strategy(section["deviceIDStrategy"], _join(path, "deviceIDStrategy"))
            or id_strategy
        )
    hints = defaults.framework_hints
    if "frameworkHints" in section:
        parsed_hints = r.boolean(section["frameworkHints"], _join(path, "frameworkHints"))
        hints = hints if parsed_hints is None else parsed_hints
    reserve = defaults.context_reserve_bytes
    if "contextReserve" in section:
        value = section["contextReserve"]
        # 0 is a valid reserve (no room kept for the CUDA context), unlike other sizes.
        zero = (value == 0 and not isinstance(value, bool)) or value == "0"
        parsed_reserve = 0 if zero else r.size(value, _join(path, "contextReserve"))
        reserve = reserve if parsed_reserve is None else parsed_reserve
    return AllocationConfig(
        policy=policy,
        device_list_strategy=strategies,
        device_id_strategy=id_strategy,
        framework_hints=hints,
        context_reserve_bytes=reserve,
    )


def _enforcement(r: _Reader, value: object) -> EnforcementConfig:
    path = "enforcement"
    section = r.section(value, path, _ENFORCEMENT_KEYS)
    defaults = EnforcementConfig()

    def poll_interval(key: str, default_s: float) -> float:
        if key not in section:
            return default_s
        parsed = r.duration(
            section[key], _join(path, key), MIN_POLL_INTERVAL_S, MAX_POLL_INTERVAL_S
        )
        return default_s if parsed is None else parsed

    poll = poll_interval("pollInterval", defaults.poll_interval_s)
    idle_poll = poll_interval("idlePollInterval", defaults.idle_poll_interval_s)

    dry_run = defaults.dry_run
    if "dryRun" in section:
        parsed_dry_run = r.boolean(section["dryRun"], _join(path, "dryRun"))
        dry_run = dry_run if parsed_dry_run is None else parsed_dry_run

    memory_path = _join(path, "memory")
    memory = r.section(section.get("memory"), memory_path, _MEMORY_KEYS)
    memory_action = defaults.memory.action
    if "action" in memory:
        shown = ", ".join(_MEMORY_ACTIONS)
        action_path = _join(memory_path, "action")
        memory_action = r.choice(memory["action"], action_path, _MEMORY_ACTIONS, shown) or (
            memory_action
        )
    grace = defaults.memory.grace_period_s
    if "gracePeriod" in memory:
        parsed = r.duration(memory["gracePeriod"], _join(memory_path, "gracePeriod"), 0.0)
        grace = grace if parsed is None else parsed

    compute_path = _join(path, "compute")
    compute = r.section(section.get("compute"), compute_path, _COMPUTE_KEYS)
    compute_action = defaults.compute.action
    if "action" in compute:
        shown = ", ".join(_COMPUTE_ACTIONS)
        action_path = _join(compute_path, "action")
        compute_action = r.choice(compute["action"], action_path, _COMPUTE_ACTIONS, shown) or (
            compute_action
        )
    window: float | None = defaults.compute.window_s
    if "window" in compute:
        window = r.duration(compute["window"], _join(compute_path, "window"), 0.0)
    period: float | None = defaults.compute.period_s
    if "period" in compute:
        period = r.duration(compute["period"], _join(compute_path, "period"), MIN_COMPUTE_PERIOD_S)
    if window is not None and period is not None and window < period:
        r.error(
            _join(compute_path, "window"),
            f"{format_duration(window)} is shorter than period {format_duration(period)}"
            " (the window must hold at least one duty cycle)",
        )
    work_conserving = defaults.compute.work_conserving
    if "workConserving" in compute:
        parsed_bool = r.boolean(compute["workConserving"], _join(compute_path, "workConserving"))
        work_conserving = work_conserving if parsed_bool is None else parsed_bool

    return EnforcementConfig(
        poll_interval_s=poll,
        idle_poll_interval_s=idle_poll,
        dry_run=dry_run,
        memory=MemoryEnforcement(action=memory_action, grace_period_s=grace),
        compute=ComputeEnforcement(
            action=compute_action,
            window_s=defaults.compute.window_s if window is None else window,
            period_s=defaults.compute.period_s if period is None else period,
            work_conserving=work_conserving,
        ),
    )


def _mps_root(r: _Reader, value: object, path: str) -> str | None:
    root = r.string(value, path)
    if root is None:
        return None
    if not root.startswith("/"):
        r.error(path, f"{_show(root)} is not an absolute path (e.g. {DEFAULT_MPS_ROOT})")
        return None
    # Containers get <root>/pipe at the same path: keep it a plain, normalised path.
    if os.path.normpath(root) != root or any(c in root for c in ",:\n"):
        r.error(path, f"{_show(root)} is not a normalised path without commas or colons")
        return None
    return root


def _mps(r: _Reader, value: object) -> MpsConfig:
    section = r.section(value, "mps", _MPS_KEYS)
    defaults = MpsConfig()
    enabled = defaults.enabled
    if "enabled" in section:
        parsed = r.boolean(section["enabled"], "mps.enabled")
        enabled = enabled if parsed is None else parsed
    root = defaults.root
    if "root" in section:
        root = _mps_root(r, section["root"], "mps.root") or root
    command = defaults.control_command
    if "controlCommand" in section:
        parsed_command = r.string(section["controlCommand"], "mps.controlCommand")
        if parsed_command is not None and not parsed_command.strip():
            r.error("mps.controlCommand", "is empty (the default is nvidia-cuda-mps-control)")
        elif parsed_command is not None:
            command = parsed_command
    return MpsConfig(enabled=enabled, root=root, control_command=command)


def feature_file_name_problem(name: str) -> str | None:
    """Why `name` cannot name the node feature file (a file name, not a path), or None."""
    if "/" in name:
        return "is a path, not a file name: the file is written in the daemon's --node-features-dir"
    if name.startswith("."):
        return "starts with a dot (NFD skips hidden files; the daemon's temporary files are hidden)"
    if len(name) > 200:
        return "is longer than 200 characters"
    if not name.isascii() or not all(c.isalnum() or c in "-_." for c in name):
        return "has characters other than letters, digits, '-', '_' and '.'"
    return None


def _node_labels(r: _Reader, value: object) -> NodeLabelsConfig:
    section = r.section(value, "nodeLabels", _NODE_LABELS_KEYS)
    if "file" in section and section.get("path", "") != "":
        r.error("nodeLabels", "sets both file and path; keep file (path is the old spelling)")
        return NodeLabelsConfig()
    if section.get("file", "") != "":
        name = r.string(section["file"], "nodeLabels.file")
        problem = None if name is None else feature_file_name_problem(name)
        if problem is not None:
            r.error("nodeLabels.file", f"{_show(name)} {problem}; use e.g. {NFD_FEATURE_NAME}")
            return NodeLabelsConfig()
        return NodeLabelsConfig(file=name or "")
    if section.get("path", "") == "":
        return NodeLabelsConfig()
    path = r.string(section["path"], "nodeLabels.path")
    if path is None:
        return NodeLabelsConfig()
    directory, _, name = path.rpartition("/")
    problem = feature_file_name_problem(name) if name else "has no file name"
    if not path.startswith("/") or os.path.normpath(path) != path or problem is not None:
        r.error(
            "nodeLabels.path",
            f"{_show(path)} is not an absolute, normalised path to a file"
            f"{'' if problem is None else f' (its file name {problem})'}; "
            f"use nodeLabels.file: {NFD_FEATURE_NAME} instead",
        )
        return NodeLabelsConfig()
    r.warn(
        f"nodeLabels.path is the old spelling: it is read as nodeLabels.file: {name}, and the "
        f"file is written only when the daemon's --node-features-dir is {directory or '/'}; "
        f"write nodeLabels.file: {name} instead"
    )
    return NodeLabelsConfig(file=name, legacy_directory=directory or "/")


# The API server's limit on a DRA driver's name.
MAX_DRIVER_NAME_LENGTH = 63


def driver_name_problem(name: str) -> str | None:
    """Why `name` cannot be a DRA driver's name here; None when it can. Besides the API
    server's rules (a DNS subdomain of at most 63 characters), it names the CDI kind of each
    claim's spec (`<name>/claim`), and a CDI vendor must start with a letter."""
    if not _DRIVER_NAME.fullmatch(name):
        return f"{_show(name)} is not a DNS subdomain like vgpu.dev"
    if len(name) > MAX_DRIVER_NAME_LENGTH:
        return f"{_show(name)} is longer than {MAX_DRIVER_NAME_LENGTH} characters"
    if not name[0].isalpha():
        return (
            f"{_show(name)} starts with a digit: it names the CDI kind of each claim's spec "
            f"({name}/claim), and a CDI vendor must start with a letter, so the container "
            "runtime would refuse every claim's container; use a name that starts with a "
            "letter, like gpu.example.com"
        )
    return None


def _dra(r: _Reader, value: object) -> DraConfig:
    section = r.section(value, "dra", _DRA_KEYS)
    d = DraConfig()
    driver = d.driver_name
    if "driverName" in section:
        name = r.string(section["driverName"], "dra.driverName")
        problem = None if name is None else driver_name_problem(name)
        if problem is not None:
            r.error("dra.driverName", problem)
        elif name is not None:
            driver = name
    memory = r.section(section.get("memory"), "dra.memory", _DRA_AMOUNT_KEYS)
    sizes: dict[str, int | None] = {
        "min": d.memory_min_bytes,
        "step": d.memory_step_bytes,
        "default": d.memory_default_bytes,
    }
    for key in _DRA_AMOUNT_KEYS:
        if key in memory:
            size = r.size(memory[key], f"dra.memory.{key}")
            if size == 0:
                r.error(f"dra.memory.{key}", "is 0; give an amount such as 256Mi")
            sizes[key] = size or sizes[key]
    compute = r.section(section.get("compute"), "dra.compute", _DRA_AMOUNT_KEYS)
    percents: dict[str, int | None] = {
        "min": d.compute_min,
        "step": d.compute_step,
        "default": d.compute_default,
    }
    for key in _DRA_AMOUNT_KEYS:
        if key in compute:
            percents[key] = r.integer(compute[key], f"dra.compute.{key}", 1, 100) or percents[key]
    return DraConfig(
        driver_name=driver,
        memory_min_bytes=sizes["min"] or d.memory_min_bytes,
        memory_step_bytes=sizes["step"] or d.memory_step_bytes,
        memory_default_bytes=sizes["default"],
        compute_min=percents["min"] or d.compute_min,
        compute_step=percents["step"] or d.compute_step,
        compute_default=percents["default"],
    )


def _health(r: _Reader, value: object) -> HealthConfig:
    path = "health"
    section = r.section(value, path, _HEALTH_KEYS)
    defaults = HealthConfig()
    enabled = defaults.enabled
    if "enabled" in section:
        parsed_bool = r.boolean(section["enabled"], _join(path, "enabled"))
        enabled = enabled if parsed_bool is None else parsed_bool
    lists: dict[str, tuple[int, ...]] = {}
    for key, default in (
        ("ignoredXids", defaults.ignored_xids),
        ("additionalIgnoredXids", defaults.additional_ignored_xids),
        ("criticalXids", defaults.critical_xids),
    ):
        parsed_xids = r.xids(section[key], _join(path, key)) if key in section else None
        lists[key] = default if parsed_xids is None else parsed_xids
    # criticalXids wins over the default ignore list; an Xid written both as ignored and as
    # critical is a contradiction.
    for key in ("ignoredXids", "additionalIgnoredXids"):
        if key not in section:
            continue
        both = [x for x in lists["criticalXids"] if x in lists[key]]
        if both:
            shown = ", ".join(str(x) for x in both)
            r.error(
                _join(path, "criticalXids"),
                f"{shown} also listed in {_join(path, key)}; list each Xid in one of them",
            )
    recovery = defaults.recovery
    if "recovery" in section:
        recovery = (
            r.choice(
                section["recovery"],
                _join(path, "recovery"),
                _RECOVERY_POLICIES,
                ", ".join(_RECOVERY_POLICIES),
            )
            or recovery
        )
    delay = defaults.recovery_delay_s
    if "recoveryDelay" in section:
        parsed = r.duration(section["recoveryDelay"], _join(path, "recoveryDelay"), 0.0)
        delay = delay if parsed is None else parsed
    hang = defaults.hang_timeout_s
    if "hangTimeout" in section:
        parsed = r.duration(section["hangTimeout"], _join(path, "hangTimeout"), MIN_HANG_TIMEOUT_S)
        hang = hang if parsed is None else parsed
    return HealthConfig(
        enabled=enabled,
        ignored_xids=lists["ignoredXids"],
        additional_ignored_xids=lists["additionalIgnoredXids"],
        critical_xids=lists["criticalXids"],
        recovery=recovery,
        recovery_delay_s=delay,
        hang_timeout_s=hang,
    )


_MIG_STRATEGIES = {s.value: s for s in MigStrategy}


def _mig(r: _Reader, value: object) -> MigConfig:
    section = r.section(value, "mig", _MIG_KEYS)
    if "strategy" not in section:
        return MigConfig()
    shown = ", ".join(_MIG_STRATEGIES)
    strategy = r.choice(section["strategy"], "mig.strategy", _MIG_STRATEGIES, shown)
    return MigConfig(strategy=strategy or MigStrategy.NONE)


def _parse_vgpu(r: _Reader, data: object) -> Config:
    top = r.section(data, "", _TOP_KEYS)
    defaults = Config()
    version = defaults.version
    if "version" in top:
        version = r.version(top["version"], "version") or version
    resource_name = defaults.resource_name
    if "resourceName" in top:
        resource_name = r.resource_name(top["resourceName"], "resourceName") or resource_name
    return Config(
        version=version,
        resource_name=resource_name,
        slicing=_slicing(r, top.get("slicing")),
        allocation=_allocation(r, top.get("allocation")),
        enforcement=_enforcement(r, top.get("enforcement")),
        mps=_mps(r, top.get("mps")),
        health=_health(r, top.get("health")),
        node_labels=_node_labels(r, top.get("nodeLabels")),
        mig=_mig(r, top.get("mig")),
        dra=_dra(r, top.get("dra")),
    )
