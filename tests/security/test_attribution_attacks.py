"""Enforcement is never turned against a pod: a host process copying a pod's allocation ID, or a
sidecar without slices in the pod, must not get the pod's GPU process killed.

Two levels: the whole attribution path (the /proc reader, the kubelet checkpoint, the snapshot
and the enforcement policy) over fake /proc trees in both cgroup layouts, cgroup v1 and v2,
always; and the whole daemon with real processes placed in real pod cgroups, where this machine
lets the test create cgroups (it runs as root in CI)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deviceplugin.config import Config, EnforcementConfig, MemoryEnforcement
from deviceplugin.enforcer.policy import EnforcementPolicy, Kill
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.kubelet.checkpoint import parse_checkpoint
from deviceplugin.model import DaemonHealth, NodeSnapshot, ProcessSample, allocation_id
from deviceplugin.usage.attribution import AttributionEvidence, SnapshotBuilder
from deviceplugin.usage.procs import AllocationResolver
from tests.blackbox.daemon_harness import (
    TWO_GPUS,
    GiB,
    Node,
    Workloads,
    eventually,
    registered,
    running_daemon,
    with_processes,
)
from tests.unit.test_attribution import INVENTORY, UUID0, reading, record, sid

RESOURCE = "nvidia.com/vgpu"
POD_UID = "5b0c3f7e-1d2a-4c3b-9e8f-0123456789ab"
OTHER_POD_UID = "77777777-1d2a-4c3b-9e8f-0123456789ab"
VICTIM = record(sid(UUID0, 0), namespace="ml", pod="victim", container="main")  # 20 GiB limit


def cid(container: str) -> str:
    """A container runtime ID (64 hex digits) for a container called `container` here."""
    return hashlib.sha256(container.encode()).hexdigest()


def cgroupfs(uid: str, container: str) -> str:
    return f"/kubepods/besteffort/pod{uid}/{cid(container)}"


def systemd(uid: str, container: str) -> str:
    under = uid.replace("-", "_")
    return (
        "/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{under}.slice/cri-containerd-{cid(container)}.scope"
    )


def v2(path: str) -> str:
    return f"0::{path}\n"


def v1(path: str) -> str:
    # A v1 host: one line per hierarchy, the pod's path in each.
    return "".join(
        f"{n}:{c}:{path}\n" for n, c in ((4, "memory"), (3, "cpu,cpuacct"), (1, "name=systemd"))
    )


Layout = tuple[Callable[[str, str], str], Callable[[str], str]]
LAYOUTS: dict[str, Layout] = {
    "cgroupfs-v2": (cgroupfs, v2),
    "cgroupfs-v1": (cgroupfs, v1),
    "systemd-v2": (systemd, v2),
    "systemd-v1": (systemd, v1),
}


class FakeProc:
    """A fake /proc tree: stat, environ and cgroup per PID."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, cgroup: str, tag: str | None = None, ppid: int = 1) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True)
        rest = " ".join(["0"] * 17)
        (d / "stat").write_text(f"{pid} (python3) S {ppid} {rest} {1000 + pid} 0 0\n")
        environ = b"PATH=/usr/bin\0" + (f"VGPU_ALLOCATION_ID={tag}\0".encode() if tag else b"")
        (d / "environ").write_bytes(environ)
        (d / "cgroup").write_text(cgroup)


def checkpoint_blob(*holders: tuple[str, str, tuple[str, ...]]) -> bytes:
    entries = [
        {
            "PodUID": pod,
            "ContainerName": container,
            "ResourceName": RESOURCE,
            "DeviceIDs": {"0": list(ids)},
            "AllocResp": "",
        }
        for pod, container, ids in holders
    ]
    return json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 0}).encode()


def attributed(proc: FakeProc, processes: list[ProcessSample]) -> NodeSnapshot:
    resolver = AllocationResolver(proc.root)
    tags = resolver.resolve(p.pid for p in processes)
    checkpoint = parse_checkpoint(checkpoint_blob((POD_UID, "main", VICTIM.slice_ids)), RESOURCE)
    evidence = AttributionEvidence(checkpoint, resolver.pod_uid_of, cgroup_of=resolver.cgroup_of)
    snapshot, _ = SnapshotBuilder("n", 5.0).build(
        reading(gpu0=processes),
        INVENTORY,
        [VICTIM],
        tags,
        now_s=10.0,
        wall_s=1_700_000_000.0,
        health=DaemonHealth(),
        previous_reading_s=9.0,
        evidence=evidence,
    )
    return snapshot


def kills(snapshot: NodeSnapshot) -> list[Kill]:
    policy = EnforcementPolicy(EnforcementConfig(memory=MemoryEnforcement(grace_period_s=0.0)))
    decided = policy.decide(snapshot, 0.0) + policy.decide(snapshot, 1.0)
    return [d for d in decided if isinstance(d, Kill)]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_host_process_copying_a_pods_id_gets_nothing_killed(
    tmp_path: Path, layout: Layout
) -> None:
    path_of, lines = layout
    proc = FakeProc(tmp_path)
    victim_id = VICTIM.allocation_id
    proc.add(101, lines(path_of(POD_UID, "main")), victim_id)  # the pod's own: 12 GiB
    proc.add(900, v2("/user.slice/user-1000.slice/session-1.scope"), victim_id)  # 15 GiB
    proc.add(901, lines("/system.slice/pod" + POD_UID + ".service"), victim_id)  # not kubepods
    snapshot = attributed(
        proc,
        [
            ProcessSample(101, 12 * GiB, 10.0),
            ProcessSample(900, 15 * GiB, 10.0),
            ProcessSample(901, 15 * GiB, 10.0),
        ],
    )
    (usage,) = snapshot.containers
    assert [p.pid for p in usage.processes] == [101]
    assert usage.memory_used_bytes == 12 * GiB
    assert [p.pid for p in snapshot.gpus[0].misattributed] == [900, 901]
    assert kills(snapshot) == []


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_sidecar_without_slices_never_gets_the_gpu_container_killed(
    tmp_path: Path, layout: Layout
) -> None:
    path_of, lines = layout
    proc = FakeProc(tmp_path)
    victim_id = VICTIM.allocation_id
    proc.add(101, lines(path_of(POD_UID, "main")), victim_id)  # 19 of its 20 GiB
    proc.add(102, lines(path_of(POD_UID, "sidecar")))  # no tag, 2 GiB
    proc.add(103, lines(path_of(POD_UID, "main")))  # no tag, but in the GPU container: 0.5
    snapshot = attributed(
        proc,
        [
            ProcessSample(101, 19 * GiB, 10.0),
            ProcessSample(102, 2 * GiB, 10.0),
            ProcessSample(103, GiB // 2, 10.0),
        ],
    )
    (usage,) = snapshot.containers
    assert [p.pid for p in usage.processes] == [101, 103]
    assert usage.memory_used_bytes == 19 * GiB + GiB // 2
    gpu = snapshot.gpus[0]
    assert [p.pid for p in gpu.unattributed] == [102]
    assert gpu.unattributed_pods == ((102, POD_UID),)
    assert gpu.misattributed == ()
    assert kills(snapshot) == []


def test_a_process_in_the_gpu_container_is_still_charged(tmp_path: Path) -> None:
    """The sidecar rule does not let the container's own processes escape: one that cleared or
    replaced its ID is charged through the container cgroup it shares, and killed."""
    proc = FakeProc(tmp_path)
    proc.add(101, v2(cgroupfs(POD_UID, "main")), VICTIM.allocation_id)
    proc.add(102, v2(cgroupfs(POD_UID, "main")), "ffffffffffffffff")
    snapshot = attributed(
        proc, [ProcessSample(101, 1 * GiB, 10.0), ProcessSample(102, 25 * GiB, 10.0)]
    )
    (usage,) = snapshot.containers
    assert usage.memory_used_bytes == 26 * GiB
    assert [k.pid for k in kills(snapshot)] == [102]


# ---------------------------------------------------------------------------------------------
# The whole daemon, real processes in real pod cgroups


def _cgroup_roots() -> list[tuple[Path, bool]]:
    """Writable cgroup hierarchies on this machine, (root, is v2), v2 first."""
    roots: list[tuple[Path, bool]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            if fields[2] == "cgroup2":
                roots.insert(0, (Path(fields[1]), True))
            elif fields[2] == "cgroup" and ("pids" in fields[3] or "memory" in fields[3]):
                roots.append((Path(fields[1]), False))
    return roots


class RealPodCgroups:
    """Pod cgroups made for the test under one hierarchy, removed afterwards."""

    def __init__(self, version: int) -> None:
        self.made: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.root: Path | None = None
        reason = f"no cgroup v{version} hierarchy mounted"
        if os.geteuid() != 0:
            reason = "creating cgroups needs root"
        else:
            for root, is_v2 in _cgroup_roots():
                if is_v2 != (version == 2):
                    continue
                probe = root / f"vgpu-test-{uuid.uuid4().hex[:8]}"
                try:
                    probe.mkdir()
                    probe.rmdir()
                except OSError as e:
                    reason = f"cannot create a cgroup under {root}: {e.strerror}"
                    continue
                self.root = root
                break
        self.skip_reason = reason

    def container(self, path: str) -> Path:
        assert self.root is not None
        directory = self.root / path.lstrip("/")
        parts = Path(path.lstrip("/")).parts
        for n in range(1, len(parts) + 1):
            d = self.root.joinpath(*parts[:n])
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        return directory

    def spawn(self, workloads: Workloads, path: str, envs: dict[str, str]) -> int:
        """A sleeping process that moved itself into the cgroup before exec."""
        procs = self.container(path) / "cgroup.procs"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **envs}
        script = f'echo $$ > "{procs}" && exec sleep 300'
        proc = subprocess.Popen(["sh", "-c", script], env=env)
        workloads.procs.append(proc)
        self.procs.append(proc)
        return proc.pid

    def close(self) -> None:
        """Kill the processes spawned here (a cgroup with a process cannot be removed), then
        remove the cgroups made here, innermost first."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
        for d in reversed(self.made):
            deadline = time.monotonic() + 5
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)


@pytest.fixture(params=[2, 1], ids=["cgroup-v2", "cgroup-v1"])
def pod_cgroups(request: pytest.FixtureRequest) -> Iterator[RealPodCgroups]:
    cgroups = RealPodCgroups(request.param)
    if cgroups.root is None:
        pytest.skip(cgroups.skip_reason)
    try:
        yield cgroups
    finally:
        cgroups.close()


def in_cgroup(pid: int, part: str) -> bool:
    with contextlib.suppress(OSError):
        return part in Path(f"/proc/{pid}/cgroup").read_text()
    return False


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("path_of", [cgroupfs, systemd], ids=["cgroupfs", "systemd"])
async def test_real_cgroups_host_copycat_and_sidecar_kill_nothing(
    node: Node,
    workloads: Workloads,
    pod_cgroups: RealPodCgroups,
    path_of: Callable[[str, str], str],
) -> None:
    config = Config(
        enforcement=EnforcementConfig(
            poll_interval_s=0.05, memory=MemoryEnforcement(grace_period_s=0.2)
        )
    )
    async with running_daemon(node, config, trust_host_processes=False) as daemon:
        await registered(node, 8)
        pod = await node.sim.admit_pod("victim", [("main", 1)])
        grant = pod.containers[0]
        gpu = next(g for g in TWO_GPUS if g.uuid in grant.envs["NVIDIA_VISIBLE_DEVICES"])
        limit = gpu.memory_total_bytes // 4
        tag = uuid.uuid4().hex[:12]
        main_path = path_of(pod.uid, f"main{tag}")
        side_path = path_of(pod.uid, f"side{tag}")
        victim = pod_cgroups.spawn(workloads, main_path, grant.envs)
        sidecar = pod_cgroups.spawn(workloads, side_path, {})
        copycat = workloads.spawn(grant.envs)  # a host process with the pod's ID
        await eventually(lambda: in_cgroup(victim, main_path) and in_cgroup(sidecar, side_path), 5)
        node.write_gpus(
            [
                with_processes(
                    g,
                    FakeProcess(victim, limit - GiB, 10),
                    FakeProcess(sidecar, 2 * GiB, 10),
                    FakeProcess(copycat, limit, 10),
                )
                if g is gpu
                else g
                for g in TWO_GPUS
            ]
        )

        def seen() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                p.pid == copycat for g in snap.gpus for p in g.misattributed
            )

        await eventually(seen, 10, "the copycat's tag refused")
        # Five grace periods: a wrong charge would have had the victim killed by now.
        await asyncio.sleep(1.0)
        assert alive(victim), "the pod's own process was killed"
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        wanted = allocation_id(grant.device_ids)
        (usage,) = [c for c in snapshot.containers if c.allocation_id == wanted]
        assert [p.pid for p in usage.processes] == [victim]
        g = next(u for u in snapshot.gpus if u.info.uuid == gpu.uuid)
        assert dict(g.unattributed_pods) == {sidecar: pod.uid}


def test_serve_refuses_to_trust_host_processes_on_real_gpus(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "deviceplugin", "serve", "--trust-host-processes",
            "--backend", "nvml", "--state-dir", str(tmp_path / "s"),
            "--device-plugin-dir", str(tmp_path / "dp"), "--metrics-address", "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--trust-host-processes" in result.stderr
    assert "fake:PATH" in result.stderr
