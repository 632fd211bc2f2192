"""MPS v3 namespaces as the kubelet frontends see them (docs/design.md §10): a namespace per
container (device plugin) or claim (DRA), made before the container starts and handed to it.

Under MPS v3 the node's MPS control daemon (`parts.mps`) makes, for each allocation, a namespace
capped at what the allocation was granted on its GPUs (`grant_limits`: the memory limit and the
compute share its environment states). Allocate and NodePrepareResources ask for it
(`ContainerNamespaces.provision`) before they answer; the container then mounts that namespace's
pipe directory, read-only at the same path, instead of the node's whole pipe directory
(`with_namespace`, `namespace_mounts`), finds it in `CUDA_MPS_PIPE_DIRECTORY`, and has no
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: a bad entry there makes an MPS client drop every pinned
limit, the namespace's included, and the namespace holds the limit already. A namespace that
cannot be made refuses the container (`NamespaceRefusedError`): a container without its namespace
would run uncapped. Under MPS v2, or without MPS, `provision` gives None and the answer stays as
it is (v2's per-slice defaults hold).

The namespace's owner is the allocation ID (a DRA claim's too), so that the allocation book says
which namespaces are still in use; the MPS part deletes the others.

Pure: no I/O here; `provision` is the MPS part's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from deviceplugin.allocation import (
    ENV_MPS_PINNED_DEVICE_MEM_LIMIT,
    ENV_MPS_PIPE_DIRECTORY,
    DeviceLimits,
    limits_env,
    mps_pipe_directory,
)
from deviceplugin.config import AllocationConfig, MpsConfig
from deviceplugin.errors import AllocationError
from deviceplugin.model import (
    ContainerAllocation,
    DeviceGrant,
    Inventory,
    MountSpec,
    MpsNamespace,
)

# A compute share as the environment states it (whole percent, rounded down), from a grant's
# ratio: k/replicas summed in floating point may fall a hair short of the exact percentage.
_PERCENT_EPSILON = 1e-6


class NamespaceRefusedError(AllocationError):
    """The container's MPS namespace cannot be made; the message says why and what to do."""


class ContainerNamespaces(Protocol):
    """Where the frontends get a container's (or claim's) MPS namespace."""

    async def provision(self, owner: str, limits: Sequence[DeviceLimits]) -> MpsNamespace | None:
        """The namespace of allocation `owner`, capped at `limits` (one per GPU), made before
        its container starts; None where containers get no namespace (no MPS, MPS v2). Raises
        NamespaceRefusedError."""
        ...


class NoNamespaces:
    """Without MPS v3: no container gets a namespace."""

    async def provision(self, owner: str, limits: Sequence[DeviceLimits]) -> MpsNamespace | None:
        return None


NO_NAMESPACES = NoNamespaces()


def grant_limits(
    grants: Sequence[DeviceGrant], totals: Mapping[str, int] | None = None
) -> list[DeviceLimits]:
    """What an allocation holds of each GPU, from its grants, as the environment states it:
    its memory limit (each of its processes may hold it: the namespace caps them, not one
    slice's default) and its compute share in whole percent. `totals`: each GPU's memory, for
    the framework hints (0 where unknown)."""
    totals = totals or {}
    return [
        DeviceLimits(
            g.gpu_uuid,
            g.memory_limit_bytes,
            g.memory_limit_bytes,
            math.floor(g.compute_share_ratio * 100 + _PERCENT_EPSILON),
            totals.get(g.gpu_uuid, 0),
        )
        for g in grants
    ]


def namespace_env(env: Mapping[str, str], ns: MpsNamespace) -> dict[str, str]:
    """`env` with the namespace's pipe directory and without the per-client pinned limit."""
    out = dict(env)
    out.pop(ENV_MPS_PINNED_DEVICE_MEM_LIMIT, None)
    out[ENV_MPS_PIPE_DIRECTORY] = ns.pipe_directory
    return out


def namespace_mounts(
    mounts: Sequence[MountSpec], ns: MpsNamespace, mps: MpsConfig
) -> tuple[MountSpec, ...]:
    """`mounts` with the node's pipe directory replaced by the namespace's, read-only at the
    same path (the shared memory mount stays)."""
    pipe = mps_pipe_directory(mps.root)
    mine = MountSpec(container_path=ns.pipe_directory, host_path=ns.pipe_directory, read_only=True)
    return tuple(mine if m.container_path == pipe else m for m in mounts)


def with_namespace(
    allocation: ContainerAllocation,
    ns: MpsNamespace,
    limits: Sequence[DeviceLimits],
    cfg: AllocationConfig,
    mps: MpsConfig,
) -> ContainerAllocation:
    """Allocate's answer for a container given namespace `ns`: its environment made again from
    `limits` (the framework hints are its memory's, not one slice's: the namespace, not a
    per-client default, holds its processes), then pointed at the namespace; its mounts."""
    env = dict(allocation.envs)
    env.update(limits_env(allocation.allocation_id, limits, cfg, mps))
    return replace(
        allocation,
        envs=namespace_env(env, ns),
        mounts=namespace_mounts(allocation.mounts, ns, mps),
    )


async def provision_all(
    allocations: Sequence[ContainerAllocation],
    namespaces: ContainerNamespaces,
    inventory: Inventory,
    cfg: AllocationConfig,
    mps: MpsConfig,
) -> list[ContainerAllocation]:
    """Allocate's answers with each container's namespace, made before any answer goes out;
    as they are where containers get none. Raises NamespaceRefusedError naming the container."""
    if not mps.enabled:
        return list(allocations)
    totals = {p.gpu.uuid: p.gpu.memory_total_bytes for p in inventory.plans}
    out: list[ContainerAllocation] = []
    for i, allocation in enumerate(allocations):
        limits = grant_limits(allocation.grants, totals)
        try:
            ns = await namespaces.provision(allocation.allocation_id, limits)
        except NamespaceRefusedError as e:
            raise NamespaceRefusedError(f"container request {i}: {e}") from e
        out.append(allocation if ns is None else with_namespace(allocation, ns, limits, cfg, mps))
    return out


__all__ = [
    "NO_NAMESPACES",
    "ContainerNamespaces",
    "NamespaceRefusedError",
    "NoNamespaces",
    "grant_limits",
    "namespace_env",
    "namespace_mounts",
    "provision_all",
    "with_namespace",
]
