"""What the demo shows: the slices, the pods' grants, the enforcement actions and the status
view, and the live loop that keeps that view current while events scroll above it."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import Callable, Sequence
from typing import TextIO

from deviceplugin.app import Daemon
from deviceplugin.model import ContainerUsage, Inventory, NodeSnapshot
from deviceplugin.sim.demo_workloads import (
    DEMO_WORKLOADS,
    GROW_AFTER_S,
    GROWN,
    SIZED_BY_HINTS,
    DemoWorkloads,
)
from deviceplugin.sim.kubelet import PodGrant
from deviceplugin.slicing import format_bytes
from deviceplugin.usage.statusview import render_status, snapshot_to_json

STATUS_EVERY_S = 5.0
REDRAW_EVERY_S = 1.0  # on a terminal, where the view is redrawn in place
# How long an exit waits for the enforcer's account of a kill, so that the kill comes first.
KILL_REPORT_WAIT_S = 2.0
# Terminal control: to the start of the line N lines up, and clear to the end of the screen.
CURSOR_UP = "\x1b[{}F"
CLEAR_BELOW = "\x1b[J"


class LiveView:
    """The live part of the demo's output. On a terminal the status view sits at the bottom and
    is redrawn in place, with event lines scrolling above it; elsewhere events are written as
    they come and the view only when asked to (`final`), so a log holds no screen codes."""

    def __init__(self, out: TextIO, *, terminal: bool) -> None:
        self._out = out
        self.terminal = terminal
        self._view: list[str] = []
        self._drawn = 0  # lines of the view now on the screen

    def _erase(self) -> None:
        if self._drawn:
            self._out.write(CURSOR_UP.format(self._drawn) + CLEAR_BELOW)
            self._drawn = 0

    def event(self, *lines: str) -> None:
        """Lines that stay: above the view on a terminal."""
        view = self._view if self.terminal else []
        self._erase()
        for line in lines:
            print(line, file=self._out)
        self._draw(view)

    def update(self, view: list[str]) -> None:
        """A new status view: redrawn in place on a terminal, kept for `final` elsewhere."""
        self._view = view
        if self.terminal:
            self._erase()
            self._draw(view)

    def final(self) -> None:
        """Leave the last view on the screen (on a terminal it already is)."""
        if not self.terminal and self._view:
            for line in self._view:
                print(line, file=self._out)
            self._out.flush()
        self._drawn = 0

    def _draw(self, view: list[str]) -> None:
        for line in view:
            print(line, file=self._out)
        self._drawn = len(view)
        self._out.flush()


def describe_actions(before: NodeSnapshot | None, after: NodeSnapshot | None) -> list[str]:
    """A line for each enforcement action counted between two snapshots."""
    if after is None:
        return []
    seen = {
        (e.allocation_id, e.gpu_uuid, e.kind, e.action): e.count
        for e in (before.enforcement if before else ())
    }
    usage = {(c.allocation_id, c.gpu_uuid): c for c in after.containers}
    # Use from the snapshot before the action too: once throttled, a container's use drops, and
    # the figure that made the enforcer act is the earlier one.
    earlier = {(c.allocation_id, c.gpu_uuid): c for c in (before.containers if before else ())}
    lines = []
    for e in after.enforcement:
        key = (e.allocation_id, e.gpu_uuid, e.kind, e.action)
        if e.count <= seen.get(key, 0):
            continue
        who = f"{e.namespace}/{e.pod}/{e.container}" if e.pod else e.allocation_id
        c = usage.get((e.allocation_id, e.gpu_uuid))
        if e.kind == "memory" and e.action == "kill":
            lines.append(
                f"enforcer: killed the largest GPU process of {who}: over its memory limit "
                f"for longer than the grace period"
                + (f" ({format_bytes(c.memory_limit_bytes)} limit)" if c else "")
            )
        elif e.kind == "compute" and e.action == "throttle":
            lines.append(_throttle_line(who, c, earlier.get((e.allocation_id, e.gpu_uuid))))
        else:
            lines.append(f"enforcer: {e.kind} {e.action} on {who}")
    return lines


def _throttle_line(who: str, now: ContainerUsage | None, before: ContainerUsage | None) -> str:
    """Why a container is throttled, in the figures the status view shows: the entitlement it
    "may use" (under work-conserving sharing, more than its bare share) and what it used, from
    whichever snapshot shows it over (its use drops once it is paused)."""

    def percent(ratio: float) -> int:
        return round(ratio * 100)

    over = [
        c
        for c in (before, now)
        if c is not None
        and c.entitlement_ratio is not None
        and percent(c.sm_utilization_ratio) > percent(c.entitlement_ratio)
    ]
    c = over[0] if over else now
    tail = ", while others wanted more (SIGSTOP/SIGCONT duty cycle)"
    if c is None:
        return f"enforcer: throttling {who}: it used more than its share{tail}"
    share = f"{c.compute_share_ratio * 100:.4g}%"
    if c.entitlement_ratio is None:
        held = f"more than its {share} share"
    elif over:
        held = f"more than the {percent(c.entitlement_ratio)}% it may use now (a {share} share)"
    else:
        # Neither snapshot caught it over: the enforcer judged a window the view did not show.
        return (
            f"enforcer: throttling {who}: over its window it used more than the "
            f"{percent(c.entitlement_ratio)}% it may use now (a {share} share){tail}"
        )
    used = percent(c.sm_utilization_ratio)
    return f"enforcer: throttling {who}: it used {used}% of the GPU, {held}{tail}"


def plural(count: int, word: str) -> str:
    """`1 slice`, `2 slices`."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def _short(uuid: str) -> str:
    return uuid[:12] + "…"


def render_slices(inventory: Inventory, held_by: dict[str, str]) -> list[str]:
    """The slice map: per GPU its slices and who holds them; a GPU in MIG mode with its MIG
    devices under it, each with its resource and slices."""
    lines = []
    for plan in inventory.plans:
        gpu = plan.gpu
        pad = "  " if gpu.is_mig_device else ""
        if gpu.is_mig_device:
            head = (
                f"  MIG {gpu.mig_profile}  GI {gpu.gpu_instance_id}  "
                f"{format_bytes(gpu.memory_total_bytes)}  {gpu.uuid}"
            )
        else:
            head = (
                f"GPU {gpu.index}  {gpu.name}  {format_bytes(gpu.memory_total_bytes)}  "
                f"NUMA {gpu.numa_node}  {gpu.uuid}"
            )
        lines.append(head)
        if not plan.sliced:
            lines.append(f"{pad}  not sliced: {plan.excluded_reason}")
            continue
        compute = (
            "compute not enforced"
            if gpu.is_mig_device
            else f"{plan.compute_share_ratio * 100:.4g}% compute each"
        )
        lines.append(
            f"{pad}  {plan.resource_name}: {plural(plan.replicas, 'slice')} x "
            f"{format_bytes(plan.memory_per_slice_bytes)} memory, {compute}"
        )
        cells = []
        for s in inventory.slices:
            if s.id.gpu_uuid == gpu.uuid:
                owner = held_by.get(s.device_id, "free")
                cells.append(f"::{s.id.n} {owner}")
        # Two columns, each wide enough for the longest cell and two spaces, so no two run
        # together.
        width = max([36, *(len(c) + 2 for c in cells)])
        for i in range(0, len(cells), 2):
            lines.append(f"{pad}    " + "".join(f"{c:<{width}}" for c in cells[i : i + 2]).rstrip())
    return lines


def _on_mig(inventory: Inventory, uuid: str) -> bool:
    plan = inventory.plan_for(uuid)
    return plan is not None and plan.gpu.is_mig_device


def render_pods(pods: Sequence[PodGrant], inventory: Inventory) -> list[str]:
    lines = [
        f"{'NAMESPACE/POD/CONTAINER':<38} {'SLICES':>6}  {'GPU':<5} {'MEMORY':>8} {'COMPUTE':>8}"
    ]
    for pod in pods:
        for c in pod.containers:
            slices = [inventory.by_id[d] for d in c.device_ids if d in inventory.by_id]
            gpus = sorted({s.gpu_index for s in slices})
            memory = sum(s.memory_limit_bytes for s in slices)
            compute = f"{sum(s.compute_share_ratio for s in slices) * 100:.4g}%"
            if any(_on_mig(inventory, s.id.gpu_uuid) for s in slices):
                compute = "MIG"  # not measured per MIG device, so not enforced
            lines.append(
                f"{pod.namespace + '/' + pod.name + '/' + c.name:<38} {len(c.device_ids):>6}  "
                f"{','.join(map(str, gpus)):<5} {format_bytes(memory):>8} {compute:>8}"
            )
    return lines


async def _live(
    daemon: Daemon,
    workloads: DemoWorkloads,
    stop: asyncio.Event,
    duration_s: float | None,
    view: LiveView,
    *,
    seen: NodeSnapshot | None,
    extra: Callable[[float], list[str]] | None = None,
) -> None:
    """Until Ctrl-C or the duration: grow the notebook past its limit once (and `extra`, given
    the seconds since the start, says what else happened: its event lines), reap exited
    workloads, report each enforcement action as it happens (a killed process's exit only after
    its kill), and keep the status view current."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if duration_s is None else started + duration_s
    last_view = started
    grown = False
    reported_kills: set[str] = set()  # owners whose kill the enforcer has reported
    exits: list[tuple[float, int, str, int]] = []  # (seen at, pid, owner, return code)
    view.update(_status_lines(daemon, *_size(view)) if view.terminal else [])
    while not stop.is_set() and (deadline is None or loop.time() < deadline):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
        now = loop.time()
        if not grown and now - started >= GROW_AFTER_S:
            grown = True
            (namespace, pod, container), memory = GROWN
            pid = workloads.grow(f"{namespace}/{pod}/{container}", memory)
            view.event(
                f"{namespace}/{pod}/{container} has no running process to grow: it exited"
                if pid is None
                else f"{namespace}/{pod}/{container} (pid {pid}) now uses "
                f"{format_bytes(memory)} of GPU memory, over its limit",
                "",
            )
        told = [] if extra is None else extra(now - started)
        if told:
            view.event(*told)
        exits.extend((now, pid, owner, code) for pid, owner, code in workloads.reap())
        snapshot = daemon.poller.snapshot
        if snapshot is not None:
            lines = describe_actions(seen, snapshot)
            if lines:
                view.event(*lines, "")
                reported_kills.update(_killed_owners(seen, snapshot))
            seen = snapshot
        for exit_ in list(exits):
            at, pid, owner, code = exit_
            killed = code == -signal.SIGKILL
            if not killed or owner in reported_kills or now - at >= KILL_REPORT_WAIT_S:
                exits.remove(exit_)
                reported_kills.discard(owner)
                how = " (SIGKILL)" if killed else ""
                view.event(f"process {pid} of {owner} has exited{how}", "")
        every = REDRAW_EVERY_S if view.terminal else STATUS_EVERY_S
        if view.terminal and now - last_view >= every:
            last_view = now
            view.update(_status_lines(daemon, *_size(view)))


def _width(view: LiveView) -> int:
    """The view's width: the terminal's, less one column so that no line wraps."""
    return max(shutil.get_terminal_size((81, 24)).columns - 1, 40) if view.terminal else 80


def _size(view: LiveView) -> tuple[int, int | None]:
    """The view's width, and on a terminal its height: the terminal's, less two lines, so that
    the view is redrawn in place (a taller one would scroll away) with an event line above it."""
    if not view.terminal:
        return _width(view), None
    return _width(view), max(shutil.get_terminal_size((81, 24)).lines - 2, 10)


def _killed_owners(before: NodeSnapshot | None, after: NodeSnapshot) -> set[str]:
    """namespace/pod/container of each container with a kill counted between two snapshots."""
    seen = {
        (e.allocation_id, e.gpu_uuid, e.kind, e.action): e.count
        for e in (before.enforcement if before else ())
    }
    return {
        f"{e.namespace}/{e.pod}/{e.container}"
        for e in after.enforcement
        if e.action == "kill"
        and e.count > seen.get((e.allocation_id, e.gpu_uuid, e.kind, e.action), 0)
    }


async def _wait_for_usage(daemon: Daemon, timeout_s: float) -> None:
    """Until every container with work is named and measured, or the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        snap = daemon.poller.snapshot
        busy = (
            {(c.pod, c.container) for c in snap.containers if c.sm_utilization_ratio > 0}
            if snap
            else set()
        )
        if busy >= set(DEMO_WORKLOADS) | set(SIZED_BY_HINTS):
            return
        await asyncio.sleep(0.1)


def _status_lines(daemon: Daemon, width: int = 80, height: int | None = None) -> list[str]:
    snapshot = daemon.poller.snapshot
    if snapshot is None:
        return ["(no snapshot yet)"]
    return render_status(snapshot_to_json(snapshot), width=width, height=height)
