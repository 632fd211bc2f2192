"""A process that moved to another cgroup since it was attributed is judged by where it is now:
right before a SIGKILL or SIGSTOP its cgroup is read again, and a process that moved is not
signalled (nor acquired again while it stays there). Real processes, real cgroups (v2 and v1)
under a subtree the test owns."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from deviceplugin.enforcer.actuator import PsutilControl, SignalResult, run_state
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree
from deviceplugin.usage.procs import AllocationResolver
from tests.security.cgroup_support import cid, subtree
from tests.security.test_attribution_attacks import POD_UID


def state(pid: int) -> str | None:
    time.sleep(0.05)
    return run_state(pid)


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup-v2", "cgroup-v1"])
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_a_process_that_moved_since_it_was_attributed_is_not_signalled(
    version: int, sig: signal.Signals
) -> None:
    with subtree(version) as tree:
        pid = tree.spawn(f"{tree.name}/pod/container")
        control = PsutilControl()
        try:
            control.watch([pid])
            tree.move(pid, f"{tree.name}/elsewhere")
            assert control.send(pid, sig) is SignalResult.MOVED
            assert state(pid) == "S", "the moved process was signalled"
            # Attributed again from stale figures: still where it moved to, not acquired.
            control.watch([pid])
            assert control.create_time(pid) is None
            assert control.send(pid, sig) is SignalResult.GONE
            assert state(pid) == "S"
            # Back where it was attributed and attributed afresh: acquired and signalled.
            tree.move(pid, f"{tree.name}/pod/container")
            control.watch([pid])
            assert control.send(pid, signal.SIGSTOP) is SignalResult.SENT
            assert state(pid) == "T"
            assert control.send(pid, signal.SIGCONT) is SignalResult.SENT
        finally:
            control.close()


def test_a_process_that_stayed_is_signalled(tmp_path: Path) -> None:
    with subtree(2) as tree:
        pid = tree.spawn(f"{tree.name}/pod/container")
        control = PsutilControl()
        try:
            control.watch([pid])
            assert control.send(pid, signal.SIGSTOP) is SignalResult.SENT
            assert state(pid) == "T"
            assert control.send(pid, signal.SIGCONT) is SignalResult.SENT
            assert state(pid) == "S"
        finally:
            control.close()


def test_judged_by_its_pod_container_a_move_inside_it_is_no_move() -> None:
    """As the daemon wires it: where a process is means its pod container's cgroup, so one that
    moved into a cgroup of its own container's is still held to its limits, and one that left
    the container is not signalled."""
    with subtree(2) as tree:
        container = f"{tree.name}/kubepods/besteffort/pod{POD_UID}/{cid('main')}"
        inside = tree.spawn(container)
        leaving = tree.spawn(container)
        resolver = AllocationResolver(
            Path("/proc"),
            tree=KubeletTree(CgroupLayout("cgroupfs", tree.name)),
            container_logs=None,
        )
        control = PsutilControl(where=resolver.container_now)
        try:
            control.watch([inside, leaving])
            tree.move(inside, f"{container}/worker")
            tree.move(leaving, f"{tree.name}/elsewhere")
            assert control.send(inside, signal.SIGSTOP) is SignalResult.SENT
            assert state(inside) == "T"
            assert control.send(inside, signal.SIGCONT) is SignalResult.SENT
            assert control.send(leaving, signal.SIGSTOP) is SignalResult.MOVED
            assert state(leaving) == "S"
        finally:
            control.close()
