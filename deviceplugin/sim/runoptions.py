"""What a container gets from its device plugins, as the kubelet (v1.36) and the NVIDIA container
toolkit make it.

A container that holds devices of several resources has one `Allocate` answer per resource. The
kubelet's device manager (`deviceRunContainerOptions`) merges them into one set of run options,
going over the resources in Go map order (unspecified: here, random):

- env: the first value of a key wins; a later different value is dropped, and the kubelet logs
  `Environment variable has conflicting setting`;
- mounts and device nodes: one per container path, the first wins (`Container mount conflicts`
  when a later one names another host path);
- annotations: the first value of a key wins;
- CDI devices: every distinct name.

`toolkit_devices` is the NVIDIA container toolkit's choice of GPUs for those options (its legacy
mode, as containerd 1.6, which has no CDI, runs it): with `accept-nvidia-visible-devices-as-
volume-mounts`, the mounts of `/dev/null` under `/var/run/nvidia-container-devices/` when there
are any; otherwise `NVIDIA_VISIBLE_DEVICES`, in an unprivileged container only when
`accept-nvidia-visible-devices-envvar-when-unprivileged` (its default).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from deviceplugin.sim.records import ContainerGrant

logger = logging.getLogger("deviceplugin.sim.kubelet")  # one name for the whole simulator

VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


@dataclass
class RunOptions:
    """A container's merged run options; `conflicts` are the values the kubelet dropped."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)
    devices: list[tuple[str, str, str]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


def merge_run_options(
    grants: Sequence[ContainerGrant], rng: random.Random | None = None
) -> RunOptions:
    """The kubelet's merge of one container's Allocate answers, in a random resource order."""
    order = list(grants)
    (rng or random.Random()).shuffle(order)  # noqa: S311 (an order, not a secret)
    options = RunOptions()
    mounts: dict[str, str] = {}
    devices: dict[str, str] = {}
    cdi: set[str] = set()
    for grant in order:
        for key, value in grant.envs.items():
            if key in options.envs:
                if options.envs[key] != value:
                    options.conflicts.append(f"env {key}")
                    logger.error(
                        "Environment variable has conflicting setting envKey=%s expected=%s got=%s",
                        key,
                        value,
                        options.envs[key],
                    )
                continue
            options.envs[key] = value
        for container_path, host_path, read_only in grant.mounts:
            if container_path in mounts:
                if mounts[container_path] != host_path:
                    options.conflicts.append(f"mount {container_path}")
                    logger.error("Container mount conflicts containerPath=%s", container_path)
                continue
            mounts[container_path] = host_path
            options.mounts.append((container_path, host_path, read_only))
        for container_path, host_path, permissions in grant.devices:
            if container_path in devices:
                if devices[container_path] != host_path:
                    options.conflicts.append(f"device {container_path}")
                    logger.error("Container device conflicts containerPath=%s", container_path)
                continue
            devices[container_path] = host_path
            options.devices.append((container_path, host_path, permissions))
        for key, value in grant.annotations.items():
            if key in options.annotations:
                if options.annotations[key] != value:
                    options.conflicts.append(f"annotation {key}")
                continue
            options.annotations[key] = value
        for name in grant.cdi_devices:
            if name not in cdi:
                cdi.add(name)
                options.cdi_devices.append(name)
    return options


def toolkit_devices(
    options: RunOptions,
    *,
    accept_volume_mounts: bool,
    accept_envvar_unprivileged: bool = True,
    privileged: bool = False,
) -> list[str]:
    """The GPUs the NVIDIA container toolkit (legacy mode) gives a container with `options`:
    UUIDs, `all`, or nothing."""
    if accept_volume_mounts:
        root = VOLUME_MOUNTS_ROOT + "/"
        from_mounts = [
            container_path.removeprefix(root)
            for container_path, host_path, _ in options.mounts
            if host_path == "/dev/null" and container_path.startswith(root)
        ]
        if from_mounts:
            return from_mounts
    value = options.envs.get(VISIBLE_DEVICES, "")
    if not value or value in ("void", "none"):
        return []
    if not (privileged or accept_envvar_unprivileged):
        return []
    return value.split(",")


__all__ = ["RunOptions", "merge_run_options", "toolkit_devices"]
