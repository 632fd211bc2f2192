"""The terminal view of the /status document (`vgpu-device-plugin status`). Pure: no I/O.

`render_status` draws the document's plain JSON data (not model objects; `statusdoc` builds it),
so the command line needs nothing but the document it fetched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from deviceplugin.logs import escape
from deviceplugin.slicing import format_bytes
from deviceplugin.usage.mpsstatus import mps_container_line, mps_flag
from deviceplugin.usage.statusdoc import snapshot_to_json

ELLIPSIS = "…"
MIN_WIDTH = 40
MAX_BAR = 40
USAGE_INDENT = 4  # GPU and container usage lines share one layout, so their bars align


def _clip(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut with an ellipsis."""
    if len(text) <= width:
        return text
    if width <= 0:
        return ""
    return text[: width - 1] + ELLIPSIS


def _text(value: Any) -> str:
    """A value of the document as text for a terminal: control characters (a pod name may hold
    escape sequences that would rewrite the screen) written as escapes, as the logs write them."""
    return escape(str(value))


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and math.isfinite(value) else 0


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{round(ratio * 100)}%"


def memory_bar(used: int, limit: int, inner: int) -> str:
    """`[####....]` of `used` against `limit`. Over the limit, the bar is scaled to `used` and the
    part beyond the limit is drawn with '!'."""
    if inner <= 0:
        return "[]"
    if limit <= 0:
        return "[" + ("!" if used > 0 else ".") * inner + "]"
    scale = max(used, limit)
    n_limit = round(limit / scale * inner)
    n_used = round(used / scale * inner)
    if used > limit and n_used <= n_limit:
        n_limit = n_used - 1  # always show that the limit is passed
    cells = [
        "#" if i < min(n_used, n_limit) else "!" if n_limit <= i < n_used else "."
        for i in range(inner)
    ]
    return "[" + "".join(cells) + "]"


def share_bar(used_ratio: float | None, share_ratio: float | None, inner: int) -> str:
    """`[###..|....]` of an SM utilisation of 0..1, with '|' where `share_ratio` ends."""
    if inner <= 0:
        return "[]"
    used = 0.0 if used_ratio is None else min(max(used_ratio, 0.0), 1.0)
    n_used = round(used * inner)
    cells = ["#" if i < n_used else "." for i in range(inner)]
    if share_ratio is not None:
        mark = round(min(max(share_ratio, 0.0), 1.0) * inner)
        if 0 < mark < inner:
            cells[mark] = "|"
    return "[" + "".join(cells) + "]"


def _usage_line(
    indent: int,
    memory: tuple[int, int, str],
    sm: tuple[float | None, float | None, str],
    width: int,
) -> str:
    """`<indent>mem [bar] <text>  SM [bar] <text>`; the two bars share the room that is left.
    `memory` is (used, limit, text); `sm` is (used ratio, share ratio or None, text)."""
    mem_text = f"{memory[2]:>15}"
    sm_text = f"{sm[2]:>9}"
    fixed = indent + len("mem [] ") + len(mem_text) + len("  SM [] ") + len(sm_text)
    inner = max(min((width - fixed) // 2, MAX_BAR), 4)
    line = (
        f"{' ' * indent}mem {memory_bar(memory[0], memory[1], inner)} {mem_text}"
        f"  SM {share_bar(sm[0], sm[1], inner)} {sm_text}"
    )
    return _clip(line, width)


def _name_and_tail(indent: int, name: str, tail: str, width: int) -> str:
    """`<indent><name>  <tail>`, the name cut so that the tail always shows."""
    room = width - indent - (len(tail) + 2 if tail else 0)
    line = " " * indent + _clip(name, max(room, 8))
    if tail:
        line += "  " + tail
    return _clip(line, width)


def container_name(c: Mapping[str, Any], room: int = 10_000) -> str:
    """namespace/pod/container in at most `room` characters, or the allocation ID while
    pod-resources has not named it (the pod alone while only its container is unnamed). The pod
    name (usually the longest, with generated suffixes) is cut first, so that the namespace and
    container stay readable."""
    parts = [_text(c.get(k) or "") for k in ("namespace", "pod", "container")]
    if not any(parts):
        return _clip(f"allocation {_text(c.get('allocation_id', '?'))} (unnamed)", room)
    if not parts[2] and parts[0] and parts[1]:
        # A DRA claim's pod is known from its reservation before pod-resources names the container.
        return _clip(f"{parts[0]}/{parts[1]} (container not named yet)", room)
    full = "/".join(parts)
    excess = len(full) - room
    if excess <= 0:
        return full
    namespace, pod, container = parts
    if len(pod) - excess >= 8:
        return f"{namespace}/{_clip(pod, len(pod) - excess)}/{container}"
    return _clip(full, room)


def _healthy_of(devices: Sequence[Mapping[str, Any]]) -> str:
    return f"{sum(1 for d in devices if d.get('healthy'))}/{len(devices)}"


def _header(doc: Mapping[str, Any], width: int) -> list[str]:
    health = doc.get("health") or {}
    gpus = doc.get("gpus") or []
    # Physical GPUs and MIG devices are counted apart: a node of 3 GPUs, one of them split into 3
    # MIG devices, has 3 GPUs, not 6.
    full = [g for g in gpus if not g.get("parent_gpu_uuid")]
    mig = [g for g in gpus if g.get("parent_gpu_uuid")]
    when = _text(doc.get("taken_at", "?"))
    freshness = "STALE" if doc.get("stale") else "fresh"
    first = _name_and_tail(0, f"node {_text(doc.get('node', '?'))}", f"{when}  {freshness}", width)
    who = "DRA driver" if doc.get("kubelet_api") == "dra" else "kubelet"
    flags = [
        f"{who} registered" if health.get("registered") else f"{who} NOT REGISTERED",
        "pod-resources up" if health.get("pod_resources_ok") else "pod-resources DOWN",
        f"GPUs {_healthy_of(full)} healthy",
    ]
    if mig:
        flags.append(f"MIG devices {_healthy_of(mig)} healthy")
    mps = health.get("mps")
    if isinstance(mps, Mapping):
        flags.append(mps_flag(mps))
    if health.get("polling_idle"):
        interval = health.get("poll_interval_s")
        every = f" {interval:g}s" if isinstance(interval, int | float) else ""
        flags.append(f"idle (polled every{every})")
    failures = _int(health.get("poll_failures_consecutive"))
    if failures:
        flags.append(f"last {failures} poll{'s' if failures != 1 else ''} FAILED")
    return [first, _clip(", ".join(flags), width)]


def _claims_of(doc: Mapping[str, Any]) -> dict[str, str]:
    """allocation ID -> the DRA claim (namespace/name) it was prepared for."""
    return {
        str(a.get("allocation_id")): _text(a["claim"])
        for a in doc.get("allocations") or []
        if a.get("claim")
    }


def _held(c: Mapping[str, Any], claims: Mapping[str, str]) -> str:
    """What the container holds: its DRA claim, or its slice count."""
    claim = claims.get(str(c.get("allocation_id")))
    if claim:
        return f"claim {claim}"
    slices = _int(c.get("slices"))
    return f"{slices} slice{'s' if slices != 1 else ''}"


def _gpu_lines(
    g: Mapping[str, Any],
    containers: Sequence[Mapping[str, Any]],
    width: int,
    claims: Mapping[str, str],
) -> list[str]:
    slices = g.get("slices") or {}
    health = "healthy" if g.get("healthy") else "UNHEALTHY"
    reason = _text(g.get("health_reason") or "")
    dra = g.get("dra")
    if isinstance(dra, Mapping):
        n = len(dra.get("claims") or [])
        tail = f"{health}  device {_text(dra.get('device', '?'))}: {n} claim{'s' if n != 1 else ''}"
    elif g.get("slices") is None:  # DRA mode, a GPU published as no device (MIG mode)
        tail = f"{health}  no device of its own"
    else:
        tail = (
            f"{health}  slices: {_int(slices.get('allocated'))} used, "
            f"{_int(slices.get('free'))} free, {_int(slices.get('unhealthy'))} unhealthy"
        )
        if _int(slices.get("unconfirmed")):
            tail += f", {_int(slices.get('unconfirmed'))} unconfirmed"
    mig = bool(g.get("parent_gpu_uuid"))
    if mig:
        name = (
            f"MIG {_text(g.get('mig_profile', '?'))}  GI {_text(g.get('gpu_instance_id', '?'))} "
            f"CI {_text(g.get('compute_instance_id', '?'))}"
        )
    else:
        name = f"GPU {_text(g.get('index', '?'))}  {_text(g.get('model', '?'))}"
    lines = [_name_and_tail(0, name, tail, width)]
    if reason and not g.get("healthy"):
        lines.append(_clip(f"  reason: {reason}", width))
    if isinstance(dra, Mapping):
        lines.append(_clip("  " + _claimed(dra), width))
    enforcement = _memory_enforcement(g)
    if enforcement:
        lines.append(_clip(f"  memory limits: {enforcement}", width))

    total = _int(g.get("memory_total_bytes"))
    used_raw = g.get("memory_used_bytes")
    used = _int(used_raw)
    used_text = "?" if used_raw is None else format_bytes(used)
    sm = _float(g.get("sm_utilization_ratio"))
    lines.append(
        _usage_line(
            USAGE_INDENT,
            (used, total, f"{used_text}/{format_bytes(total)}"),
            (sm, None, _percent(sm)),
            width,
        )
    )

    for c in containers:
        tail_parts = [_held(c, claims), *_memory_terms(c)]
        share = _float(c.get("compute_share_ratio"))
        entitled = _float(c.get("entitlement_ratio"))
        if entitled is not None:
            # Under work-conserving sharing a container may use more than its share; without
            # this, one held at 33% of a 25% share looks like enforcement failing.
            tail_parts.append(f"share {_percent(share)}, may use {_percent(entitled)}")
        if c.get("throttled"):
            duty = _float(c.get("duty_cycle_ratio"))
            tail_parts.append(f"THROTTLED duty={_percent(duty)}")
        tail = "  ".join(tail_parts)
        room = width - len("  - ") - len(tail) - 2
        lines.append(_name_and_tail(2, "- " + container_name(c, room), tail, width))
        c_used = _int(c.get("memory_used_bytes"))
        c_limit = _int(c.get("memory_limit_bytes"))
        c_sm = _float(c.get("sm_utilization_ratio"))
        c_share = _float(c.get("compute_share_ratio"))
        lines.append(
            _usage_line(
                USAGE_INDENT,
                (c_used, c_limit, f"{format_bytes(c_used)}/{format_bytes(c_limit)}"),
                (c_sm, c_share, f"{_percent(c_sm)}/{_percent(c_share)}"),
                width,
            )
        )
        mps_line = mps_container_line(c)
        if mps_line is not None:
            lines.append(_clip(" " * USAGE_INDENT + mps_line, width))

    if mig:
        lines.append(_clip("  compute: not measurable per MIG device (NVML), not enforced", width))
    stray = g.get("unattributed") or []
    stray_memory = sum(_int(p.get("used_memory_bytes")) for p in stray)
    lines.append(
        _clip(
            f"  unattributed: {len(stray)} process{'es' if len(stray) != 1 else ''}, "
            f"{format_bytes(stray_memory)}",
            width,
        )
    )
    return lines


def _memory_enforcement(g: Mapping[str, Any]) -> str:
    """Who holds the GPU's containers to their memory limits: `driver-dmem`, `driver-misc`, or
    `poll (<cause>)` (the reason is in /status); "" from a daemon that does not say."""
    mode = g.get("memory_enforcement")
    if not mode:
        return ""
    cause = g.get("memory_enforcement_cause")
    return f"poll ({_text(cause)})" if mode == "poll" and cause else _text(mode)


def _memory_terms(c: Mapping[str, Any]) -> list[str]:
    """A container's request where below its limit (`req 10Gi`), and `driver` once the GPU's
    driver holds it to its limit."""
    terms: list[str] = []
    request = c.get("memory_request_bytes")
    if request is not None and _int(request) < _int(c.get("memory_limit_bytes")):
        terms.append(f"req {format_bytes(_int(request))}")
    if str(c.get("memory_enforced_by") or "").startswith("driver-"):
        terms.append("driver")
    return terms


def _claimed(dra: Mapping[str, Any]) -> str:
    """What a DRA device has given out and has left: `claimed: memory 25Gi (15Gi free),
    compute 55% (45% free)`, and FULL when no claim of the policy's minimum fits there."""
    text = (
        f"claimed: memory {format_bytes(_int(dra.get('memory_claimed_bytes')))} "
        f"({format_bytes(_int(dra.get('memory_free_bytes')))} free), "
        f"compute {_percent(_float(dra.get('compute_claimed_ratio')))} "
        f"({_percent(_float(dra.get('compute_free_ratio')))} free)"
    )
    return text + (", FULL" if dra.get("full") else "")


def _enforcement_line(entries: Iterable[Mapping[str, Any]], width: int) -> str:
    totals: dict[str, int] = {}
    for e in entries:
        key = f"{_text(e.get('kind', '?'))}/{_text(e.get('action', '?'))}"
        totals[key] = totals.get(key, 0) + _int(e.get("count"))
    text = ", ".join(f"{k} {v}" for k, v in sorted(totals.items())) or "none"
    return _clip(f"enforcement actions: {text}", width)


def render_status(
    doc: Mapping[str, Any], *, width: int = 80, height: int | None = None
) -> list[str]:
    """The /status document as terminal lines, each at most `width` characters: a header, then
    per GPU its usage, its containers and its unattributed processes, then totals. Laid out for
    80 columns and more; narrower views are cut. With a `height` the full view does not fit in,
    the compact one (`render_compact`) instead: a line per GPU and per container, at most
    `height` lines."""
    lines = _render_full(doc, width)
    if height is None or len(lines) <= height:
        return lines
    return render_compact(doc, width=width, height=height)


def _render_full(doc: Mapping[str, Any], width: int) -> list[str]:
    limit = width
    width = max(width, MIN_WIDTH)
    lines = _header(doc, width)
    gpus = list(doc.get("gpus") or [])
    containers = list(doc.get("containers") or [])
    claims = _claims_of(doc)
    by_gpu: dict[str, list[Mapping[str, Any]]] = {}
    for c in containers:
        by_gpu.setdefault(str(c.get("gpu_uuid", "")), []).append(c)
    known = {str(g.get("uuid", "")) for g in gpus}
    # A GPU's MIG devices follow it, indented; MIG devices of a GPU not listed come last.
    children: dict[str, list[Mapping[str, Any]]] = {}
    for g in gpus:
        parent = str(g.get("parent_gpu_uuid") or "")
        if parent:
            children.setdefault(parent if parent in known else "", []).append(g)
    top = [g for g in gpus if not g.get("parent_gpu_uuid")]
    for g in [*top, *children.get("", [])]:
        lines.append("")
        lines.extend(_gpu_lines(g, by_gpu.get(str(g.get("uuid", "")), []), width, claims))
        for device in children.get(str(g.get("uuid", "")), []) if g in top else []:
            device_lines = _gpu_lines(
                device, by_gpu.get(str(device.get("uuid", "")), []), width - 2, claims
            )
            lines.extend("  " + line for line in device_lines)
    orphans = [c for c in containers if str(c.get("gpu_uuid", "")) not in known]
    if orphans:
        lines.append("")
        lines.append(_clip(f"containers on GPUs not in this snapshot: {len(orphans)}", width))
        lines.extend(_clip("  - " + container_name(c), width) for c in orphans)
    lines.append("")
    allocations = doc.get("allocations") or []
    named = sum(1 for a in allocations if a.get("pod"))
    lines.append(
        _clip(
            f"allocations: {len(allocations)} ({named} named), "
            f"containers on GPUs: {len(containers)}",
            width,
        )
    )
    lines.append(_enforcement_line(doc.get("enforcement") or [], width))
    # Every line escaped once more: nothing from the document reaches the terminal raw.
    return [_clip(escape(line), limit) for line in lines]


def _acting(c: Mapping[str, Any]) -> bool:
    """Whether the enforcer is at a container: throttled, or over its memory limit (its largest
    process is killed once the grace period runs out)."""
    limit = _int(c.get("memory_limit_bytes"))
    return bool(c.get("throttled")) or 0 < limit < _int(c.get("memory_used_bytes"))


def _compact_gpu(g: Mapping[str, Any], width: int) -> str:
    slices = g.get("slices") or {}
    if g.get("parent_gpu_uuid"):
        name = f"MIG {_text(g.get('mig_profile', '?'))} GI {_text(g.get('gpu_instance_id', '?'))}"
    else:
        name = f"GPU {_text(g.get('index', '?'))} {_text(g.get('model', '?'))}"
    if not g.get("healthy"):
        name = f"UNHEALTHY {name}"
    used_raw = g.get("memory_used_bytes")
    used = "?" if used_raw is None else format_bytes(_int(used_raw))
    total = format_bytes(_int(g.get("memory_total_bytes")))
    dra = g.get("dra")
    held = (
        f"free {format_bytes(_int(dra.get('memory_free_bytes')))} "
        f"{_percent(_float(dra.get('compute_free_ratio')))}" + (" FULL" if dra.get("full") else "")
        if isinstance(dra, Mapping)
        else "no device"
        if g.get("slices") is None
        else f"slices {_int(slices.get('allocated'))} used {_int(slices.get('free'))} free"
    )
    tail = f"{used}/{total}  SM {_percent(_float(g.get('sm_utilization_ratio')))}  {held}"
    return _name_and_tail(0, name, tail, width)


def _compact_container(c: Mapping[str, Any], width: int) -> str:
    action = ""
    if c.get("throttled"):
        action = f"THROTTLED {_percent(_float(c.get('duty_cycle_ratio')))} "
    limit = _int(c.get("memory_limit_bytes"))
    if 0 < limit < _int(c.get("memory_used_bytes")):
        action += "OVER LIMIT "
    used, limit = _int(c.get("memory_used_bytes")), _int(c.get("memory_limit_bytes"))
    sm, share = _float(c.get("sm_utilization_ratio")), _float(c.get("compute_share_ratio"))
    tail = f"{format_bytes(used)}/{format_bytes(limit)}  SM {_percent(sm)}/{_percent(share)}"
    room = width - 2 - len(action) - len(tail) - 2
    return _name_and_tail(2, action + container_name(c, max(room, 8)), tail, width)


def render_compact(doc: Mapping[str, Any], *, width: int = 80, height: int = 24) -> list[str]:
    """The view for a small terminal, in at most `height` lines: the header, a line per GPU (MIG
    devices as their own) followed by a line per container on it, then the enforcement totals.
    GPUs where something happens (unhealthy, a container throttled or over its memory limit)
    come first, those containers first on their GPU, and each line starts with what happens, so
    that a cut view still shows it. What does not fit is counted in the last line."""
    limit = width
    width = max(width, MIN_WIDTH)
    head = _header(doc, width)
    by_gpu: dict[str, list[Mapping[str, Any]]] = {}
    for c in doc.get("containers") or []:
        by_gpu.setdefault(str(c.get("gpu_uuid", "")), []).append(c)
    blocks: list[tuple[bool, list[str]]] = []
    for g in doc.get("gpus") or []:
        on_it = sorted(by_gpu.get(str(g.get("uuid", "")), []), key=lambda c: not _acting(c))
        acting = not g.get("healthy") or any(_acting(c) for c in on_it)
        lines = [_compact_gpu(g, width), *(_compact_container(c, width) for c in on_it)]
        blocks.append((acting, lines))
    blocks.sort(key=lambda block: not block[0])  # stable: in index order otherwise
    body = [line for _, lines in blocks for line in lines]
    foot = [_enforcement_line(doc.get("enforcement") or [], width)]
    room = height - len(head) - len(foot)
    if len(body) > room:
        if room < 1:
            return [_clip(escape(line), limit) for line in [*head, *foot][: max(height, 0)]]
        shown = body[: room - 1]
        body = [*shown, f"... {len(body) - len(shown)} more lines: a taller terminal or --json"]
    return [_clip(escape(line), limit) for line in [*head, *body, *foot]]


# snapshot_to_json is importable from here too, for the callers that build the document and draw it.
__all__ = [
    "container_name",
    "memory_bar",
    "render_compact",
    "render_status",
    "share_bar",
    "snapshot_to_json",
]
