"""MPS in the /status document and its terminal view (docs/design.md §5, §10). Pure: no I/O.

- `health.mps`: the control daemon (`up`, `pid`, `restarts_total`, `pipe_directory`, `error`),
  the protocol it runs (2, or 3: a namespace per container), its drains (`drains_total`: clients
  terminated through it before a stop; `undrained_total`: stopped without, the control daemon
  not answering), `wedges_total` (a drain past its bound, or a canary that hung: each followed
  by a restart), `canary_error` (why the last canary failed without hanging), `drift_total` (what
  clients changed behind the daemon's back, each undone), `root_clients` (MPS clients running as
  root: under multiuser MPS one can raise its own caps or delete a neighbour's namespace) and,
  under MPS v3, the `namespaces` held;
- per container, `mps`: its namespace, the namespace's pipe directory, its caps (the share of
  the GPU's threads and the pinned memory), and which of its processes run as root; null where
  it has no namespace (no MPS, MPS v2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from deviceplugin.allocation import MIB
from deviceplugin.logs import escape
from deviceplugin.model import MpsNamespace, MpsStatus
from deviceplugin.slicing import format_bytes


def _namespace(ns: MpsNamespace) -> dict[str, Any]:
    return {
        "allocation_id": ns.owner,
        "namespace": f"{ns.server}/{ns.name}",
        "pipe_directory": ns.pipe_directory,
        "gpu_uuids": list(ns.gpu_uuids),
        "active_thread_ratio": ns.active_thread_percentage / 100,
        "pinned_memory_limit_bytes": ns.pinned_memory_mib * MIB,
    }


def mps_health(status: MpsStatus | None) -> dict[str, Any] | None:
    """`health.mps`; None without MPS."""
    if status is None:
        return None
    return {
        "up": status.up,
        "pid": status.pid,
        "restarts_total": status.restarts_total,
        "pipe_directory": status.pipe_directory,
        "error": status.error,
        "protocol": status.protocol,
        "drains_total": status.drains_total,
        "undrained_total": status.undrained_total,
        "wedges_total": status.wedges_total,
        "canary_error": status.canary_error,
        "drift_total": dict(status.drift_total),
        "root_clients": list(status.root_clients),
        "namespaces": [_namespace(ns) for ns in status.namespaces],
    }


def container_mps(
    allocation_id: str, pids: Iterable[int], status: MpsStatus | None
) -> dict[str, Any] | None:
    """A container's `mps`: its namespace and caps, and its processes that run as root (PIDs);
    None where it has no namespace."""
    if status is None:
        return None
    ns = next((n for n in status.namespaces if n.owner == allocation_id), None)
    if ns is None:
        return None
    shown = _namespace(ns)
    del shown["allocation_id"], shown["gpu_uuids"]
    shown["root_clients"] = sorted(set(pids) & set(status.root_clients))
    return shown


# --- the terminal view --------------------------------------------------------------------------


def _count(value: Any) -> int:
    return value if isinstance(value, int) else 0


def mps_flag(mps: Mapping[str, Any]) -> str:
    """The header's MPS flag: `MPS v3 up`, with wedges and root clients when there are any."""
    protocol = mps.get("protocol")
    name = f"MPS v{protocol}" if isinstance(protocol, int) else "MPS"
    flag = f"{name} up" if mps.get("up") else f"{name} DOWN"
    wedges = _count(mps.get("wedges_total"))
    if wedges:
        flag += f" ({wedges} wedge{'s' if wedges != 1 else ''} restarted)"
    roots = mps.get("root_clients")
    if isinstance(roots, list) and roots:
        flag += f", {len(roots)} ROOT CLIENT{'S' if len(roots) != 1 else ''}"
    return flag


def mps_container_line(c: Mapping[str, Any]) -> str | None:
    """A container's MPS line (`MPS namespace g.../c...: threads 50%, pinned 40Gi`), or None."""
    mps = c.get("mps")
    if not isinstance(mps, Mapping):
        return None
    ratio = mps.get("active_thread_ratio")
    threads = f"{round(ratio * 100)}%" if isinstance(ratio, int | float) else "?"
    pinned = mps.get("pinned_memory_limit_bytes")
    memory = format_bytes(pinned) if isinstance(pinned, int) else "?"
    line = f"MPS namespace {escape(str(mps.get('namespace', '?')))}: threads {threads}, "
    line += f"pinned {memory}"
    roots = mps.get("root_clients")
    if isinstance(roots, list) and roots:
        line += f", ROOT pids {','.join(escape(str(p)) for p in roots)}"
    return line
