"""`vgpu-device-plugin check-config`: validate a config and print the slicing plan per GPU."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from deviceplugin.allocation import (
    format_hundredths,
    memory_fraction_hundredths,
    mps_defaults,
    mps_log_directory,
    mps_pipe_directory,
)
from deviceplugin.config import (
    ComputeAction,
    Config,
    ConfigFormat,
    DeviceIdStrategy,
    MemoryAction,
    format_duration,
    format_size,
    load_config,
)
from deviceplugin.dra.slices import build_devices, build_slice, slice_problems
from deviceplugin.enforcement_mode import FLAG as ENFORCE_FLAG
from deviceplugin.enforcement_mode import in_monitor_mode, mode_line
from deviceplugin.errors import BackendError, ConfigError
from deviceplugin.kubelet.limits import device_list_problem
from deviceplugin.model import GpuInfo, GpuPlan, Inventory
from deviceplugin.slicing import format_bytes, plan_gpus

EXIT_OK = 0
EXIT_INVALID = 2
# The config is valid, but the GPUs of --backend cannot be read (no driver, no state file): not a
# config error, so not 2.
EXIT_BACKEND = 3


def _gpus_of(backend_spec: str) -> list[GpuInfo]:
    from deviceplugin.gpu.backend import open_backend  # noqa: PLC0415 (only when asked)

    backend = open_backend(backend_spec)
    try:
        return [g.info for g in backend.poll().gpus]
    finally:
        backend.close()


# Shown for a MIG device's slices: NVML has no utilisation per MIG device, so their compute
# share is not measured and never throttled (their memory limit is enforced).
MIG_COMPUTE = "not enforced"


def render_plan(plans: tuple[GpuPlan, ...], resource_name: str) -> list[str]:
    """The plan as a table that fits 80 columns. A GPU's MIG devices follow it, indented, with
    their profile and resource name."""
    lines = [
        f"{'GPU':>3}  {'MODEL':<26} {'MEMORY':>8} {'SLICES':>6} "
        f"{'MEM/SLICE':>9} {'COMPUTE/SLICE':>13}"
    ]
    totals: dict[str, int] = {resource_name: 0}
    for plan in plans:
        gpu = plan.gpu
        pad = "  " if gpu.is_mig_device else ""
        if gpu.is_mig_device:
            label = "   "
            name = f"└ MIG {gpu.mig_profile} (GI {gpu.gpu_instance_id})"
        else:
            label = f"{gpu.index:>3}"
            name = gpu.name
        model = name if len(name) <= 26 else name[:25] + "…"
        memory = format_bytes(gpu.memory_total_bytes)
        if not plan.sliced:
            lines.append(f"{label}  {model:<26} {memory:>8} {0:>6}  not sliced:")
            lines.append(f"{pad}     {plan.excluded_reason}")
            continue
        totals[plan.resource_name] = totals.get(plan.resource_name, 0) + plan.replicas
        share = MIG_COMPUTE if gpu.is_mig_device else f"{plan.compute_share_ratio * 100:.4g}%"
        lines.append(
            f"{label}  {model:<26} {memory:>8} {plan.replicas:>6} "
            f"{format_bytes(plan.memory_per_slice_bytes):>9} {share:>13}"
        )
        if plan.resource_name != resource_name:
            lines.append(f"{pad}     as {plan.resource_name}")
    full = [p for p in plans if not p.gpu.is_mig_device]
    sliced = sum(1 for p in full if p.sliced)
    mig_sliced = sum(1 for p in plans if p.gpu.is_mig_device and p.sliced)
    mig_primary = sum(
        1 for p in plans if p.gpu.is_mig_device and p.sliced and p.resource_name == resource_name
    )
    where = f"{sliced} of {len(full)} GPUs"
    if mig_primary:
        where += f" and {mig_primary} MIG devices"
    lines.append(f"total: {totals.pop(resource_name)} slices of {resource_name} on {where}")
    for name, count in sorted(totals.items()):
        devices = sum(1 for p in plans if p.sliced and p.resource_name == name)
        lines.append(f"total: {count} slices of {name} on {devices} MIG devices")
    if mig_sliced:
        lines.append("MIG slices: memory limits are enforced; compute is not measurable per MIG")
        lines.append("device through NVML, so their compute share is not enforced (no throttling)")
    return lines


def describe(config: Config) -> str:
    strategies = ",".join(s.value for s in config.allocation.device_list_strategy)
    hints = config.allocation
    return (
        f"resource {config.resource_name}, allocation policy {config.allocation.policy.value}, "
        f"device list {strategies}"
        + (" by index" if config.allocation.device_id_strategy is DeviceIdStrategy.INDEX else "")
        + f", MPS {'on' if config.mps.enabled else 'off'}, "
        "framework hints "
        + (
            f"on (context reserve {format_size(hints.context_reserve_bytes)})"
            if hints.framework_hints
            else "off"
        )
        + f", MIG strategy {config.mig.strategy.value}"
    )


def render_limits(plans: tuple[GpuPlan, ...], config: Config) -> list[str]:
    """What a one-slice container is told (framework hints) and, with MPS, what the control
    daemon is told: the lines under the plan."""
    sliced = [p for p in plans if p.sliced]
    lines: list[str] = []
    if config.allocation.framework_hints and sliced:
        reserve = config.allocation.context_reserve_bytes
        fractions = []
        for plan in sliced:
            h = memory_fraction_hundredths(
                plan.memory_per_slice_bytes, reserve, plan.gpu.memory_total_bytes
            )
            fractions.append(f"GPU {plan.gpu.index} " + (format_hundredths(h) if h else "none"))
        lines.append(
            "memory fraction a one-slice container is told, after the "
            f"{format_size(reserve)} context reserve:"
        )
        lines.append(
            "  " + ", ".join(fractions) + "  (XLA_PYTHON_CLIENT_MEM_FRACTION, "
            "VGPU_MEMORY_FRACTION_0)"
        )
    if config.mps.enabled:
        mps = config.mps
        lines.append(
            f"MPS: {mps.control_command} -d, pipe {mps_pipe_directory(mps.root)}, "
            f"log {mps_log_directory(mps.root)},"
        )
        lines.append("  then, on its stdin:")
        commands = mps_defaults(plans).commands()
        lines.extend(f"  {c}" for c in commands or ("(nothing: no GPU is sliced)",))
    return lines


def nvidia_meaning(config: Config) -> str:
    """What NVIDIA's plugin serves for this NVIDIA config, as vgpu serves it too."""
    how = "MPS" if config.mps.enabled else "time-slicing"
    replicas = config.slicing.default.replicas or 1
    served = (
        f"{config.resource_name}, whole GPUs (1 per GPU)"
        if replicas == 1
        else f"{config.resource_name}, {replicas} per GPU shared by {how}"
    )
    mig = config.mig.strategy.value
    return f"read as NVIDIA k8s-device-plugin's config: {served}; MIG strategy {mig}"


def beyond_nvidia(
    plans: tuple[GpuPlan, ...], config: Config, *, enforce_nvidia_config: bool = False
) -> list[str]:
    """What vgpu does with an NVIDIA config that NVIDIA's plugin does not, and where the two
    serve a GPU differently: the lines under the plan, so that nobody moving over is surprised
    by a kill, a pause or a missing GPU. In monitor mode (deviceplugin/enforcement_mode.py)
    the kills and pauses are only what vgpu would do."""
    shared = [p for p in plans if p.sliced and p.replicas > 1]
    e = config.enforcement
    monitor = in_monitor_mode(config, enforce_nvidia_config)
    lines = ["beyond NVIDIA's plugin, vgpu also:"]
    if shared:
        grace = format_duration(e.memory.grace_period_s)
        lines.append("  holds each slice to its share of the GPU's memory (MEM/SLICE):")
        if e.memory.action is MemoryAction.KILL:
            kills = "would kill" if monitor else "kills"
            lines.append(f"    {kills} a container's largest GPU process after {grace} above it")
            if monitor:
                lines.append("    (logs and counts it as would_kill, signals nothing)")
        else:
            lines.append("    records (does not stop) a container above it")
        if e.compute.action is ComputeAction.THROTTLE and not config.mps.enabled:
            lines.append(
                f"  {'would pause' if monitor else 'pauses'} a container above its compute share"
                " (COMPUTE/SLICE)"
            )
            lines.append("    while others wait; NVIDIA's time-slicing gives every process")
            lines.append(
                "    equal turns" + (" (logs and counts it as would_throttle)" if monitor else "")
            )
        if monitor:
            lines.append(f"  (monitor mode: to enforce, serve {ENFORCE_FLAG} true; the file")
            lines.append("    stays as it is)")
        else:
            lines.append(f"  ({ENFORCE_FLAG} true: to only record, leave it false)")
    else:
        lines.append("  nothing to enforce on whole GPUs: a container has all of its GPU")
    lines.append("  measures memory and utilisation per GPU and per container (/metrics,")
    lines.append("    /status, `vgpu-device-plugin status`)")
    whole_mig = [
        p.gpu.index for p in plans if p.gpu.mig_enabled and not p.gpu.is_mig_device and not p.sliced
    ]
    if whole_mig and config.mig.strategy.value == "none":
        gpus = ", ".join(str(i) for i in whole_mig)
        lines.append(f"differs from NVIDIA's plugin: GPU {gpus} in MIG mode is left out; with")
        lines.append("  migStrategy none NVIDIA's plugin serves it whole as nvidia.com/gpu")
    return lines


def check_config(
    path: Path, backend_spec: str, out: TextIO, err: TextIO, *, enforce_nvidia_config: bool = False
) -> int:
    try:
        config = load_config(path)
    except ConfigError as e:
        for problem in e.problems:
            print(f"{e.source}: {problem}", file=err)
        count = len(e.problems)
        print(f"{path}: invalid ({count} problem{'s' if count != 1 else ''})", file=err)
        return EXIT_INVALID
    print(f"{path}: valid ({describe(config)})", file=out)
    if config.format is ConfigFormat.NVIDIA:
        print(nvidia_meaning(config), file=out)
    mode = mode_line(config, enforce_nvidia_config)
    if mode:
        print(mode, file=out)
    for warning in config.warnings:
        print(f"warning: {warning}", file=out)
    if backend_spec:
        try:
            gpus = _gpus_of(backend_spec)
        except BackendError as e:
            print(f"cannot read GPUs from {backend_spec}: {e}", file=err)
            print(
                f"{path}: the config itself is valid; only the slicing plan for {backend_spec} "
                "could not be made (leave out --backend to plan for the demo's GPUs)",
                file=err,
            )
            return EXIT_BACKEND
        print(f"\nslicing plan for the GPUs of {backend_spec}:", file=out)
    else:
        from deviceplugin.gpu.examples import example_gpus  # noqa: PLC0415

        gpus = example_gpus()
        print(
            "\nslicing plan for the demo's example GPUs "
            "(pass --backend nvml on a GPU node to plan for its own GPUs):",
            file=out,
        )
    plans = plan_gpus(gpus, config.slicing, mig=config.mig, resource_name=config.resource_name)
    too_large = device_list_problem(plans, config.slicing)
    if too_large is not None:
        print(f"{path}: {too_large}", file=err)
        print(f"{path}: invalid for these GPUs (1 problem)", file=err)
        return EXIT_INVALID
    refused = dra_problems(plans, config)
    if refused:
        for problem in refused:
            print(f"{path}: dra: {problem}", file=err)
        count = len(refused)
        print(
            f"{path}: invalid for these GPUs in DRA mode (serve --kubelet-api dra): the API "
            f"server would refuse the node's ResourceSlice ({count} problem"
            f"{'s' if count != 1 else ''})",
            file=err,
        )
        return EXIT_INVALID
    for line in render_plan(plans, config.resource_name):
        print(line, file=out)
    for line in render_limits(plans, config):
        print(line, file=out)
    if config.format is ConfigFormat.NVIDIA:
        for line in beyond_nvidia(plans, config, enforce_nvidia_config=enforce_nvidia_config):
            print(line, file=out)
    devices = sum(1 for p in plans if p.sliced)
    print(
        f"DRA mode: the ResourceSlice of these {devices} devices passes the API server's rules",
        file=out,
    )
    return EXIT_OK


def dra_problems(plans: tuple[GpuPlan, ...], config: Config) -> list[str]:
    """Why the API server would refuse the ResourceSlice this config's `dra` section makes for
    these plans in DRA mode (docs/dra.md); empty when it would take it."""
    dra = config.dra
    devices = build_devices(Inventory(plans=plans), dra, dra.driver_name)
    return slice_problems(build_slice("check-config", dra.driver_name, devices, 1))
