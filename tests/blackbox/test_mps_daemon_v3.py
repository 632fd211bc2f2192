"""MPS v3 through the whole daemon, on the fake control command (tests/support/fake_mps_control.py,
which offers protocol 3): Allocate makes each container's namespace before it answers, capped
at the container's share and memory; only that namespace's directory is mounted; it is deleted
once the pod has gone, made again for running containers after a restart or a reload; and every
way the daemon stops an MPS client drains it through the control daemon first (the fake's record
says whether a client was terminated before its end and whether its end wedged the GPU). The
kubelet's own kill (pod deletion) is seen afterwards by the canary, which restarts MPS.

Every process signalled here is one the test spawned (fake clients, killed at the end)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.app import Daemon
from deviceplugin.config import (
    ComputeAction,
    ComputeEnforcement,
    Config,
    EnforcementConfig,
    MemoryAction,
    MemoryEnforcement,
    MpsConfig,
    MpsProtocol,
)
from deviceplugin.errors import StartupError
from deviceplugin.gpu.fake import FakeBackend, FakeProcess
from deviceplugin.gpu.mps import MpsControlDaemon
from deviceplugin.sim.kubelet import ContainerGrant
from tests.blackbox.daemon_harness import (
    TWO_GPUS,
    GiB,
    Node,
    eventually,
    registered,
    running_daemon,
    with_processes,
)
from tests.blackbox.test_mps import get, mps_root, no_stray_control_daemon  # noqa: F401
from tests.support.fake_mps.client import FAKE_CONTROL, FakeClient
from tests.support.fake_mps.harness import (
    events,
    eventually_events,
    namespace_caps,
    records,
)
from tests.support.fake_mps.harness import namespaces as fake_namespaces

# The fake's canary: hangs on a wedged GPU, as a CUDA init does.
CANARY = f"{sys.executable} {FAKE_CONTROL} canary"
A100, L4 = TWO_GPUS  # 80 GiB and 24 GiB, four slices each


def v3_config(node: Node, *, memory_grace_s: float = 0.2, work_conserving: bool = True) -> Config:
    return Config(
        enforcement=EnforcementConfig(
            poll_interval_s=0.05,
            idle_poll_interval_s=0.05,
            memory=MemoryEnforcement(action=MemoryAction.KILL, grace_period_s=memory_grace_s),
            compute=ComputeEnforcement(
                action=ComputeAction.THROTTLE,
                window_s=1.0,
                period_s=0.2,
                work_conserving=work_conserving,
            ),
        ),
        mps=MpsConfig(
            enabled=True,
            root=str(mps_root(node)),
            control_command=str(FAKE_CONTROL),
            canary_command=CANARY,
        ),
    )


@pytest.fixture
def clients() -> Iterator[list[FakeClient]]:
    made: list[FakeClient] = []
    yield made
    for client in made:
        client.kill()


def caps(node: Node, pipe_directory: str) -> dict[str, str]:
    """What the control daemon says of the namespace whose directory is `pipe_directory`."""
    return namespace_caps(mps_root(node), pipe_directory)


def namespaces(node: Node) -> set[str]:
    """Every `<server>/<namespace>` the control daemon has."""
    return fake_namespaces(mps_root(node))


def mps_of(daemon: Daemon) -> MpsControlDaemon:
    assert daemon.mps is not None, "MPS is not running"
    return daemon.mps


def fast(daemon: Daemon, *, canary_timeout_s: float = 2.0) -> MpsControlDaemon:
    """The daemon's MPS supervision every 50 ms, its canary bounded by `canary_timeout_s`."""
    mps = mps_of(daemon)
    mps.check_interval_s = 0.05
    mps.options = dataclasses.replace(mps.options, canary_timeout_s=canary_timeout_s)
    return mps


def client_of(grant: ContainerGrant, clients: list[FakeClient]) -> FakeClient:
    """A fake MPS client of the container: its environment, so the daemon attributes it."""
    client = FakeClient(grant.envs["CUDA_MPS_PIPE_DIRECTORY"], env=grant.envs)
    clients.append(client)
    assert client.attached, client.answer
    return client


def using(node: Node, gpu_uuid: str, *processes: FakeProcess) -> None:
    """The fake GPUs, `processes` on GPU `gpu_uuid`."""
    node.write_gpus([with_processes(g, *processes) if g.uuid == gpu_uuid else g for g in TWO_GPUS])


def terminated_before_its_end(node: Node, pid: int) -> bool:
    lost = [e for e in eventually_events(mps_root(node), "client-lost") if e["client"] == pid]
    return len(lost) == 1 and lost[0]["terminated"] is True and lost[0]["wedged"] is False


async def status_of(daemon: Daemon) -> dict[str, Any]:
    assert daemon.http is not None
    _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{daemon.http.port}/status")
    doc: dict[str, Any] = json.loads(body)
    return doc


# --- namespaces per container ---------------------------------------------------------------


async def test_each_container_gets_its_own_namespace_capped_at_its_share_and_memory(
    node: Node,
) -> None:
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        assert mps_of(daemon).protocol == 3
        two = (await node.sim.admit_pod("two", [("c", 2)])).containers[0]
        one = (await node.sim.admit_pod("one", [("c", 1)])).containers[0]
        pipe = str(mps_root(node) / "pipe")
        dirs = [g.envs["CUDA_MPS_PIPE_DIRECTORY"] for g in (two, one)]
        assert len(set(dirs)) == 2
        for grant, directory in zip((two, one), dirs, strict=True):
            assert directory.startswith(pipe + "/")
            # Only the namespace's directory, read-only at the same path, and the shared memory.
            assert (directory, directory, True) in grant.mounts
            assert all(host != pipe for _, host, _ in grant.mounts)
            assert ("/dev/shm", str(mps_root(node) / "shm"), False) in grant.mounts
            # The namespace holds the memory; a per-client limit could only undo it.
            assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in grant.envs
        # Two slices of the A100: 50 % and 40 GiB, shared by every process of the container.
        assert caps(node, dirs[0])["active-thread-percentage"] == "50"
        assert caps(node, dirs[0])["pinned-memory-limit"] in ("40960M", "40G")
        assert caps(node, dirs[1])["active-thread-percentage"] == "25"
        # A framework may reserve the container's memory, not one slice's: (40Gi - 512Mi)/80Gi.
        assert two.envs["VGPU_MEMORY_FRACTION_0"] == "0.49"

        # /status is the last poll's: both namespaces once a poll has come after them.
        for _ in range(250):
            mps = (await status_of(daemon))["health"]["mps"]
            if len(mps["namespaces"]) == 2:
                break
            await asyncio.sleep(0.04)
        assert mps["protocol"] == 3
        assert {ns["pipe_directory"] for ns in mps["namespaces"]} == set(dirs)


async def test_a_container_cannot_start_without_its_namespace(node: Node) -> None:
    async with running_daemon(node, v3_config(node)):
        await registered(node, 8)
        (mps_root(node) / "fake-fail-commands").touch()
        with pytest.raises(Exception, match="MPS namespace"):
            await node.sim.admit_pod("refused", [("c", 1)])
        (mps_root(node) / "fake-fail-commands").unlink()
        granted = await node.sim.admit_pod("later", [("c", 1)])
        assert "CUDA_MPS_PIPE_DIRECTORY" in granted.containers[0].envs


async def test_the_namespace_is_deleted_once_the_pod_is_gone(
    node: Node, clients: list[FakeClient]
) -> None:
    async with running_daemon(node, v3_config(node), pod_resources_interval_s=0.2) as daemon:
        await registered(node, 8)
        fast(daemon)
        daemon.mps_part.release_grace_s = 0.0
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
        directory = grant.envs["CUDA_MPS_PIPE_DIRECTORY"]
        held = "/".join(Path(directory).parts[-2:])
        client = FakeClient(directory, work=False, env=grant.envs)
        clients.append(client)
        assert held in namespaces(node)
        # The kubelet lists the pod (an allocation it never listed is kept a while longer).
        await eventually(lambda: any(r.pod == "p" for r in daemon.book), what="the pod listed")
        await node.sim.delete_pod("default", "p")
        # Its client is still attached (a container on its way out): the delete is retried ...
        await asyncio.sleep(1.0)
        assert held in namespaces(node)
        client.kill()
        # ... and done once none is.
        await eventually(lambda: held not in namespaces(node), 15, "the namespace deleted")
        assert mps_of(daemon).status.namespaces == ()


async def test_a_restarted_daemon_makes_the_namespaces_of_running_containers_again(
    node: Node,
) -> None:
    async with running_daemon(node, v3_config(node)):
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 3)])).containers[0]
        directory = grant.envs["CUDA_MPS_PIPE_DIRECTORY"]
    # The daemon's exit sent its control daemon quit: every namespace is gone with it.
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        await eventually(
            lambda: any(ns.pipe_directory == directory for ns in mps_of(daemon).status.namespaces),
            what="the running container's namespace made again",
        )
        assert caps(node, directory)["active-thread-percentage"] == "75"


async def test_a_reload_of_mps_settings_keeps_running_containers_namespaces(node: Node) -> None:
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 2)])).containers[0]
        directory = grant.envs["CUDA_MPS_PIPE_DIRECTORY"]
        first = mps_of(daemon).pid()
        config = v3_config(node)
        # Another MPS setting (the same protocol, asked for by name): MPS is started again.
        await daemon.apply_config(
            dataclasses.replace(
                config, mps=dataclasses.replace(config.mps, protocol=MpsProtocol.V3)
            )
        )
        await eventually(lambda: mps_of(daemon).pid() not in (None, first), what="a new MPS")
        await eventually(
            lambda: any(ns.pipe_directory == directory for ns in mps_of(daemon).status.namespaces),
            what="the namespace made again",
        )
        assert caps(node, directory)["active-thread-percentage"] == "50"


# --- protocol -------------------------------------------------------------------------------


async def test_without_protocol_3_the_daemon_runs_mps_v2(node: Node) -> None:
    mps_root(node).mkdir()
    (mps_root(node) / "fake-v2-only").touch()  # an older driver's control command
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        assert mps_of(daemon).protocol == 2
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
    assert grant.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(mps_root(node) / "pipe")
    starts = [r["argv"] for r in records(mps_root(node)) if r["event"] == "run" and r["argv"]]
    assert starts == [["-p", "3", "-h"], ["-f"]]


async def test_protocol_3_asked_for_where_it_is_not_offered_fails_the_start(node: Node) -> None:
    mps_root(node).mkdir()
    (mps_root(node) / "fake-v2-only").touch()
    config = v3_config(node)
    config = dataclasses.replace(
        config, mps=dataclasses.replace(config.mps, protocol=MpsProtocol.V3)
    )
    backend = FakeBackend(node.state_file)
    try:
        daemon = Daemon(node.settings(config), backend)
        with pytest.raises(StartupError, match=r"mps.protocol is v3, but MPS v3 is not offered"):
            await asyncio.wait_for(daemon.run(asyncio.Event()), 20)
    finally:
        backend.close()


# --- every stop of an MPS client is drained first -------------------------------------------


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_memory_kill_drains_the_client_through_the_control_daemon_first(
    node: Node, clients: list[FakeClient], protocol: int
) -> None:
    if protocol == 2:
        mps_root(node).mkdir()
        (mps_root(node) / "fake-v2-only").touch()  # an older driver: v2's terminate_client
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        assert fast(daemon).protocol == protocol
        grant = (await node.sim.admit_pod("hog", [("c", 1)])).containers[0]
        client = client_of(grant, clients)
        using(node, A100.uuid, FakeProcess(client.pid, 25 * GiB, 10))  # one slice: 20 GiB
        assert await asyncio.to_thread(client.process.wait, 15) == -signal.SIGKILL
        assert terminated_before_its_end(node, client.pid)
        await eventually(lambda: mps_of(daemon).status.drains_total == 1, what="the drain count")
        assert mps_of(daemon).status.wedges_total == 0


async def test_a_throttled_client_is_resumed_drained_then_killed(
    node: Node, clients: list[FakeClient]
) -> None:
    config = v3_config(node, memory_grace_s=0.2, work_conserving=False)
    async with running_daemon(node, config) as daemon:
        await registered(node, 8)
        fast(daemon)
        grant = (await node.sim.admit_pod("busy", [("c", 1)])).containers[0]
        client = client_of(grant, clients)
        using(node, A100.uuid, FakeProcess(client.pid, GiB, 100))  # wants all of its GPU
        await eventually(lambda: state_of(client.pid) == "T", 15, "the client throttled")
        using(node, A100.uuid, FakeProcess(client.pid, 25 * GiB, 100))
        assert await asyncio.to_thread(client.process.wait, 15) == -signal.SIGKILL
        (terminate,) = [e for e in events(mps_root(node), "terminate") if e["client"] == client.pid]
        assert terminate["stopped"] is False  # resumed before its terminate
        assert terminated_before_its_end(node, client.pid)


async def test_shutdown_resumes_a_throttled_client_and_stops_none(
    node: Node, clients: list[FakeClient]
) -> None:
    config = v3_config(node, work_conserving=False)
    async with running_daemon(node, config) as daemon:
        await registered(node, 8)
        fast(daemon)
        grant = (await node.sim.admit_pod("busy", [("c", 1)])).containers[0]
        client = client_of(grant, clients)
        using(node, A100.uuid, FakeProcess(client.pid, GiB, 100))
        await eventually(lambda: state_of(client.pid) == "T", 15, "the client throttled")
    assert state_of(client.pid) != "T"
    assert client.process.poll() is None
    assert [e for e in events(mps_root(node), "terminate") if e["client"] == client.pid] == []


async def test_the_kubelets_kill_of_a_client_is_seen_by_the_canary_and_mps_restarts(
    node: Node, clients: list[FakeClient], caplog: pytest.LogCaptureFixture
) -> None:
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        mps = fast(daemon)
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
        client = client_of(grant, clients)
        # A neighbour on the same GPU, whose namespace outlives the restart.
        stays = (await node.sim.admit_pod("stays", [("c", 2)])).containers[0]
        await eventually(lambda: seen(mps, client.pid), what="the client seen by the supervisor")
        first = mps.pid()
        # Pod deletion: the runtime kills the client with work in flight, no drain first.
        await node.sim.delete_pod("default", "p")
        client.kill()
        await eventually(lambda: mps.status.wedges_total == 1, 20, "the wedge found")
        await eventually(lambda: mps.status.restarts_total == 1, 20, "MPS started again")
        assert mps.pid() not in (None, first)
        lost = [e for e in events(mps_root(node), "client-lost") if e["client"] == client.pid]
        assert lost[0]["wedged"] is True
        assert "MPS is wedged; restarting it" in caplog.text
        # Started again with the running containers' namespaces made again at their caps ...
        assert caps(node, stays.envs["CUDA_MPS_PIPE_DIRECTORY"])["active-thread-percentage"] == "50"
        assert client_of(stays, clients).attached
        # ... the GPU serves a new client.
        again = (await node.sim.admit_pod("q", [("c", 1)])).containers[0]
        assert client_of(again, clients).attached
        doc = await status_of(daemon)
        assert doc["health"]["mps"]["wedges_total"] == 1
        _, metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{daemon.http.port}/metrics")  # type: ignore[union-attr]
        assert 'vgpu_mps_wedges_total{node="test-node"} 1.0' in metrics


# --- seen -----------------------------------------------------------------------------------


async def test_status_shows_each_containers_namespace_and_flags_root_clients(
    node: Node, clients: list[FakeClient]
) -> None:
    async with running_daemon(node, v3_config(node)) as daemon:
        await registered(node, 8)
        fast(daemon)
        grant = (await node.sim.admit_pod("p", [("c", 2)])).containers[0]
        client = client_of(grant, clients)  # runs as this test's user: root here
        using(node, A100.uuid, FakeProcess(client.pid, GiB, 10))

        def shown(doc: dict[str, Any]) -> dict[str, Any] | None:
            mine = [c for c in doc["containers"] if c["pod"] == "p"]
            return mine[0]["mps"] if mine and mine[0]["mps"] else None

        async def container_mps() -> dict[str, Any]:
            for _ in range(250):
                found = shown(await status_of(daemon))
                if found is not None and (found["root_clients"] or os.geteuid() != 0):
                    return found
                await asyncio.sleep(0.04)
            raise AssertionError("no MPS namespace with a root client in /status")

        mps = await container_mps()
        assert mps["pipe_directory"] == grant.envs["CUDA_MPS_PIPE_DIRECTORY"]
        assert mps["active_thread_ratio"] == 0.5
        assert mps["pinned_memory_limit_bytes"] == 40 * GiB
        assert mps["root_clients"] == ([client.pid] if os.geteuid() == 0 else [])
        _, metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{daemon.http.port}/metrics")  # type: ignore[union-attr]
        roots = 1.0 if os.geteuid() == 0 else 0.0
        assert f'vgpu_mps_root_clients{{node="test-node"}} {roots}' in metrics
        assert 'vgpu_mps_protocol{node="test-node"} 3.0' in metrics
        assert "vgpu_container_mps_active_thread_ratio{" in metrics


def seen(mps: MpsControlDaemon, pid: int) -> bool:
    """Whether the supervisor's last look at the clients found `pid`."""
    return pid in mps._watch.seen


def state_of(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]
