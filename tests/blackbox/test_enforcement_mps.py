"""The enforcer never SIGKILLs an MPS client that has not been terminated through the control
daemon, on every path where it stops one: a memory kill, a kill of a client it holds stopped
(throttled), and the daemon's shutdown, which only resumes. The enforcer is given the MPS
supervisor's `stop_client` as its way to stop a process for good, as the composition root does
with MPS on; the clients are the fake control command's (tests/support/fake_mps_control.py),
whose record says, for each client that went away, whether it was terminated first and whether
that wedged its GPU. Every process signalled here is one the test spawned."""

from __future__ import annotations

import ast
import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import deviceplugin.enforcer
from deviceplugin.allocation import DeviceLimits, MpsDefaults
from deviceplugin.enforcer import Enforcer, PsutilControl, RecordingControl
from deviceplugin.gpu.mps import V3, MpsControlDaemon, MpsOptions
from tests.blackbox.test_enforcement import (
    GPU,
    A,
    hand_snapshot,
    is_stopped,
    strict_config,
    wait_until,
)
from tests.support.fake_mps.client import FakeClient
from tests.support.fake_mps.harness import events, eventually_events, records
from tests.support.fake_mps.supervised import Supervisors, supervisors

# The GPU of tests/blackbox/test_enforcement.py's snapshots: 80 GiB in four slices.
DEFAULTS = MpsDefaults(pinned_mem_limit_mib=((GPU, 20 * 1024),), active_thread_percentage=25)
CONTAINER_A = DeviceLimits(GPU, 20 << 30, 20 << 30, 25, 80 << 30)


@pytest.fixture
def made(short_tmp: Path) -> Iterator[Supervisors]:
    with supervisors(short_tmp / "mps") as made:
        yield made


@pytest.fixture
def enforcers() -> Iterator[list[Enforcer]]:
    started: list[Enforcer] = []
    yield started
    for enforcer in started:
        enforcer.close()


def mps_client(made: Supervisors, protocol: int = V3) -> tuple[MpsControlDaemon, FakeClient]:
    """A supervised control daemon and one client with work in flight, of container A."""
    daemon = made.make(MpsOptions(protocol=protocol, drain_timeout_s=5.0))
    daemon.start(DEFAULTS)
    if protocol == V3:
        pipe = daemon.provision(A, [CONTAINER_A]).pipe_directory
    else:
        pipe = str(daemon.pipe_directory)
    return daemon, made.client(pipe)


def enforcer_for(
    tmp_path: Path, daemon: MpsControlDaemon, enforcers: list[Enforcer], *, grace_s: float = 0
) -> Enforcer:
    enforcer = Enforcer(
        strict_config(grace_s=grace_s),
        tmp_path / "state",
        control=PsutilControl(),
        stop_process=daemon.stop_client,
    )
    enforcers.append(enforcer)
    return enforcer


def terminated_before_its_end(root: Path, pid: int) -> bool:
    """The fake saw `pid` terminated through the control daemon before its connection closed,
    and its end wedged nothing."""
    lost = [e for e in eventually_events(root, "client-lost") if e["client"] == pid]
    return len(lost) == 1 and lost[0]["terminated"] is True and lost[0]["wedged"] is False


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_memory_kill_of_an_mps_client_is_drained_first(
    made: Supervisors, tmp_path: Path, enforcers: list[Enforcer], protocol: int
) -> None:
    daemon, client = mps_client(made, protocol)
    enforcer = enforcer_for(tmp_path, daemon, enforcers)
    enforcer.on_snapshot(hand_snapshot([client.pid], util=0.0, memory_gib=30))
    assert client.process.wait(timeout=10) == -signal.SIGKILL
    assert terminated_before_its_end(made.root, client.pid)
    assert daemon.status.drains_total == 1


def test_a_throttled_client_is_resumed_then_drained_then_killed(
    made: Supervisors, tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    daemon, client = mps_client(made)
    enforcer = enforcer_for(tmp_path, daemon, enforcers)
    enforcer.on_snapshot(hand_snapshot([client.pid], util=100.0, memory_gib=1))
    assert wait_until(lambda: is_stopped(client.pid), 5.0)  # throttled: SIGSTOPped
    enforcer.on_snapshot(hand_snapshot([client.pid], util=100.0, memory_gib=30))
    assert client.process.wait(timeout=10) == -signal.SIGKILL
    # The terminate found it running (the fake's terminate waits while a client is stopped).
    (terminate,) = [e for e in events(made.root, "terminate") if e["client"] == client.pid]
    assert terminate["stopped"] is False
    assert terminated_before_its_end(made.root, client.pid)


def test_shutdown_resumes_throttled_clients_and_kills_none(
    made: Supervisors, tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    daemon, client = mps_client(made)
    enforcer = enforcer_for(tmp_path, daemon, enforcers)
    enforcer.on_snapshot(hand_snapshot([client.pid], util=100.0, memory_gib=1))
    assert wait_until(lambda: is_stopped(client.pid), 5.0)
    enforcer.close()
    assert not is_stopped(client.pid)
    assert client.process.poll() is None
    assert events(made.root, "client-lost") == []
    assert events(made.root, "terminate") == []


def test_a_dry_run_drains_nothing(
    made: Supervisors, tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    daemon, client = mps_client(made)
    control = RecordingControl()
    enforcer = Enforcer(
        strict_config(grace_s=0), tmp_path, control=control, stop_process=daemon.stop_client
    )
    enforcers.append(enforcer)
    enforcer.on_snapshot(hand_snapshot([client.pid], util=0.0, memory_gib=30))
    assert (client.pid, signal.SIGKILL) in control.sent
    assert client.process.poll() is None
    assert not any("terminate" in str(r.get("command")) for r in records(made.root))


def signals_named(path: Path, names: frozenset[str]) -> set[str]:
    """Where in module `path` a signal of `names` is named: the enclosing class and function
    names, dotted (`<module>` at the top level)."""
    found: set[str] = set()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            scope = (*scope, node.name)
        named = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if named in names:
            found.add(".".join(scope) or "<module>")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(path.read_text()), ())
    return found


def test_the_enforcer_stops_a_process_for_good_in_one_place() -> None:
    # Every SIGKILL or SIGTERM the enforcer sends comes from `Enforcer._kill`, which hands it to
    # its `stop_process` (with MPS: after a drain, the process resumed first); the signal
    # mechanism (control.py) only lists SIGKILL among the signals it checks the target before.
    # A new way to stop a process for good (a reclaim of memory) goes through `_kill` too, or
    # this fails.
    package = Path(deviceplugin.enforcer.__file__).parent
    where = {
        f"{path.name}:{scope}"
        for path in sorted(package.glob("*.py"))
        for scope in signals_named(path, frozenset({"SIGKILL", "SIGTERM"}))
    }
    assert where == {"enforcer.py:Enforcer._kill.kill", "control.py:<module>"}


def test_a_reclaim_under_pressure_of_an_mps_client_is_drained_first(
    made: Supervisors, tmp_path: Path, enforcers: list[Enforcer]
) -> None:
    """Memory reclaimed under pressure takes the same stop path as a memory kill: container A
    (request 10 GiB, limit 20 GiB) uses 15 GiB, within its limit, while the GPU has half a GiB
    free; its client is terminated through the control daemon, then killed."""
    daemon, client = mps_client(made)
    enforcer = enforcer_for(tmp_path, daemon, enforcers)
    snapshot = hand_snapshot([client.pid], util=0.0, memory_gib=15)
    (gpu,) = snapshot.gpus
    (container,) = snapshot.containers
    pressured = dataclasses.replace(
        snapshot,
        gpus=(
            dataclasses.replace(
                gpu, reading=dataclasses.replace(gpu.reading, memory_used_bytes=int(79.5 * 2**30))
            ),
        ),
        containers=(dataclasses.replace(container, memory_request_bytes=10 * 2**30),),
    )
    enforcer.on_snapshot(pressured)
    assert client.process.wait(timeout=10) == -signal.SIGKILL
    assert terminated_before_its_end(made.root, client.pid)
    assert daemon.status.drains_total == 1
    counts = {(c.kind, c.action): c.count for c in enforcer.counts()}
    assert counts[("memory", "reclaim")] == 1
