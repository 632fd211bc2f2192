"""The drain before an MPS client is stopped, and the wedge it guards against, on the stand-in for
nvidia-cuda-mps-control (tests/support/fake_mps_control.py), whose clients model the hazard: one
killed with work in flight and not terminated first wedges its GPU until MPS restarts.

`stop_client` terminates a client through the control daemon (v2 `terminate_client`, v3 `client
terminate`) and only then kills it; a terminate that hangs is a wedge, and MPS is restarted,
configured as before, before the kill. A canary through each server's pipe directory finds the
wedge that a client killed by someone else (the kubelet) left, and MPS is restarted. Every
process signalled here is one the test spawned."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.gpu.mps import V3, DrainOutcome, MpsOptions
from tests.support.fake_mps.client import FAKE_CONTROL
from tests.support.fake_mps.harness import eventually_events, records
from tests.support.fake_mps.supervised import (
    DEFAULTS,
    GPU_A,
    Supervisors,
    limits,
    supervisors,
)

CANARY = (str(FAKE_CONTROL), "canary")


@pytest.fixture
def made(short_tmp: Path) -> Iterator[Supervisors]:
    with supervisors(short_tmp / "mps") as made:
        yield made


def killer(pid: int, seen: list[int]) -> object:
    """The kill a stop sends, noting that it was sent."""

    def kill() -> str:
        seen.append(pid)
        os.kill(pid, signal.SIGKILL)
        return "sent"

    return kill


def lost(root: Path) -> list[dict[str, object]]:
    return eventually_events(root, "client-lost")


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_client_is_terminated_through_the_control_daemon_before_its_kill(
    made: Supervisors, protocol: int
) -> None:
    daemon = made.make(MpsOptions(protocol=protocol))
    daemon.start(DEFAULTS)
    pipe = (
        daemon.provision("alloc-1", [limits(GPU_A, 50, 40)]).pipe_directory
        if protocol == V3
        else daemon.pipe_directory
    )
    client = made.client(pipe)
    killed: list[int] = []
    assert daemon.stop_client(client.pid, killer(client.pid, killed)) == "sent"  # type: ignore[arg-type]
    client.process.wait()
    assert killed == [client.pid]
    terminate = "client terminate" if protocol == V3 else "terminate_client"
    commands = [r["command"] for r in records(made.root) if r["event"] == "command"]
    assert any(c.startswith(terminate) and c.endswith(str(client.pid)) for c in commands)
    # The fake saw it terminated before the connection closed: nothing wedged.
    assert [(e["client"], e["terminated"], e["wedged"]) for e in lost(made.root)] == [
        (client.pid, True, False)
    ]
    assert made.client(pipe, work=False).attached
    assert (daemon.status.drains_total, daemon.status.wedges_total) == (1, 0)


def test_a_process_that_is_no_mps_client_is_killed_without_a_terminate(
    made: Supervisors,
) -> None:
    daemon = made.make(MpsOptions(protocol=V3))
    daemon.start(DEFAULTS)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert daemon.drain(sleeper.pid).outcome is DrainOutcome.NOT_A_CLIENT
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not any("terminate" in str(r.get("command")) for r in records(made.root))
    assert daemon.status.drains_total == 0


def test_a_terminate_that_hangs_is_a_wedge_and_mps_restarts_before_the_kill(
    made: Supervisors, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = made.make(MpsOptions(protocol=V3, drain_timeout_s=0.5))
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    first = daemon.pid()
    victim = made.client(ns.pipe_directory)
    (made.root / "fake-terminate-hangs").touch()
    restarts_at_kill: list[int] = []

    def kill() -> str:
        restarts_at_kill.append(daemon.status.restarts_total)
        os.kill(victim.pid, signal.SIGKILL)
        return "sent"

    daemon.stop_client(victim.pid, kill)
    (made.root / "fake-terminate-hangs").unlink()
    assert restarts_at_kill == [1]  # MPS was restarted before the kill
    status = daemon.status
    assert (status.wedges_total, status.restarts_total, status.up) == (1, 1, True)
    assert daemon.pid() not in (None, first)
    assert "MPS is wedged; restarting it" in caplog.text
    # Configured as before: the namespace holds its caps on the new control daemon.
    assert made.client(ns.pipe_directory).limits()["threads"] == "50"


def test_with_the_control_daemon_down_the_stop_is_counted_as_undrained(
    made: Supervisors,
) -> None:
    daemon = made.make(MpsOptions(protocol=V3))
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    client = made.client(ns.pipe_directory, work=False)
    control = daemon.pid()
    assert control is not None
    os.kill(control, signal.SIGKILL)  # the test's supervisor's own child
    killed: list[int] = []
    daemon.stop_client(client.pid, killer(client.pid, killed))  # type: ignore[arg-type]
    assert killed == [client.pid]
    assert (daemon.status.undrained_total, daemon.status.drains_total) == (1, 0)


def test_a_client_killed_by_someone_else_wedges_and_the_canary_restarts_mps(
    made: Supervisors,
) -> None:
    options = MpsOptions(protocol=V3, canary=CANARY, canary_timeout_s=1.0, canary_interval_s=0)
    daemon = made.make(options)
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    victim = made.client(ns.pipe_directory)
    daemon.supervise_once(DEFAULTS)  # sees the client
    victim.process.kill()  # the kubelet's SIGKILL at pod deletion: no drain
    victim.process.wait()
    assert lost(made.root)[0]["wedged"] is True  # the fake has seen it go
    daemon.supervise_once(DEFAULTS)
    status = daemon.status
    assert (status.wedges_total, status.restarts_total, status.up) == (1, 1, True)
    assert made.client(ns.pipe_directory).attached


def test_a_canary_that_fails_without_hanging_restarts_nothing(made: Supervisors) -> None:
    daemon = made.make(MpsOptions(protocol=V3, canary=("false",), canary_interval_s=60))
    daemon.start(DEFAULTS)
    daemon.supervise_once(DEFAULTS)
    status = daemon.status
    assert "exited with 1" in status.canary_error
    assert (status.wedges_total, status.restarts_total) == (0, 0)
