"""The stand-in for nvidia-cuda-mps-control models MPS v3 as the daemon's MPS code relies on it
(tests/support/fake_mps_control.py): named servers and namespaces with their pipe directories, a
cap that no client can raise and that cannot change once a client is attached, terminate, and
the hazard that the drain exists for: a client killed with work in flight wedges its GPU until
the control daemon starts again. Every process signalled here is one the test spawned."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_mps.client import FAKE_CONTROL, FakeClient
from tests.support.fake_mps.harness import (
    FakeControlDaemon,
    events,
    eventually_events,
    fake_env,
)


@pytest.fixture
def fake(short_tmp: Path) -> Iterator[FakeControlDaemon]:
    daemon = FakeControlDaemon(short_tmp / "mps")
    yield daemon
    daemon.stop()


@pytest.fixture
def clients() -> Iterator[list[FakeClient]]:
    started: list[FakeClient] = []
    yield started
    for client in started:
        client.kill()


def namespace(fake: FakeControlDaemon, name: str = "c1", threads: int = 25) -> Path:
    fake.ok("server create gpu0 --allowed-devices=GPU-0", f"namespace create {name} --server=gpu0")
    fake.ok(f"namespace set {name} --server=gpu0 --active-thread-percentage={threads}")
    return Path(fake.ok(f"namespace get {name} --server=gpu0 pipe-directory"))


def test_a_namespace_has_its_own_pipe_directory_and_cap(
    fake: FakeControlDaemon, clients: list[FakeClient]
) -> None:
    directory = namespace(fake)
    assert directory == fake.pipe / "gpu0" / "c1"
    assert (directory / "control").is_socket()
    # A client exporting a higher cap is still held to the namespace's; a lower one holds.
    higher = FakeClient(directory, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    lower = FakeClient(directory, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"})
    clients += [higher, lower]
    assert higher.limits()["threads"] == "25"
    assert lower.limits()["threads"] == "10"
    assert fake.ok("client list --all").split() == sorted([str(higher.pid), str(lower.pid)])
    assert fake.ok(f"client get {higher.pid} namespace") == "c1"


def test_set_and_delete_are_refused_while_a_client_is_attached(
    fake: FakeControlDaemon, clients: list[FakeClient]
) -> None:
    directory = namespace(fake)
    clients.append(FakeClient(directory))
    refused = fake.run("namespace set c1 --server=gpu0 --active-thread-percentage=100")
    assert refused.returncode == 1
    assert "clients are attached" in refused.stderr
    assert fake.run("namespace delete c1 --server=gpu0").returncode == 1
    # --force terminates the client first: deleted, and nothing wedged.
    fake.ok("namespace delete c1 --server=gpu0 --force")
    assert not directory.exists()
    assert fake.ok("namespace list --server=gpu0") == ""
    assert [e["client"] for e in events(fake.root, "client-lost")] == []


def test_a_client_killed_with_work_in_flight_wedges_the_gpu_until_a_restart(
    fake: FakeControlDaemon, clients: list[FakeClient], short_tmp: Path
) -> None:
    directory = namespace(fake)
    victim = FakeClient(directory)
    clients.append(victim)
    victim.process.kill()
    victim.process.wait()
    lost = eventually_events(fake.root, "client-lost")
    # The canary now hangs in its attach, as a CUDA init does on a wedged GPU.
    canary = subprocess.Popen(
        [str(FAKE_CONTROL), "canary"],
        env=fake_env(fake.root, CUDA_MPS_PIPE_DIRECTORY=str(directory)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert eventually_events(fake.root, "attach-hangs")[0]["client"] == canary.pid
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    assert lost == [{**lost[0], "client": victim.pid, "terminated": False, "work_in_flight": True}]
    # A new control daemon knows nothing of it.
    fake.stop()
    again = FakeControlDaemon(fake.root)
    try:
        directory = namespace(again)
        passed = subprocess.run(
            [str(FAKE_CONTROL), "canary"],
            env=fake_env(again.root, CUDA_MPS_PIPE_DIRECTORY=str(directory)),
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert passed.returncode == 0
    finally:
        again.stop()


def test_terminate_drains_so_that_the_kill_wedges_nothing(
    fake: FakeControlDaemon, clients: list[FakeClient]
) -> None:
    directory = namespace(fake)
    client = FakeClient(directory)
    clients.append(client)
    fake.ok(f"client terminate {client.pid}")
    assert client.line() == "terminated"
    client.process.kill()
    client.process.wait()
    after = FakeClient(directory, work=False)
    clients.append(after)
    assert after.attached
    assert eventually_events(fake.root, "client-lost")[0]["terminated"] is True


def test_terminate_waits_for_a_stopped_client_and_can_be_made_to_hang(
    fake: FakeControlDaemon, clients: list[FakeClient]
) -> None:
    directory = namespace(fake)
    client = FakeClient(directory)
    clients.append(client)
    os.kill(client.pid, signal.SIGSTOP)
    waiting = fake.start(f"client terminate {client.pid}")
    try:
        (terminate,) = eventually_events(fake.root, "terminate")
        assert (terminate["client"], terminate["stopped"]) == (client.pid, True)
        assert waiting.poll() is None  # it cannot take the terminate while stopped
        os.kill(client.pid, signal.SIGCONT)
        assert waiting.wait(timeout=10) == 0
        assert client.line() == "terminated"
        # Made to hang: the run never returns (a wedged GPU).
        (fake.root / "fake-terminate-hangs").touch()
        other = FakeClient(directory)
        clients.append(other)
        hanging = fake.start(f"client terminate {other.pid}")
        try:
            assert eventually_events(fake.root, "terminate-hangs")[0]["client"] == other.pid
            assert hanging.poll() is None
        finally:
            hanging.kill()
            hanging.wait()
    finally:
        waiting.kill()
        waiting.wait()


def test_v2_clients_and_terminate_client(short_tmp: Path, clients: list[FakeClient]) -> None:
    fake = FakeControlDaemon(short_tmp / "mps", protocol=2)
    try:
        assert fake.ok("get_server_list") == ""
        client = FakeClient(fake.pipe)
        clients.append(client)
        server = fake.ok("get_server_list")
        assert fake.ok(f"get_client_list {server}") == str(client.pid)
        fake.ok(f"terminate_client {server} {client.pid}")
        # v3's commands are not v2's.
        assert "Unrecognized" in fake.ok("server create gpu0")
    finally:
        fake.stop()


def test_an_older_driver_refuses_protocol_3(short_tmp: Path) -> None:
    root = short_tmp / "mps"
    (root / "pipe").mkdir(parents=True)
    env = fake_env(root)
    helped = subprocess.run(
        [str(FAKE_CONTROL), "-p", "3", "-h"], env=env, capture_output=True, text=True, check=False
    )
    assert helped.returncode == 0
    assert "namespace" in helped.stdout
    (root / "fake-v2-only").touch()
    refused = subprocess.run(
        [str(FAKE_CONTROL), "-p", "3", "-h"], env=env, capture_output=True, text=True, check=False
    )
    assert refused.returncode != 0
