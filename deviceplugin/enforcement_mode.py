"""Monitor mode: an NVIDIA-format config is not enforced until the operator says so.

NVIDIA's plugin enforces nothing with time-slicing; vgpu, reading the same file, would hold each
replica to its share of the GPU's memory (killing) and compute (pausing). So that moving over
kills nobody by surprise, a config in NVIDIA k8s-device-plugin's format runs as a dry run:
the enforcer decides, logs and counts what it would do (`would_kill`, `would_throttle`) and
signals nothing. `serve --enforce-nvidia-config true` (env VGPU_ENFORCE_NVIDIA_CONFIG, the
chart's enforceNvidiaConfig) turns enforcement on, the file staying as it is. A config in vgpu's
own format is enforced as it says (`enforcement.dryRun`, the actions).

The mode follows the config that runs: a live reload from vgpu's format to NVIDIA's puts the
daemon in monitor mode (the enforcer is replaced, resuming what it held stopped), and back.
"""

from __future__ import annotations

from dataclasses import replace

from deviceplugin.config import Config, ConfigFormat

FLAG = "--enforce-nvidia-config"
ENV = "VGPU_ENFORCE_NVIDIA_CONFIG"
CHART_VALUE = "enforceNvidiaConfig"


def in_monitor_mode(config: Config, enforce_nvidia_config: bool) -> bool:
    """Whether `config` runs in monitor mode: NVIDIA's format, enforcement not turned on."""
    return config.format is ConfigFormat.NVIDIA and not enforce_nvidia_config


def as_run(config: Config, enforce_nvidia_config: bool) -> Config:
    """`config` as the daemon runs it: in monitor mode, a dry run."""
    if not in_monitor_mode(config, enforce_nvidia_config) or config.enforcement.dry_run:
        return config
    return replace(config, enforcement=replace(config.enforcement, dry_run=True))


def mode_line(config: Config, enforce_nvidia_config: bool) -> str:
    """How `config` is enforced, in one line for the start-up log, a reload and check-config;
    "" for a vgpu-format config that is enforced as it says."""
    if in_monitor_mode(config, enforce_nvidia_config):
        return (
            "enforcement: monitor mode, as the config is NVIDIA k8s-device-plugin's format: "
            "vgpu decides, logs and counts what it would do (would kill, would throttle) and "
            f"signals nothing; to enforce, keeping the file as it is: serve {FLAG} true "
            f"(env {ENV}=true; the chart's {CHART_VALUE}=true)"
        )
    if config.format is ConfigFormat.NVIDIA:
        return (
            f"enforcement: on for this NVIDIA-format config ({FLAG} true): each shared slice is "
            "held to its memory (kill) and compute (throttle) share"
        )
    if config.enforcement.dry_run:
        return (
            "enforcement: dry run (enforcement.dryRun: true): vgpu decides, logs and counts what "
            "it would do (would kill, would throttle) and signals nothing"
        )
    return ""
