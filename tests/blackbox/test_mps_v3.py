"""MPS v3, against the stand-in for nvidia-cuda-mps-control (tests/support/fake_mps_control.py):
the daemon detects the protocol, runs the control daemon with `-p 3 -m`, a server per GPU with
its default namespace capped low, and a namespace per container capped at the container's share
and memory, whose pipe directory is all the container is given; namespaces outlive a restart of
the control daemon, are deleted once their container is gone (not while a client is attached),
and those nobody claims after a take-over are pruned. Every process signalled is the test's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.gpu.mps import (
    V2,
    V3,
    MpsNamespaceError,
    MpsOptions,
    NamespaceTiming,
    detect_protocol,
)
from deviceplugin.gpu.mps.protocol import server_name
from tests.support.fake_mps.harness import events, records
from tests.support.fake_mps.supervised import (
    DEFAULTS,
    GPU_A,
    GPU_B,
    Supervisors,
    limits,
    supervisors,
)

V3_OPTIONS = MpsOptions(protocol=V3)


@pytest.fixture
def made(short_tmp: Path) -> Iterator[Supervisors]:
    with supervisors(short_tmp / "mps") as made:
        yield made


def commands(root: Path) -> list[str]:
    return [r["command"] for r in records(root) if r["event"] == "command"]


def test_protocol_3_where_the_control_command_offers_it(made: Supervisors) -> None:
    daemon = made.make()
    assert detect_protocol(daemon.runner, "615.71.09").protocol == V3
    assert detect_protocol(daemon.runner, None).protocol == V3
    older = detect_protocol(daemon.runner, "595.91.07")
    assert older.protocol == V2
    assert "older than R615" in older.reason
    made.root.mkdir(parents=True, exist_ok=True)
    (made.root / "fake-v2-only").touch()
    assert detect_protocol(daemon.runner, "615.71.09").protocol == V2


def test_v3_runs_a_server_per_gpu_with_its_default_namespace_capped_low(
    made: Supervisors,
) -> None:
    daemon = made.make(V3_OPTIONS)
    daemon.start(DEFAULTS)
    started = events(made.root, "started")
    assert started[0]["argv"] == ["-p", "3", "-m", "-f"]
    assert started[0]["protocol"] == 3
    assert daemon.status.up
    assert daemon.status.protocol == 3
    a, b = server_name(GPU_A), server_name(GPU_B)
    assert commands(made.root) == [
        f"server create {a} --allowed-devices={GPU_A}",
        f"server set {a} --active-thread-percentage=10 --pinned-memory-limit=20480M",
        f"server create {b} --allowed-devices={GPU_B}",
        f"server set {b} --active-thread-percentage=10 --pinned-memory-limit=6144M",
    ]
    # A client of a server's default namespace is held to the low caps.
    client = made.client(daemon.pipe_directory / a, work=False)
    assert client.limits() == {"threads": "10", "memory": "20480M"}


def test_a_namespace_per_container_holds_its_share_and_memory(made: Supervisors) -> None:
    daemon = made.make(V3_OPTIONS)
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    assert ns.server == server_name(GPU_A)
    assert (ns.active_thread_percentage, ns.pinned_memory_mib) == (50, 40 * 1024)
    assert Path(ns.pipe_directory).parent == daemon.pipe_directory / ns.server
    assert (Path(ns.pipe_directory) / "control").is_socket()
    # Every process of the container shares the cap; a higher one asked for is not given.
    one = made.client(ns.pipe_directory, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    two = made.client(ns.pipe_directory)
    assert one.limits() == two.limits() == {"threads": "50", "memory": "40960M"}
    # A neighbour on the same GPU has caps of its own.
    other = daemon.provision("alloc-2", [limits(GPU_A, 25, 20)])
    assert made.client(other.pipe_directory).limits()["threads"] == "25"
    assert daemon.provision("alloc-1", [limits(GPU_A, 50, 40)]) == ns  # idempotent
    assert [n.owner for n in daemon.status.namespaces] == ["alloc-1", "alloc-2"]
    # Its caps cannot change while its clients are attached.
    with pytest.raises(MpsNamespaceError, match="restart the container"):
        daemon.provision("alloc-1", [limits(GPU_A, 100, 80)])


def test_a_container_on_two_gpus_gets_the_all_server_at_its_smallest_caps(
    made: Supervisors,
) -> None:
    daemon = made.make(V3_OPTIONS)
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40), limits(GPU_B, 25, 6)])
    assert ns.server == "all"
    assert (ns.active_thread_percentage, ns.pinned_memory_mib) == (25, 6 * 1024)
    assert f"server create all --allowed-devices={GPU_A},{GPU_B}" in commands(made.root)
    assert made.client(ns.pipe_directory).limits() == {"threads": "25", "memory": "6144M"}


def test_a_pipe_path_too_long_for_a_socket_is_refused_clearly(short_tmp: Path) -> None:
    root = short_tmp / ("r" * 60) / "mps"
    with supervisors(root) as made:
        daemon = made.make(V3_OPTIONS)
        daemon.start(DEFAULTS)
        with pytest.raises(MpsNamespaceError, match="107 bytes"):
            daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])


def test_under_v2_there_are_no_namespaces(made: Supervisors) -> None:
    daemon = made.make()
    daemon.start(DEFAULTS)
    with pytest.raises(MpsNamespaceError, match="v2"):
        daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    daemon.release("alloc-1")  # nothing to do
    assert not any(c.startswith(("server", "namespace")) for c in commands(made.root))


def test_release_waits_until_no_client_is_attached(made: Supervisors) -> None:
    daemon = made.make(MpsOptions(protocol=V3, namespaces=NamespaceTiming(retry_s=0.0)))
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    client = made.client(ns.pipe_directory, work=False)
    daemon.release("alloc-1")
    assert Path(ns.pipe_directory).is_dir()
    assert daemon.status.namespaces == ()
    daemon.supervise_once(DEFAULTS)
    assert Path(ns.pipe_directory).is_dir()
    client.kill()  # no work in flight: nothing wedged
    deadline = time.monotonic() + 10
    while Path(ns.pipe_directory).exists() and time.monotonic() < deadline:
        daemon.supervise_once(DEFAULTS)
    assert not Path(ns.pipe_directory).exists()


def test_a_restarted_control_daemon_gets_its_servers_and_namespaces_again(
    made: Supervisors,
) -> None:
    daemon = made.make(V3_OPTIONS)
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    first = daemon.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)  # a crash (the test's supervisor's own child)
    deadline = time.monotonic() + 10
    while daemon.status.restarts_total == 0 and time.monotonic() < deadline:
        daemon.supervise_once(DEFAULTS)
    assert daemon.status.up
    assert daemon.pid() not in (None, first)
    # The same directory (a running container's mount still reaches it), the same caps.
    assert made.client(ns.pipe_directory).limits()["threads"] == "50"


def test_after_a_take_over_unclaimed_namespaces_are_pruned_and_claimed_ones_kept(
    made: Supervisors,
) -> None:
    timing = NamespaceTiming(orphan_grace_s=0.3, retry_s=0.0)
    earlier = made.make(MpsOptions(protocol=V3, namespaces=timing))
    earlier.start(DEFAULTS)
    kept = earlier.provision("alloc-kept", [limits(GPU_A, 50, 40)])
    gone = earlier.provision("alloc-gone", [limits(GPU_A, 25, 20)])
    client = made.client(kept.pipe_directory)
    # A new run of the daemon (the earlier one killed outright) takes the control daemon over.
    later = made.make(MpsOptions(protocol=V3, namespaces=timing))
    later.start(DEFAULTS)
    assert later.pid() == earlier.pid()
    # The live container's namespace is provisioned again: adopted, its client untouched.
    assert later.provision("alloc-kept", [limits(GPU_A, 50, 40)]) == kept
    time.sleep(0.3)
    later.supervise_once(DEFAULTS)
    assert not Path(gone.pipe_directory).exists()
    assert Path(kept.pipe_directory).is_dir()
    assert client.process.poll() is None
    assert events(made.root, "client-lost") == []


def test_a_control_daemon_of_the_other_protocol_is_replaced(made: Supervisors) -> None:
    v2 = made.make()
    v2.start(DEFAULTS)
    old = v2.pid()
    v3 = made.make(V3_OPTIONS)
    v3.start(DEFAULTS)
    assert v3.pid() not in (None, old)
    assert events(made.root, "started")[-1]["protocol"] == 3


def test_a_namespace_deleted_behind_the_daemons_back_is_made_again(made: Supervisors) -> None:
    timing = NamespaceTiming(verify_interval_s=0.0)
    daemon = made.make(MpsOptions(protocol=V3, namespaces=timing))
    daemon.start(DEFAULTS)
    ns = daemon.provision("alloc-1", [limits(GPU_A, 50, 40)])
    daemon.send(f"namespace delete {ns.name} --server={ns.server}")  # as a root pod could
    daemon.supervise_once(DEFAULTS)
    assert dict(daemon.status.drift_total) == {"namespace": 1}
    assert made.client(ns.pipe_directory).limits()["threads"] == "50"
