"""Enforcement against real processes: the fake GPU backend, attribution from /proc, the snapshot
builder and the enforcer, polled in a loop as the daemon does.

Every process signalled here is a `sleep` child spawned by the test; the `spawn` fixture resumes
and kills each one whatever the outcome, and stopped-process records name only those children.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from deviceplugin.config import (
    ComputeAction,
    ComputeEnforcement,
    EnforcementConfig,
    MemoryAction,
    MemoryEnforcement,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.enforcer import (
    STOPPED_RECORD_NAME,
    DutyCycler,
    EnforcementError,
    Enforcer,
    ProcessControl,
    PsutilControl,
    RecordingControl,
    read_stopped_record,
    write_stopped_record,
)
from deviceplugin.enforcer.actuator import SignalResult, start_ticks
from deviceplugin.gpu.fake import FakeBackend, proc_stat_state, write_state_file
from deviceplugin.model import (
    AllocationRecord,
    ContainerUsage,
    DaemonHealth,
    DeviceGrant,
    EnforcementCount,
    GpuInfo,
    GpuReading,
    GpuUsage,
    NodeReading,
    NodeSnapshot,
    ProcessSample,
    allocation_id,
)
from deviceplugin.slicing import build_inventory
from deviceplugin.usage.attribution import SnapshotBuilder
from deviceplugin.usage.procs import AllocationResolver

GIB = 1024**3
GPU = "GPU-00000000-0000-4000-8000-00000000e0f0"
POLL_S = 0.2
PERIOD_S = 0.1
SLICE_GIB = 20  # an 80 GiB GPU in 4 slices

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def slices(*numbers: int) -> tuple[str, ...]:
    return tuple(f"{GPU}::{n}" for n in numbers)


A_SLICES = slices(0)  # compute share 0.25
B_SLICES = slices(1, 2, 3)  # compute share 0.75
A = allocation_id(A_SLICES)
B = allocation_id(B_SLICES)


def granted(slice_ids: tuple[str, ...]) -> tuple[DeviceGrant, ...]:
    """What Allocate grants `slice_ids` of the 80Gi GPU in 4 slices."""
    k = len(slice_ids)
    return (DeviceGrant(GPU, k * 20 * GIB, k * 0.25, k),)


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[bytes]] = []

    def start(allocation: str | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "VGPU_ALLOCATION_ID"}
        if allocation is not None:
            env["VGPU_ALLOCATION_ID"] = allocation
        child = subprocess.Popen(["sleep", "120"], env=env)
        children.append(child)
        return child

    yield start
    for child in children:
        try:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
        finally:
            child.wait(timeout=10)


def run_state(pid: int) -> str:
    try:
        return proc_stat_state(Path(f"/proc/{pid}/stat").read_bytes())
    except FileNotFoundError:
        return "gone"


def is_stopped(pid: int) -> bool:
    return run_state(pid) in ("T", "t")


def wait_until(test: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if test():
            return True
        time.sleep(0.005)
    return test()


@dataclass
class Proc:
    child: subprocess.Popen[bytes]
    memory_gib: float = 1
    demand: float = 0

    @property
    def pid(self) -> int:
        return self.child.pid


class SpyControl(PsutilControl):
    """The real process control, counting what it sends; optionally failing on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, signal.Signals]] = []
        self.sent_at: list[float] = []
        self.fail_watch = False
        self.fail_stop_after: int | None = None
        self._lock_sent = threading.Lock()

    def watch(self, pids: Collection[int]) -> None:
        if self.fail_watch:
            raise RuntimeError("injected failure")
        super().watch(pids)

    def send(self, pid: int, sig: signal.Signals) -> SignalResult:
        with self._lock_sent:
            stops = sum(1 for _, s in self.sent if s == signal.SIGSTOP)
            limit = self.fail_stop_after
            in_thread = threading.current_thread().name == "vgpu-duty-cycle"
            if sig == signal.SIGSTOP and in_thread and limit is not None and stops >= limit:
                raise RuntimeError("injected failure in the duty-cycle thread")
            self.sent.append((pid, sig))
            self.sent_at.append(time.monotonic())
        return super().send(pid, sig)


@dataclass
class Node:
    """One fake GPU whose processes are real children, and the daemon's poll pipeline: backend
    -> attribution -> snapshot -> enforcer."""

    root: Path
    config: EnforcementConfig
    processes: list[Proc]
    control: ProcessControl = field(default_factory=SpyControl)
    allocations: tuple[AllocationRecord, ...] = (
        AllocationRecord(A, A_SLICES, 0.0, "team-a", "pod-a", "main", grants=granted(A_SLICES)),
        AllocationRecord(B, B_SLICES, 0.0, "team-b", "pod-b", "main", grants=granted(B_SLICES)),
    )
    readings: list[NodeReading] = field(default_factory=list)
    tick_times: list[float] = field(default_factory=list)
    snapshots: list[NodeSnapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state_file = self.root / "gpus.json"
        self.state_dir = self.root / "state"
        self.root.mkdir(parents=True, exist_ok=True)
        self.write()
        self.backend = FakeBackend(self.state_file, sample_interval_s=0.004)
        self.resolver = AllocationResolver()
        self.builder = SnapshotBuilder("node", self.config.compute.window_s)
        self.enforcer = Enforcer(self.config, self.state_dir, control=self.control)
        self.enforcer.recover()
        self._previous_s: float | None = None

    def write(self) -> None:
        processes = [
            {
                "pid": p.pid,
                "used_memory_bytes": int(p.memory_gib * GIB),
                "sm_demand_percent": p.demand,
            }
            for p in self.processes
        ]
        gpu = {
            "uuid": GPU,
            "index": 0,
            "name": "NVIDIA A100-SXM4-80GB",
            "memory_total_bytes": 80 * GIB,
            "minor": 0,
            "processes": processes,
        }
        write_state_file(self.state_file, {"gpus": [gpu]})

    def tick(self) -> NodeSnapshot:
        for p in self.processes:
            p.child.poll()  # reap what was killed, as a container runtime does
        self.tick_times.append(time.monotonic())
        reading = self.backend.poll()
        inventory = build_inventory(reading, SlicingConfig(default=SliceRule(replicas=4)))
        owners = self.resolver.resolve(p.pid for g in reading.gpus for p in g.processes)
        snap, _ = self.builder.build(
            reading,
            inventory,
            self.allocations,
            owners,
            now_s=reading.timestamp_s,
            wall_s=time.time(),
            health=DaemonHealth(),
            previous_reading_s=self._previous_s,
        )
        self._previous_s = reading.timestamp_s
        snap = self.enforcer.on_snapshot(snap)
        self.readings.append(reading)
        self.snapshots.append(snap)
        return snap

    def run(self, seconds: float, each: Callable[[NodeSnapshot], None] | None = None) -> None:
        start = time.monotonic()
        ticks = round(seconds / self.config.poll_interval_s)
        for k in range(1, ticks + 1):
            delay = start + k * self.config.poll_interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            snap = self.tick()
            if each is not None:
                each(snap)

    def utilisation(self, pid: int, last_s: float) -> float:
        """The fake's utilisation of `pid`, averaged over the readings of the last `last_s`."""
        end = self.readings[-1].timestamp_s
        weighted = 0.0
        total = 0.0
        for before, reading in zip(self.readings, self.readings[1:], strict=False):
            if reading.timestamp_s <= end - last_s:
                continue
            span = reading.timestamp_s - before.timestamp_s
            util = next(p.sm_util_percent for p in reading.gpus[0].processes if p.pid == pid)
            weighted += span * (util or 0.0)
            total += span
        return weighted / total / 100

    @property
    def spy(self) -> SpyControl:
        assert isinstance(self.control, SpyControl)
        return self.control

    def container(self, allocation: str) -> ContainerUsage:
        return next(c for c in self.snapshots[-1].containers if c.allocation_id == allocation)

    def counts(self) -> dict[tuple[str, str, str], int]:
        return {
            (c.allocation_id, c.kind, c.action): c.count for c in self.snapshots[-1].enforcement
        }

    def close(self) -> None:
        self.enforcer.close()
        self.backend.close()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(
        config: EnforcementConfig, processes: Sequence[Proc], control: ProcessControl | None = None
    ) -> Node:
        root = tmp_path / f"node{len(nodes)}"
        node = (
            Node(root, config, list(processes))
            if control is None
            else Node(root, config, list(processes), control)
        )
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def config(
    *,
    memory: MemoryAction = MemoryAction.KILL,
    grace_s: float = 1.0,
    compute: ComputeAction = ComputeAction.THROTTLE,
    work_conserving: bool = True,
) -> EnforcementConfig:
    return EnforcementConfig(
        poll_interval_s=POLL_S,
        memory=MemoryEnforcement(action=memory, grace_period_s=grace_s),
        compute=ComputeEnforcement(
            action=compute, window_s=2.0, period_s=PERIOD_S, work_conserving=work_conserving
        ),
    )


# -- memory --------------------------------------------------------------------------------------


def test_memory_over_the_limit_is_killed_after_the_grace_period_and_not_before(
    spawn: Spawn, make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    big = Proc(spawn(A), memory_gib=15)
    small = Proc(spawn(A), memory_gib=10)
    neighbour = Proc(spawn(B), memory_gib=30)
    node = make_node(config(grace_s=1.0), [big, small, neighbour])
    node.run(2.4)
    kills = [
        (at, pid)
        for at, (pid, sig) in zip(node.spy.sent_at, node.spy.sent, strict=True)
        if sig == signal.SIGKILL
    ]
    assert [pid for _, pid in kills] == [big.pid]
    waited = kills[0][0] - node.tick_times[0]  # from the first snapshot that showed it
    assert 1.0 - 0.1 * POLL_S <= waited <= 1.0 + 1.5 * POLL_S  # G1: within one poll of grace
    big.child.wait(timeout=5)
    assert big.child.returncode == -signal.SIGKILL
    assert small.child.poll() is None
    assert neighbour.child.poll() is None
    assert node.counts() == {(A, "memory", "kill"): 1}
    count = node.snapshots[-1].enforcement[0]
    assert count == EnforcementCount(A, GPU, "memory", "kill", 1, "team-a", "pod-a", "main")
    (line,) = [r for r in caplog.records if "action=kill" in r.getMessage()]
    assert line.levelname == "WARNING"
    for part in (
        "namespace=team-a",
        "pod=pod-a",
        "container=main",
        f"pid={big.pid}",
        f"gpu={GPU}",
        f"used_bytes={25 * GIB}",
        f"limit_bytes={SLICE_GIB * GIB}",
    ):
        assert part in line.getMessage()


def test_a_process_of_no_allocation_over_any_limit_is_never_touched(
    spawn: Spawn, make_node: Callable[..., Node]
) -> None:
    host = Proc(spawn(None), memory_gib=70, demand=100)
    tenant = Proc(spawn(A), memory_gib=2, demand=100)
    node = make_node(config(grace_s=0, work_conserving=False), [host, tenant])
    states: list[str] = []
    node.run(1.6, lambda snap: states.append(run_state(host.pid)))
    assert host.child.poll() is None
    assert "T" not in states
    assert all(pid != host.pid for pid, _ in node.spy.sent)
    (gpu,) = node.snapshots[-1].gpus
    assert [p.pid for p in gpu.unattributed] == [host.pid]
    # The tenant, held to its share, was signalled: enforcement was live all along.
    assert any(pid == tenant.pid for pid, _ in node.spy.sent)


# -- compute -------------------------------------------------------------------------------------


def test_two_containers_wanting_the_whole_gpu_converge_to_their_shares(
    spawn: Spawn, make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    a = Proc(spawn(A), demand=100)
    b = Proc(spawn(B), demand=100)
    node = make_node(config(), [a, b])
    node.run(8.0)
    assert node.utilisation(a.pid, 3.0) == pytest.approx(0.25, abs=0.05)
    assert node.utilisation(b.pid, 3.0) == pytest.approx(0.75, abs=0.05)

    usage_a, usage_b = node.container(A), node.container(B)
    assert usage_a.duty_cycle_ratio is not None
    assert 0.05 <= usage_a.duty_cycle_ratio < 1
    assert usage_a.throttled_seconds_total > 2.0
    assert usage_b.duty_cycle_ratio is None
    assert usage_b.throttled_seconds_total == 0.0
    assert node.counts()[(A, "compute", "throttle")] >= 1
    assert (B, "compute", "throttle") not in node.counts()
    started = [r for r in caplog.records if "compute share exceeded" in r.getMessage()]
    assert started
    assert all(r.levelname == "WARNING" for r in started)
    assert f"pid={a.pid}" in started[0].getMessage()


@pytest.mark.parametrize(
    ("work_conserving", "expected"),
    [pytest.param(True, 1.0, id="work-conserving"), pytest.param(False, 0.25, id="strict")],
)
def test_a_lone_container_uses_the_whole_gpu_only_when_work_conserving(
    spawn: Spawn, make_node: Callable[..., Node], work_conserving: bool, expected: float
) -> None:
    a = Proc(spawn(A), demand=100)
    node = make_node(config(work_conserving=work_conserving), [a])
    node.run(5.0)
    assert node.utilisation(a.pid, 2.5) == pytest.approx(expected, abs=0.05)
    if work_conserving:
        assert node.spy.sent == []


def test_monitor_never_signals(spawn: Spawn, make_node: Callable[..., Node]) -> None:
    a = Proc(spawn(A), memory_gib=30, demand=100)
    b = Proc(spawn(B), demand=100)
    node = make_node(
        config(memory=MemoryAction.MONITOR, grace_s=0, compute=ComputeAction.MONITOR), [a, b]
    )
    states: list[str] = []
    node.run(2.0, lambda snap: states.extend((run_state(a.pid), run_state(b.pid))))
    assert node.spy.sent == []
    assert a.child.poll() is None
    assert "T" not in states
    assert node.counts() == {(A, "memory", "monitor"): 1, (A, "compute", "monitor"): 1}
    assert node.utilisation(a.pid, 1.0) == pytest.approx(0.5, abs=0.05)


def test_a_dry_run_signals_nothing_but_reports_what_it_would_do(
    spawn: Spawn, make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    a = Proc(spawn(A), memory_gib=30, demand=100)
    b = Proc(spawn(B), demand=100)
    dry = RecordingControl()
    node = make_node(config(grace_s=0), [a, b], dry)
    states: list[str] = []
    node.run(1.6, lambda snap: states.extend((run_state(a.pid), run_state(b.pid))))
    assert a.child.poll() is None
    assert "T" not in states
    assert (a.pid, signal.SIGKILL) in dry.sent
    assert (a.pid, signal.SIGSTOP) in dry.sent
    assert {pid for pid, _ in dry.sent} == {a.pid}
    assert node.container(A).duty_cycle_ratio is not None
    # Counted as what it would have done, not as a kill or a throttle: an alert on kills stays
    # quiet, and the operator sees what enforcement would do.
    assert node.counts() == {(A, "memory", "would_kill"): 1, (A, "compute", "would_throttle"): 1}
    assert not (node.state_dir / STOPPED_RECORD_NAME).exists()
    actions = [r.getMessage() for r in caplog.records if "action=" in r.getMessage()]
    assert actions
    assert all("dry_run=True" in line for line in actions)
    kills = [line for line in actions if line.startswith("memory limit exceeded")]
    assert kills
    assert all("action=would_kill" in line for line in kills)
    assert all("sent=false (dry run: would kill)" in line for line in kills)
    throttles = [line for line in actions if line.startswith("compute share exceeded")]
    assert throttles
    assert all("action=would_throttle" in line for line in throttles)


def test_nothing_is_stopped_while_the_stopped_process_record_cannot_be_written(
    spawn: Spawn, make_node: Callable[..., Node], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "state").write_text("a file where the state directory should be")
    a, b = Proc(spawn(A), demand=100), Proc(spawn(B), demand=100)
    node = make_node(config(), [a, b])
    node.run(1.0)
    assert all(sig != signal.SIGSTOP for _, sig in node.spy.sent)
    assert node.container(A).duty_cycle_ratio is None
    errors = [r for r in caplog.records if "cannot write the stopped-process record" in r.message]
    assert len(errors) == 1


# -- every exit path resumes --------------------------------------------------------------------


def test_close_leaves_every_process_running(spawn: Spawn, make_node: Callable[..., Node]) -> None:
    pair = [Proc(spawn(A), demand=100), Proc(spawn(A), demand=100), Proc(spawn(B), demand=100)]
    node = make_node(config(), pair)
    node.run(1.0)
    assert node.enforcer.policy.throttled()
    record = read_stopped_record(node.state_dir / STOPPED_RECORD_NAME)
    assert {pid for pid, _ in record} == {pair[0].pid, pair[1].pid}
    # Close in the middle of a stop phase.
    assert wait_until(lambda: is_stopped(pair[0].pid), 2.0)
    node.enforcer.close()
    for _ in range(10):
        assert all(run_state(p.pid) not in ("T", "t") for p in pair)
        time.sleep(PERIOD_S / 4)
    assert not node.enforcer.cycler.alive
    assert not (node.state_dir / STOPPED_RECORD_NAME).exists()
    node.enforcer.close()  # idempotent


def test_a_failure_while_enforcing_resumes_everything_before_it_propagates(
    spawn: Spawn, make_node: Callable[..., Node]
) -> None:
    pair = [Proc(spawn(A), demand=100), Proc(spawn(B), demand=100)]
    node = make_node(config(), pair)
    node.run(1.0)
    assert wait_until(lambda: is_stopped(pair[0].pid), 2.0)
    node.spy.fail_watch = True
    with pytest.raises(RuntimeError, match="injected"):
        node.tick()
    for _ in range(5):
        assert not is_stopped(pair[0].pid)
        time.sleep(PERIOD_S / 2)


def test_a_failed_duty_cycle_thread_resumes_everything_and_stops_enforcement(
    spawn: Spawn, make_node: Callable[..., Node]
) -> None:
    pair = [Proc(spawn(A), demand=100), Proc(spawn(B), demand=100)]
    node = make_node(config(), pair)
    node.spy.fail_stop_after = 3
    with pytest.raises(EnforcementError, match="duty-cycle thread failed"):
        node.run(2.0)
    assert node.enforcer.cycler.error is not None
    assert not node.enforcer.cycler.alive
    for _ in range(5):
        assert not is_stopped(pair[0].pid)
        time.sleep(PERIOD_S / 2)


_DAEMON = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from deviceplugin.config import ComputeEnforcement, EnforcementConfig
    from deviceplugin.enforcer import Enforcer
    from deviceplugin.model import (
        ContainerUsage, GpuInfo, GpuReading, GpuUsage, NodeSnapshot, ProcessSample,
    )

    state_dir, a, b, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    info = GpuInfo("GPU-x", 0, "fake", 1 << 34, 0)
    def usage(allocation, pid, share):
        process = ProcessSample(pid, 0, 50.0)
        return ContainerUsage(allocation, "GPU-x", 0, 1, 0, 1 << 32, 0.5, share, (process,))
    snapshot = NodeSnapshot(
        0.0, "node", (GpuUsage(GpuReading(info), None),),
        (usage("a" * 16, a, 0.25), usage("b" * 16, b, 0.75)),
    )
    config = EnforcementConfig(
        poll_interval_s=0.05, compute=ComputeEnforcement(period_s=0.2)
    )
    enforcer = Enforcer(config, state_dir)
    enforcer.recover()
    for _ in range(10):
        enforcer.on_snapshot(snapshot)
        time.sleep(0.05)
    print("throttling", flush=True)
    if mode == "hang":
        time.sleep(60)
    """
)


def start_daemon(state_dir: Path, a: int, b: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _DAEMON, str(state_dir), str(a), str(b), mode],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_daemon_killed_outright_has_its_stopped_processes_resumed_at_the_next_start(
    spawn: Spawn, tmp_path: Path
) -> None:
    a, b = spawn(A), spawn(B)
    daemon = start_daemon(tmp_path, a.pid, b.pid, "hang")
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline().strip() == "throttling"
        # Its duty is at the minimum by now: stopped 95 % of the time.
        assert wait_until(lambda: is_stopped(a.pid), 2.0)
        daemon.kill()
        daemon.wait(timeout=10)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)
    if not is_stopped(a.pid):  # killed while in its run phase: stop it as it would be
        a.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: is_stopped(a.pid), 2.0)
    assert [pid for pid, _ in read_stopped_record(tmp_path / STOPPED_RECORD_NAME)] == [a.pid]

    with Enforcer(config(), tmp_path) as enforcer:
        assert enforcer.recover() == 1
    assert wait_until(lambda: not is_stopped(a.pid), 2.0)
    assert not (tmp_path / STOPPED_RECORD_NAME).exists()
    assert not is_stopped(b.pid)


def test_a_daemon_that_exits_without_closing_resumes_at_exit(spawn: Spawn, tmp_path: Path) -> None:
    a, b = spawn(A), spawn(B)
    daemon = start_daemon(tmp_path, a.pid, b.pid, "exit")
    try:
        assert daemon.wait(timeout=20) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)
    for _ in range(5):
        assert not is_stopped(a.pid)
        time.sleep(0.05)
    assert not (tmp_path / STOPPED_RECORD_NAME).exists()


def test_recovery_resumes_only_processes_whose_identity_matches(
    spawn: Spawn, tmp_path: Path
) -> None:
    ours, reused = spawn(A), spawn(A)
    gone = spawn(A)
    gone.kill()
    gone.wait(timeout=10)
    for child in (ours, reused):
        child.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: is_stopped(ours.pid) and is_stopped(reused.pid))
    created = start_ticks(ours.pid)
    other = start_ticks(reused.pid)
    assert created is not None
    assert other is not None
    other -= 3000  # as if the pid had been reused
    write_stopped_record(
        tmp_path / STOPPED_RECORD_NAME,
        [(ours.pid, created), (reused.pid, other), (gone.pid, created)],
    )
    with Enforcer(config(), tmp_path) as enforcer:
        assert enforcer.recover() == 1
    assert wait_until(lambda: not is_stopped(ours.pid))
    time.sleep(0.05)
    assert is_stopped(reused.pid)  # not ours any more: left alone (the fixture resumes it)
    assert not (tmp_path / STOPPED_RECORD_NAME).exists()


# -- signals that fail: exited, reused and protected processes ------------------------------------
#
# These drive the enforcer with hand-built snapshots. Those with made-up PIDs use a control that
# sends nothing (a RecordingControl, or a subclass that reports itself live so that the
# stopped-process record is written); only the tests marked "real" signal processes, and those
# are children of the test.

WALL_S = 1_000_000.0  # the wall-clock time of the hand-built snapshots' readings


def hand_snapshot(
    pids: Sequence[int],
    *,
    util: float = 100.0,
    memory_gib: float = 1,
    taken_at_s: float = WALL_S,
    stale: bool = False,
    unattributed: Sequence[int] = (),
) -> NodeSnapshot:
    """Container A (share 0.25, 20 GiB) alone on the GPU with `pids`, each using `util` percent
    and `memory_gib`; `unattributed` PIDs run on the GPU for no allocation."""
    info = GpuInfo(GPU, 0, "NVIDIA A100-SXM4-80GB", 80 * GIB, 0)
    processes = tuple(ProcessSample(pid, int(memory_gib * GIB), util) for pid in pids)
    others = tuple(ProcessSample(pid, GIB, 0.0) for pid in unattributed)
    usage = ContainerUsage(
        A,
        GPU,
        0,
        1,
        sum(p.used_memory_bytes or 0 for p in processes),
        SLICE_GIB * GIB,
        0.0,
        0.25,
        processes,
        "team-a",
        "pod-a",
        "main",
    )
    return NodeSnapshot(
        taken_at_s,
        "node",
        (GpuUsage(GpuReading(info, processes=processes + others), None, unattributed=others),),
        (usage,),
        (AllocationRecord(A, A_SLICES, 0.0, "team-a", "pod-a", "main"),),
        stale=stale,
    )


@dataclass
class LiveRecordingControl(RecordingControl):
    """A RecordingControl that is not a dry run (the enforcer writes its record), and that
    refuses SIGCONT to the PIDs in `deny_resume`. Sends nothing."""

    deny_resume: set[int] = field(default_factory=set)
    # PIDs that moved to another cgroup since they were attributed: never killed or stopped.
    moved: set[int] = field(default_factory=set)

    @property
    def dry_run(self) -> bool:
        return False

    def send(self, pid: int, sig: signal.Signals) -> SignalResult:
        if sig == signal.SIGCONT and pid in self.deny_resume and pid in self.held:
            return SignalResult.DENIED
        if sig in (signal.SIGKILL, signal.SIGSTOP) and pid in self.moved and pid in self.held:
            del self.held[pid]
            return SignalResult.MOVED
        return super().send(pid, sig)


class WallClock:
    def __init__(self, now_s: float = WALL_S) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def enforcers() -> Iterator[list[Enforcer]]:
    made: list[Enforcer] = []
    yield made
    for enforcer in made:
        enforcer.close()


def strict_config(*, grace_s: float = 1.0) -> EnforcementConfig:
    """Without work conservation: a lone container is held to its share, so one process at
    100 % is throttled at once."""
    return config(grace_s=grace_s, work_conserving=False)


def signals_to(control: RecordingControl, pid: int) -> list[signal.Signals]:
    return [sig for p, sig in list(control.sent) if p == pid]


def test_a_throttled_pid_whose_process_exits_is_never_signalled_again_even_once_reused(
    tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    pid, sibling = 4001, 4002
    control = RecordingControl()
    wall = WallClock()
    enforcer = Enforcer(strict_config(), tmp_path, control=control, wall_clock=wall)
    enforcers.append(enforcer)
    enforcer.on_snapshot(hand_snapshot([pid, sibling]))
    assert enforcer.cycler.pids() == {pid, sibling}
    assert wait_until(lambda: signal.SIGSTOP in signals_to(control, pid), 2.0)

    # The throttled process exits: the next signal finds it gone, and it leaves the duty cycle.
    control.gone.add(pid)
    assert wait_until(lambda: pid not in enforcer.cycler.pids(), 2.0)
    before = len(signals_to(control, pid))
    # Its PID is taken by an unrelated process, while polling fails: the stale snapshots still
    # list the old process in container A.
    control.gone.discard(pid)
    control.create_times[pid] = 77_777.0
    stale = hand_snapshot([pid, sibling], stale=True)
    for tick in range(8):
        wall.now_s = WALL_S + 0.4 * (tick + 1)  # under 5 s: the throttle is held
        enforcer.on_snapshot(stale)
        time.sleep(PERIOD_S / 2)
    assert enforcer.cycler.duty((A, GPU)) is not None
    assert len(signals_to(control, sibling)) > 4  # the duty cycle went on for the sibling
    assert len(signals_to(control, pid)) == before
    assert list(control.acquired).count(pid) == 1
    assert pid not in control.held
    assert pid not in enforcer.cycler.pids()

    # Polling is back; the new process is no tenant's: still left alone.
    wall.now_s = WALL_S + 4.0
    enforcer.on_snapshot(hand_snapshot([sibling], taken_at_s=wall.now_s, unattributed=[pid]))
    time.sleep(2 * PERIOD_S)
    assert len(signals_to(control, pid)) == before
    assert list(control.acquired).count(pid) == 1


def test_the_duty_cycler_drops_a_gone_pid_and_naming_it_again_acquires_nothing() -> None:
    control = RecordingControl()
    control.watch([7, 8])
    cycler = DutyCycler(control, PERIOD_S)
    try:
        cycler.set("g", [7, 8], 0.5)
        assert wait_until(lambda: signals_to(control, 7).count(signal.SIGSTOP) >= 2, 2.0)
        control.gone.add(7)
        assert wait_until(lambda: cycler.pids() == {8}, 2.0)
        control.gone.discard(7)  # the PID is someone else's now
        control.create_times[7] = 99_999.0
        before = len(signals_to(control, 7))
        cycler.set("g", [7, 8], 0.5)  # named again without a fresh identity: nothing to hold
        stops_8 = signals_to(control, 8).count(signal.SIGSTOP)
        time.sleep(4 * PERIOD_S)
        assert len(signals_to(control, 7)) == before
        assert cycler.pids() == {8}
        assert signals_to(control, 8).count(signal.SIGSTOP) >= stops_8 + 2
        assert list(control.acquired).count(7) == 1
    finally:
        cycler.stop()
    assert 8 not in control.stopped


def test_real_a_throttled_process_that_exits_is_not_signalled_again(
    spawn: Spawn, tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    victim, sibling = spawn(A), spawn(A)
    spy = SpyControl()
    wall = WallClock()
    enforcer = Enforcer(strict_config(), tmp_path, control=spy, wall_clock=wall)
    enforcers.append(enforcer)
    enforcer.on_snapshot(hand_snapshot([victim.pid, sibling.pid]))
    assert wait_until(lambda: is_stopped(victim.pid), 2.0)
    victim.kill()  # SIGKILL ends a stopped process too
    victim.wait(timeout=10)
    assert wait_until(lambda: victim.pid not in enforcer.cycler.pids(), 2.0)
    assert spy.create_time(victim.pid) is None  # its identity is forgotten
    before = sum(1 for pid, _ in spy.sent if pid == victim.pid)
    stale = hand_snapshot([victim.pid, sibling.pid], stale=True)
    for tick in range(6):
        wall.now_s = WALL_S + 0.5 * (tick + 1)
        enforcer.on_snapshot(stale)
        time.sleep(PERIOD_S / 2)
    assert sum(1 for pid, _ in spy.sent if pid == victim.pid) == before
    assert spy.create_time(victim.pid) is None
    assert enforcer.cycler.pids() == {sibling.pid}
    assert is_stopped(sibling.pid) or wait_until(lambda: is_stopped(sibling.pid), 2.0)
    enforcer.close()
    assert wait_until(lambda: not is_stopped(sibling.pid), 2.0)


@pytest.mark.parametrize(
    ("first_stale_after_s", "released_after_s"),
    [
        pytest.param(POLL_S, 5.0, id="polls fail at once"),
        pytest.param(6.0, 6.0, id="a poll hangs until its timeout"),
    ],
)
def test_throttles_are_released_when_polling_has_failed_for_5_s(
    tmp_path: Path,
    enforcers: list[Enforcer],
    caplog: pytest.LogCaptureFixture,
    first_stale_after_s: float,
    released_after_s: float,
) -> None:
    """The README: "When polling fails for 5 s, throttles are released", counted from the last
    successful poll, however late the first failure is reported."""
    control = RecordingControl()
    wall = WallClock()
    enforcer = Enforcer(strict_config(), tmp_path, control=control, wall_clock=wall)
    enforcers.append(enforcer)
    good = enforcer.on_snapshot(hand_snapshot([4001]))
    assert good.containers[0].duty_cycle_ratio is not None
    stale = hand_snapshot([4001], stale=True)  # the last good figures, marked stale
    at = first_stale_after_s
    while at < released_after_s - 1e-9:
        wall.now_s = WALL_S + at
        assert enforcer.on_snapshot(stale).containers[0].duty_cycle_ratio is not None, at
        at += POLL_S
    wall.now_s = WALL_S + released_after_s
    assert enforcer.on_snapshot(stale).containers[0].duty_cycle_ratio is None
    assert enforcer.cycler.group_keys() == frozenset()
    assert 4001 not in control.stopped
    (line,) = [r.getMessage() for r in caplog.records if "throttle released" in r.getMessage()]
    assert "measurements stale" in line


def test_a_stop_refused_because_the_process_moved_is_counted_and_never_retried() -> None:
    control = LiveRecordingControl(moved={7})
    control.watch([7, 8])
    cycler = DutyCycler(control, PERIOD_S)
    try:
        cycler.set("g", [7, 8], 0.5)
        assert wait_until(lambda: signals_to(control, 8).count(signal.SIGSTOP) >= 3, 3.0)
        assert cycler.signals_moved == 1
        assert cycler.pids() == {8}  # the moved process is out of the group, not tried again
    finally:
        cycler.stop()
    assert signals_to(control, 7) == []


def test_a_denied_stop_is_logged_once_counted_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    control = RecordingControl(denied={7})
    control.watch([7, 8])
    cycler = DutyCycler(control, PERIOD_S)
    try:
        cycler.set("g", [7, 8], 0.5)
        assert wait_until(lambda: cycler.signals_denied >= 5, 3.0)
        assert cycler.pids() == {7, 8}  # still throttled: tried again every period
        assert signals_to(control, 8).count(signal.SIGSTOP) >= 4
    finally:
        cycler.stop()
    assert signals_to(control, 7) == []
    lines = [r for r in caplog.records if "permission denied" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].levelname == "WARNING"
    assert "pid=7 " in lines[0].getMessage()


def test_a_process_whose_resume_is_denied_stays_in_the_record_until_a_start_resumes_it(
    tmp_path: Path, enforcers: list[Enforcer], caplog: pytest.LogCaptureFixture
) -> None:
    pid = 4001
    record = tmp_path / STOPPED_RECORD_NAME
    control = LiveRecordingControl(deny_resume={pid})
    enforcer = Enforcer(strict_config(), tmp_path, control=control)
    enforcers.append(enforcer)
    enforcer.on_snapshot(hand_snapshot([pid]))
    assert wait_until(lambda: enforcer.cycler.unresumed() == {pid}, 2.0)
    enforcer.on_snapshot(hand_snapshot([pid]))
    enforcer.close()
    assert pid in control.stopped
    assert read_stopped_record(record) == [(pid, 1000.0 + pid)]
    assert enforcer.signals_denied >= 2  # the first resume and the one at close, at least
    assert any("may still be stopped" in r.getMessage() for r in caplog.records)

    # The next start cannot resume it either: it stays recorded, and survives this run's writes.
    denied = LiveRecordingControl(denied={pid})
    second = Enforcer(strict_config(), tmp_path, control=denied)
    enforcers.append(second)
    assert second.recover() == 0
    second.on_snapshot(hand_snapshot([]))
    second.close()
    assert read_stopped_record(record) == [(pid, 1000.0 + pid)]

    allowed = LiveRecordingControl()
    third = Enforcer(strict_config(), tmp_path, control=allowed)
    enforcers.append(third)
    assert third.recover() == 1
    assert (pid, signal.SIGCONT) in allowed.sent
    assert not record.exists()


_KILL_LOG = {
    SignalResult.SENT: "sent=true ",
    SignalResult.GONE: "sent=false (process gone)",
    SignalResult.DENIED: "sent=false (permission denied)",
    SignalResult.MOVED: "sent=false (moved to another cgroup since it was attributed)",
}


@pytest.mark.parametrize("result", list(SignalResult), ids=lambda r: r.value)
def test_a_kill_is_logged_with_what_became_of_it(
    tmp_path: Path,
    enforcers: list[Enforcer],
    caplog: pytest.LogCaptureFixture,
    result: SignalResult,
) -> None:
    control = LiveRecordingControl()
    if result is SignalResult.GONE:
        control.gone.add(4001)
    elif result is SignalResult.DENIED:
        control.denied.add(4001)
    elif result is SignalResult.MOVED:
        control.moved.add(4001)
    enforcer = Enforcer(strict_config(grace_s=0), tmp_path, control=control)
    enforcers.append(enforcer)
    published = enforcer.on_snapshot(hand_snapshot([4001], util=0.0, memory_gib=30))
    (line,) = [r.getMessage() for r in caplog.records if "action=kill" in r.getMessage()]
    assert _KILL_LOG[result] in line
    assert "pod=" in line
    assert "pid=4001" in line
    assert enforcer.signals_denied == (1 if result is SignalResult.DENIED else 0)
    # The snapshot /metrics serves counts what was not sent, by reason.
    assert dict(published.signals_not_sent) == {
        "permission_denied": 1 if result is SignalResult.DENIED else 0,
        "moved": 1 if result is SignalResult.MOVED else 0,
    }
    assert [sig for _, sig in control.sent] == (
        [signal.SIGKILL] if result is SignalResult.SENT else []
    )


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "psutil"])
def test_real_psutil_control_reports_sent_gone_and_denied(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch, use_pidfd: bool
) -> None:
    if use_pidfd and not hasattr(signal, "pidfd_send_signal"):
        pytest.skip("no pidfds here")
    child, other = spawn(A), spawn(A)
    control = PsutilControl(use_pidfd=use_pidfd)
    try:
        assert control.send(other.pid, signal.SIGCONT) is SignalResult.GONE  # not held
        control.watch([child.pid])
        assert control.send(child.pid, signal.SIGCONT) is SignalResult.SENT

        def refuse(*args: object) -> None:
            raise PermissionError(errno.EPERM, "Operation not permitted")  # as the kernel does

        with monkeypatch.context() as patch:
            patch.setattr(signal, "pidfd_send_signal", refuse)
            patch.setattr(os, "kill", refuse)  # under psutil's send_signal
            assert control.send(child.pid, signal.SIGSTOP) is SignalResult.DENIED
            ticks = start_ticks(child.pid)
            assert ticks is not None
            created = float(ticks)
            assert control.resume_recorded(child.pid, created) is SignalResult.DENIED
        assert control.create_time(child.pid) is not None  # denied: still held
        assert not is_stopped(child.pid)
        assert control.resume_recorded(child.pid, created) is SignalResult.SENT
        assert control.resume_recorded(child.pid, created - 30) is SignalResult.GONE

        child.kill()
        child.wait(timeout=10)
        assert control.send(child.pid, signal.SIGCONT) is SignalResult.GONE
        assert control.create_time(child.pid) is None  # gone: forgotten
        assert control.resume_recorded(child.pid, created) is SignalResult.GONE
    finally:
        control.close()


def test_watch_acquires_and_retain_only_keeps(spawn: Spawn) -> None:
    first, second = spawn(A), spawn(A)
    control = PsutilControl()
    try:
        control.retain([first.pid])  # never acquires
        assert control.create_time(first.pid) is None
        control.watch([first.pid, second.pid])
        control.watch([first.pid])  # keeps what is held
        assert control.create_time(second.pid) is not None
        control.retain([first.pid])
        assert control.create_time(first.pid) is not None
        assert control.create_time(second.pid) is None
        assert control.send(second.pid, signal.SIGCONT) is SignalResult.GONE
    finally:
        control.close()


def test_the_duty_cyclers_figures_match_its_readings_key_by_key() -> None:
    control = RecordingControl()
    control.watch([7, 8])
    cycler = DutyCycler(control, PERIOD_S)
    try:
        cycler.set("throttled", [7], 0.5)
        cycler.set("released", [8], 0.5)
        assert wait_until(lambda: cycler.stopped_seconds("released") > 0, 2.0)
        cycler.release("released")
        figures = cycler.figures()
        assert figures["released"] == (None, cycler.stopped_seconds("released"))
        duty, stopped_s = figures["throttled"]
        assert duty == cycler.duty("throttled") == 0.5
        assert 0 < stopped_s <= cycler.stopped_seconds("throttled")
        assert "never throttled" not in figures  # read as (None, 0.0)
        assert cycler.duty("never throttled") is None
        assert cycler.stopped_seconds("never throttled") == 0.0
    finally:
        cycler.stop()


def test_a_steady_container_shows_the_entitlement_its_neighbours_leave_it(
    tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    """The enforcer hands out last poll's annotated containers while nothing changed; an
    unattributed process filling the GPU changes the container's entitlement, not its usage."""
    enforcer = Enforcer(config(), tmp_path, control=RecordingControl(), wall_clock=WallClock())
    enforcers.append(enforcer)
    alone = hand_snapshot([4001], util=30.0)
    for _ in range(3):  # room on the GPU: it may use what it wants, no entitlement to show
        assert enforcer.on_snapshot(alone).containers[0].entitlement_ratio is None
    (gpu,) = alone.gpus
    crowded = replace(alone, gpus=(replace(gpu, unattributed=(ProcessSample(99, GIB, 70.0),)),))
    assert crowded.containers == alone.containers
    # The GPU is full: its demand can no longer be seen, and its neighbours leave it all of it.
    assert enforcer.on_snapshot(crowded).containers[0].entitlement_ratio == pytest.approx(1.0)
