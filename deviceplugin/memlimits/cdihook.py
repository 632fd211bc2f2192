"""The memory-limit hook in CDI specs (docs/design.md §15.2): which grants carry it, and the
specs that carry it for device-plugin allocations.

A grant (an allocation or claim ID) gets the hook when the daemon serves memory limits and at
least one GPU of the grant has a driver that partitions memory (`LimitHooks.enforced`, kept by
the memory-limits part from the backend's answer); elsewhere it gets none, and polling holds it
(§4). A DRA claim's spec carries the hook beside its environment (`dra.cdi`); a device-plugin
allocation gets a spec of its own, `<cdi dir>/vgpu.dev-allocation_<allocation ID>.json`, kind
`vgpu.dev/allocation`, one device named by the allocation ID whose only edit is the hook, written
atomically (owner-only, no symbolic link followed: `statefiles`) before Allocate answers, and
removed once the allocation is gone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin import statefiles

log = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
# The socket the hook dials when its arguments name none (deviceplugin/hook/vgpu-hook.c).
DEFAULT_SOCKET = Path("/run/vgpu/hook.sock")
# The hook's path in the image; the DaemonSet copies it to the same path on the host.
DEFAULT_HOOK_PATH = "/opt/vgpu/libexec/vgpu-hook"
# Seconds the runtime gives the hook: more than the hook's own timeout (10 s), which answers
# with the reason where the runtime's would kill it silently.
HOOK_TIMEOUT_S = 15
ALLOCATION_VENDOR = "vgpu.dev"
ALLOCATION_CLASS = "allocation"
ALLOCATION_KIND = f"{ALLOCATION_VENDOR}/{ALLOCATION_CLASS}"
SPEC_PREFIX = f"{ALLOCATION_VENDOR}-{ALLOCATION_CLASS}_"
ALLOCATION_ANNOTATION = f"{ALLOCATION_VENDOR}/allocation"


@dataclass(frozen=True, slots=True)
class HookCommand:
    """How the runtime runs the hook: the binary's path on the host and the daemon's socket."""

    path: str = DEFAULT_HOOK_PATH
    socket: Path = DEFAULT_SOCKET

    def entry(self, grant_id: str) -> dict[str, Any]:
        """The CDI hook that applies `grant_id`'s limits at createRuntime."""
        args = ["vgpu-hook", "apply", "--id", grant_id]
        if self.socket != DEFAULT_SOCKET:
            args += ["--socket", str(self.socket)]
        return {
            "hookName": "createRuntime",
            "path": self.path,
            "args": args,
            "timeout": HOOK_TIMEOUT_S,
        }


class LimitHooks:
    """Which grants carry the hook: `enforced` is the set of GPU UUIDs whose driver partitions
    memory now (replaced whole by the memory-limits part; read by Allocate and Prepare)."""

    def __init__(self, command: HookCommand | None) -> None:
        self.command = command
        self.enforced: frozenset[str] = frozenset()

    def for_grant(self, grant_id: str, gpu_uuids: Iterable[str]) -> list[dict[str, Any]]:
        """The hook entries of a grant on these GPUs: one, or none where no GPU of it is
        partitioned by its driver (or memory limits are not served)."""
        if self.command is None or not self.enforced.intersection(gpu_uuids):
            return []
        return [self.command.entry(grant_id)]


def allocation_device(allocation_id: str) -> str:
    """The CDI device name Allocate answers for an allocation's hook."""
    return f"{ALLOCATION_KIND}={allocation_id}"


def spec_file_name(allocation_id: str) -> str:
    return f"{SPEC_PREFIX}{allocation_id}.json"


def allocation_spec(allocation_id: str, hooks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": ALLOCATION_KIND,
        "annotations": {ALLOCATION_ANNOTATION: allocation_id},
        "devices": [{"name": allocation_id, "containerEdits": {"hooks": hooks}}],
    }


class AllocationSpecs:
    """The CDI specs of device-plugin allocations whose hook sets their memory limits. Blocking
    file calls: the caller runs them off the event loop."""

    def __init__(self, cdi_dir: Path, hooks: LimitHooks) -> None:
        self.cdi_dir = cdi_dir
        self.hooks = hooks

    def write(self, allocation_id: str, gpu_uuids: Iterable[str]) -> str | None:
        """Write the allocation's spec where it gets the hook; its CDI device name, or None."""
        hooks = self.hooks.for_grant(allocation_id, gpu_uuids)
        if not hooks:
            return None
        spec = json.dumps(allocation_spec(allocation_id, hooks), indent=2, sort_keys=True)
        statefiles.write_file(self.cdi_dir, spec_file_name(allocation_id), spec.encode())
        return allocation_device(allocation_id)

    def written(self) -> list[str]:
        """The allocation IDs whose specs are in the CDI directory."""
        try:
            names = statefiles.list_files(self.cdi_dir, SPEC_PREFIX)
        except FileNotFoundError:
            return []
        return [
            n.removeprefix(SPEC_PREFIX).removesuffix(".json") for n in names if n.endswith(".json")
        ]

    def remove(self, allocation_ids: Collection[str]) -> list[str]:
        """Remove these allocations' specs (they are gone); the allocation IDs removed."""
        removed: list[str] = []
        for allocation_id in sorted(allocation_ids):
            try:
                if statefiles.remove_file(self.cdi_dir, spec_file_name(allocation_id)):
                    removed.append(allocation_id)
            except (OSError, ValueError) as e:
                log.error(
                    "cannot remove an allocation's CDI spec allocation_id=%s error=%s",
                    allocation_id,
                    e,
                )
        for allocation_id in removed:
            log.info(
                "allocation's CDI spec removed: allocation gone allocation_id=%s", allocation_id
            )
        return removed
