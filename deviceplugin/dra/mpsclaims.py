"""A claim's MPS v3 namespace (deviceplugin.mpsnamespaces): made before its CDI spec is
written, capped at what the claim consumed on its GPUs, and named in the spec: its pipe
directory mounted read-only at the same path instead of the node's, in `CUDA_MPS_PIPE_DIRECTORY`,
and no `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`."""

from __future__ import annotations

from dataclasses import replace

from deviceplugin.allocation import mps_pipe_directory
from deviceplugin.config import MpsConfig
from deviceplugin.dra.claims import ClaimError, ContainerEdits, PreparedClaim, claim_grants
from deviceplugin.model import MpsNamespace
from deviceplugin.mpsnamespaces import (
    ContainerNamespaces,
    NamespaceRefusedError,
    grant_limits,
    namespace_env,
)


async def claim_namespace(
    namespaces: ContainerNamespaces, claim: PreparedClaim, mps: MpsConfig
) -> MpsNamespace | None:
    """Under MPS v3 the claim's namespace, made (or found) now; None otherwise. ClaimError when
    it cannot be made: a container without its namespace would run uncapped."""
    if not mps.enabled:
        return None
    try:
        return await namespaces.provision(claim.allocation_id, grant_limits(claim_grants(claim)))
    except NamespaceRefusedError as e:
        raise ClaimError(
            f"ResourceClaim {claim.namespace}/{claim.name}: no MPS namespace: {e}"
        ) from e


def in_namespace(edits: ContainerEdits, ns: MpsNamespace, mps: MpsConfig) -> ContainerEdits:
    """A claim's container edits pointed at its namespace."""
    pipe = mps_pipe_directory(mps.root)
    mounts = tuple(
        (ns.pipe_directory, ns.pipe_directory, True) if container == pipe else (host, container, ro)
        for host, container, ro in edits.mounts
    )
    return replace(edits, env=namespace_env(edits.env, ns), mounts=mounts)
