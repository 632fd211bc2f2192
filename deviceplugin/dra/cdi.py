"""The CDI spec of a prepared claim: one file per claim in the CDI directory, kind
`vgpu.dev/claim` (the driver's name), one device named after the claim's UID.

Its container edits carry the docs/design.md §3 environment with the claim's consumed amounts,
the MPS pipe mount when MPS is on, and, with `gpu_cdi: device-nodes`, the GPU's device nodes.
With `gpu_cdi: nvidia` the GPU itself comes from NVIDIA's CDI device `nvidia.com/gpu=<uuid>`,
which Prepare returns beside vgpu's own. Where a GPU of the claim has a driver that enforces
memory, the edits carry the memory-limit hook too (docs/design.md §15.2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deviceplugin import statefiles
from deviceplugin.dra.claims import ContainerEdits, PreparedClaim

CDI_VERSION = "0.6.0"
NVIDIA_CDI_KIND = "nvidia.com/gpu"
CLAIM_CLASS = "claim"
# The spec's annotation naming its claim (`<namespace>/<name>`).
CLAIM_ANNOTATION = "vgpu.dev/claim"


def kind(driver_name: str) -> str:
    return f"{driver_name}/{CLAIM_CLASS}"


def spec_file_name(driver_name: str, claim_uid: str) -> str:
    return f"{driver_name}-{CLAIM_CLASS}_{claim_uid}.json"


def cdi_ids(driver_name: str, claim: PreparedClaim, *, nvidia: bool) -> tuple[str, ...]:
    """The CDI devices a claim's containers get: vgpu's own, then NVIDIA's per GPU."""
    own = (f"{kind(driver_name)}={claim.uid}",)
    if not nvidia:
        return own
    return own + tuple(f"{NVIDIA_CDI_KIND}={uuid}" for uuid in claim.gpu_uuids)


def build_spec(
    driver_name: str,
    claim: PreparedClaim,
    edits: ContainerEdits,
    hooks: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The claim's spec; `hooks`: the memory-limit hook where its GPU's driver enforces memory
    (memlimits.cdihook)."""
    container_edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in edits.env.items()]}
    if edits.mounts:
        container_edits["mounts"] = [
            {
                "hostPath": host,
                "containerPath": container,
                "options": ["ro" if read_only else "rw", "nosuid", "nodev", "bind"],
            }
            for host, container, read_only in edits.mounts
        ]
    if edits.device_nodes:
        container_edits["deviceNodes"] = [{"path": p} for p in edits.device_nodes]
    if hooks:
        container_edits["hooks"] = [dict(h) for h in hooks]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver_name),
        "annotations": {CLAIM_ANNOTATION: f"{claim.namespace}/{claim.name}"},
        "devices": [{"name": claim.uid, "containerEdits": container_edits}],
    }


def write_spec(
    cdi_dir: Path,
    driver_name: str,
    claim: PreparedClaim,
    edits: ContainerEdits,
    hooks: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write (or replace) the claim's spec file; returns its path."""
    name = spec_file_name(driver_name, claim.uid)
    spec = build_spec(driver_name, claim, edits, hooks)
    statefiles.write_file(cdi_dir, name, json.dumps(spec, indent=2, sort_keys=True).encode())
    return cdi_dir / name


def remove_spec(cdi_dir: Path, driver_name: str, claim_uid: str) -> bool:
    return statefiles.remove_file(cdi_dir, spec_file_name(driver_name, claim_uid))


def spec_claim_uids(cdi_dir: Path, driver_name: str) -> list[str]:
    """The claims whose spec files are in the CDI directory."""
    prefix = f"{driver_name}-{CLAIM_CLASS}_"
    return [
        n.removeprefix(prefix).removesuffix(".json")
        for n in statefiles.list_files(cdi_dir, prefix)
        if n.endswith(".json")
    ]
