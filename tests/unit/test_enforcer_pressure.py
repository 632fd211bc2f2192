"""Memory reclaimed under pressure (deviceplugin.enforcer.pressure): who loses a process when a
GPU runs short of memory, who never does, and that the enforcer stops the process through the
same stop path as a memory kill (the one MPS drains through)."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

from deviceplugin.config import MemoryAction
from deviceplugin.enforcer.control import SignalResult
from deviceplugin.enforcer.enforcer import Enforcer
from deviceplugin.enforcer.policy import EnforcementPolicy, Kill, Record
from deviceplugin.enforcer.pressure import PressureState, decide_pressure
from deviceplugin.enforcer.recording import RecordingControl
from deviceplugin.enforcer.stopping import Kill as KillCall
from deviceplugin.model import ContainerUsage, NodeSnapshot
from tests.support.policy_model import GIB, GPU, config, container, kills, proc, snapshot

TOTAL = 80 * GIB


def burstable(name: str, pids_gib: list[tuple[int, float]], request_gib: float) -> ContainerUsage:
    """A container whose limit (30 GiB) is above its request."""
    c = container(name, [proc(pid, gib) for pid, gib in pids_gib], limit_gib=30)
    return replace(c, memory_request_bytes=int(request_gib * GIB))


def guaranteed(name: str, pids_gib: list[tuple[int, float]], limit_gib: float) -> ContainerUsage:
    return container(name, [proc(pid, gib) for pid, gib in pids_gib], limit_gib=limit_gib)


def decide(
    containers: list[ContainerUsage],
    used_gib: float,
    *,
    state: PressureState | None = None,
    free_below_gib: float = 4,
    action: MemoryAction = MemoryAction.KILL,
    now_s: float = 0.0,
) -> list[object]:
    cfg = config(memory=action)
    cfg = replace(
        cfg, memory=replace(cfg.memory, pressure_free_below_bytes=int(free_below_gib * GIB))
    )
    own = {(c.allocation_id, c.gpu_uuid): c.processes for c in containers}
    return list(
        decide_pressure(
            (GPU, TOTAL, int(used_gib * GIB)),
            containers,
            own,
            now_s,
            state=state if state is not None else PressureState(),
            config=cfg,
            kill_timeout_s=5.0,
        )
    )


def test_the_container_furthest_above_its_request_loses_its_largest_process() -> None:
    near = burstable("near", [(10, 9)], request_gib=8)  # 1 GiB above
    far = burstable("far", [(20, 3), (21, 12)], request_gib=5)  # 10 GiB above
    big = guaranteed("big", [(30, 40)], limit_gib=40)  # the most memory, within its limit
    decisions = decide([near, far, big], used_gib=78)
    (kill,) = decisions
    assert isinstance(kill, Kill)
    assert (kill.allocation_id, kill.pid, kill.reclaim) == ("far", 21, True)
    assert kill.limit_bytes == 5 * GIB  # its request, which the log line names


def test_no_container_within_its_request_is_ever_reclaimed_from() -> None:
    within = burstable("within", [(10, 7)], request_gib=8)
    steady = guaranteed("steady", [(20, 10)], limit_gib=10)
    assert decide([within, steady], used_gib=79.5) == []


def test_nothing_is_reclaimed_while_the_gpu_has_memory_to_spare() -> None:
    far = burstable("far", [(20, 20)], request_gib=5)
    assert decide([far], used_gib=60) == []


def test_a_guaranteed_container_unable_to_reach_its_request_is_pressure_too() -> None:
    """10 GiB free, above the threshold, but `steady` still has 12 GiB of its request to go."""
    far = burstable("far", [(20, 25)], request_gib=5)
    steady = guaranteed("steady", [(30, 8)], limit_gib=20)
    (kill,) = decide([far, steady], used_gib=70, free_below_gib=0)
    assert isinstance(kill, Kill)
    assert kill.allocation_id == "far"


def test_one_process_at_a_time_until_it_left_the_gpu() -> None:
    state = PressureState()
    far = burstable("far", [(20, 10), (21, 12)], request_gib=5)
    (first,) = decide([far], used_gib=78, state=state)
    assert isinstance(first, Kill)
    assert first.pid == 21
    # Still listed, within the kill timeout: nothing more is taken.
    assert decide([far], used_gib=78, state=state, now_s=1.0) == []
    # Gone from the GPU, pressure still there: the next largest goes.
    rest = burstable("far", [(20, 10)], request_gib=5)
    (second,) = decide([rest], used_gib=78, state=state, now_s=2.0)
    assert isinstance(second, Kill)
    assert second.pid == 20


def test_monitor_records_each_pressure_episode_once() -> None:
    state = PressureState()
    far = burstable("far", [(20, 20)], request_gib=5)
    (record,) = decide([far], used_gib=78, state=state, action=MemoryAction.MONITOR)
    assert isinstance(record, Record)
    assert decide([far], used_gib=78, state=state, action=MemoryAction.MONITOR) == []
    assert decide([far], used_gib=50, state=state, action=MemoryAction.MONITOR) == []
    assert len(decide([far], used_gib=78, state=state, action=MemoryAction.MONITOR)) == 1


def pressured(*containers: ContainerUsage, used_gib: float) -> NodeSnapshot:
    s = snapshot(*containers)
    (gpu,) = s.gpus
    reading = replace(gpu.reading, memory_used_bytes=int(used_gib * GIB))
    return replace(s, gpus=(replace(gpu, reading=reading),))


def test_the_policy_reclaims_from_a_snapshot_of_a_gpu_short_of_memory() -> None:
    policy = EnforcementPolicy(config())
    far = burstable("far", [(20, 20)], request_gib=5)
    steady = guaranteed("steady", [(30, 10)], limit_gib=10)
    assert kills(policy.decide(pressured(far, steady, used_gib=60), 0.0)) == []
    (kill,) = kills(policy.decide(pressured(far, steady, used_gib=79.5), 0.5))
    assert (kill.allocation_id, kill.pid, kill.reclaim) == ("far", 20, True)


class SendingControl(RecordingControl):
    """Records signals as sent for real (not a dry run), so the enforcer takes its stop path."""

    @property
    def dry_run(self) -> bool:
        return False


def test_a_reclaim_goes_through_the_enforcers_stop_path_and_is_counted(tmp_path: Path) -> None:
    stopped: list[int] = []

    def stop_process(pid: int, kill: KillCall, /) -> SignalResult:
        stopped.append(pid)  # where MPS drains the client first
        return kill()

    control = SendingControl()
    far = burstable("far", [(20, 20)], request_gib=5)
    steady = guaranteed("steady", [(30, 10)], limit_gib=10)
    with Enforcer(config(), tmp_path, control=control, stop_process=stop_process) as enforcer:
        enforcer.on_snapshot(pressured(far, steady, used_gib=79.5))
        assert stopped == [20]
        assert (20, signal.SIGKILL) in control.sent
        assert 30 not in {pid for pid, _ in control.sent}
        counts = {(c.allocation_id, c.kind, c.action): c.count for c in enforcer.counts()}
        assert counts[("far", "memory", "reclaim")] == 1
