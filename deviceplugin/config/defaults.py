"""The full default config as commented YAML, for the DaemonSet's ConfigMap
(tools/gen_daemonset_config.py) and the docs; it parses back to the defaults of `model`.
"""

from __future__ import annotations

import json

from deviceplugin.config.model import (
    Config,
)
from deviceplugin.config.reader import (
    format_duration,
    format_size,
)


def default_config_yaml(*, node_labels_file: str = "") -> str:
    """The full default config as commented YAML, for the DaemonSet's ConfigMap and the docs.
    It parses back to Config(), but for `nodeLabels.file` when given (the DaemonSet's config sets
    it to NFD_FEATURE_NAME)."""
    d = Config()
    e = d.enforcement
    replicas = d.slicing.default.replicas
    strategies = ", ".join(s.value for s in d.allocation.device_list_strategy)
    h = d.health

    def xids(values: tuple[int, ...]) -> str:
        return ", ".join(str(x) for x in values)

    return f"""\
# vgpu device plugin configuration. Every key is optional: the values below are the defaults.
# Durations take a unit (500ms, 2s, 1m); sizes take binary (Ki, Mi, Gi) or decimal (K, M, G) units.
# NVIDIA k8s-device-plugin's config file (sharing.timeSlicing / sharing.mps) is accepted too.
version: v1

# The extended resource pods request, e.g. resources.limits: {{{d.resource_name}: 1}}.
resourceName: {d.resource_name}

slicing:
  # Each GPU is split into this many slices; a slice gets 1/replicas of the GPU's memory and
  # compute. A container holding k slices of a GPU gets k times that.
  replicas: {replicas}
  # Or size slices by memory instead of replicas (replicas = GPU memory / memoryPerSlice):
  # memoryPerSlice: 10Gi
  # Per-GPU exceptions, matched by model (a glob on the GPU name), index or uuid; the first
  # override that matches a GPU wins. Each sets replicas or memoryPerSlice.
  overrides: []
  # overrides:
  #   - match: {{model: "*A100*"}}
  #     replicas: 8
  #   - match: {{index: 1}}
  #     memoryPerSlice: 20Gi

allocation:
  # pack: put a container's slices on the GPU that already has the most used slices;
  # spread: on the least used GPU. (NVIDIA's names packed and distributed are accepted too.)
  policy: {d.allocation.policy.value}
  # How a container gets its GPUs, any of: envvar, volume-mounts, cdi-annotations, cdi-cri,
  # device-specs.
  deviceListStrategy: [{strategies}]
  # What those name a GPU by: uuid (GPU-..., MIG-...) or index (NVML's index: 0, 1, and
  # <GPU index>:<MIG index> for a MIG device), as NVIDIA's deviceIDStrategy.
  deviceIDStrategy: {d.allocation.device_id_strategy.value}
  # Tell frameworks that reserve GPU memory up front their share, so that they fit their
  # slices: XLA_PYTHON_CLIENT_MEM_FRACTION (JAX), TF_FORCE_GPU_ALLOW_GROWTH (TensorFlow) and
  # VGPU_MEMORY_FRACTION_<i> per GPU (PyTorch, vLLM: set in code or on the command line).
  frameworkHints: {"true" if d.allocation.framework_hints else "false"}
  # Left out of those fractions for the CUDA context and libraries outside the framework's pool.
  contextReserve: {format_size(d.allocation.context_reserve_bytes)}

enforcement:
  # How often GPU memory and utilisation are measured.
  pollInterval: {format_duration(e.poll_interval_s)}
  # How often while no slice is allocated and no GPU process runs: nothing is enforced then, and
  # an Allocate brings back pollInterval at once. Never faster than pollInterval.
  idlePollInterval: {format_duration(e.idle_poll_interval_s)}
  # Decide, log and count every enforcement action, but send no signal to any process.
  dryRun: {"true" if e.dry_run else "false"}
  memory:
    # kill: SIGKILL the largest GPU process of a container that stays above its memory limit for
    # longer than gracePeriod; monitor: only record the violation.
    action: {e.memory.action.value}
    gracePeriod: {format_duration(e.memory.grace_period_s)}
  compute:
    # throttle: pause and resume (SIGSTOP/SIGCONT) the GPU processes of a container that uses more
    # than its compute share while others wait; monitor: only record the violation.
    action: {e.compute.action.value}
    # Utilisation is averaged over window; period is the length of one pause/resume cycle.
    window: {format_duration(e.compute.window_s)}
    period: {format_duration(e.compute.period_s)}
    # Let containers use GPU time that no other container wants, beyond their share.
    workConserving: {"true" if e.compute.work_conserving else "false"}

mps:
  # Run and supervise the node's CUDA MPS control daemon and share the GPUs through it: each
  # MPS client process is held to one slice's memory and compute by the GPU itself, and
  # containers get the pipe directory and their limits. Needs the DaemonSet's MPS component.
  enabled: {"true" if d.mps.enabled else "false"}
  # The MPS pipe (<root>/pipe), log (<root>/log) and shared memory (<root>/shm) directories.
  root: {d.mps.root}
  # The MPS control program, run with -f as the daemon's child and sent commands on stdin.
  controlCommand: {d.mps.control_command}

health:
  # Watch NVML's Xid and double-bit ECC events, and take a GPU out of service (its slices turn
  # Unhealthy) on a critical one. A GPU that NVML reports lost, or whose NVML calls hang for
  # hangTimeout, is taken out of service even when this is false.
  enabled: {"true" if h.enabled else "false"}
  # Xids caused by applications, not by the GPU: they leave the GPU in service. This list replaces
  # the default; additionalIgnoredXids adds to it; criticalXids wins over both.
  ignoredXids: [{xids(h.ignored_xids)}]
  additionalIgnoredXids: [{xids(h.additional_ignored_xids)}]
  criticalXids: [{xids(h.critical_xids)}]
  # manual: a GPU taken out of service stays out until the daemon restarts; auto: it returns once
  # it has answered correctly, with no critical Xid, for recoveryDelay.
  recovery: {h.recovery.value}
  recoveryDelay: {format_duration(h.recovery_delay_s)}
  hangTimeout: {format_duration(h.hang_timeout_s)}

nodeLabels:
  # Keep a node feature discovery feature file of this name (a name, not a path) in the directory
  # the daemon was started with, --node-features-dir: NFD v0.15 or newer turns its lines into node
  # labels nvidia.com/vgpu.count, .replicas, .memory-per-slice-mib, .product, .mig-strategy; all
  # but the last describe resourceName's slices. "" (the built-in default) keeps none; the
  # DaemonSet mounts NFD's features.d directory and names it.
  file: {json.dumps(node_labels_file)}

mig:
  # GPUs in MIG mode. none: left out. single: every MIG device is sliced like a GPU and advertised
  # under resourceName (all MIG devices of the node must share one profile). mixed: each profile
  # is its own resource, nvidia.com/mig-<profile> (e.g. nvidia.com/mig-1g.10gb), as with NVIDIA's
  # plugin. A MIG device is one slice unless a slicing override matches its profile, e.g.
  # {{match: {{profile: "1g.10gb"}}, replicas: 2}}. Memory limits are enforced per MIG device; NVML
  # measures no utilisation per MIG device, so compute shares are not enforced on them.
  strategy: {d.mig.strategy.value}

dra:
  # DRA mode only (serve --kubelet-api dra; docs/dra.md). The driver's name, and what a claim may
  # ask of one GPU's capacities: memory in bytes, compute in percent (100 = the whole GPU). The
  # scheduler rounds a request up to min + a multiple of step; a claim naming no amount gets
  # `default`, or one slice's worth of that GPU when there is none (as nvidia.com/vgpu: 1 does).
  driverName: {d.dra.driver_name}
  memory:
    min: {format_size(d.dra.memory_min_bytes)}
    step: {format_size(d.dra.memory_step_bytes)}
  compute: {{min: {d.dra.compute_min}, step: {d.dra.compute_step}}}
"""
