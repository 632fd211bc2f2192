"""A forged cgroup path never passes as a pod's: a process is a pod's only when its cgroup is
where the kubelet puts that pod's containers, from the root of the hierarchy; a path relative to
the daemon's cgroup namespace is resolved from that namespace's real root, or refused.

Fake /proc trees for each forgery, then real processes in real cgroups (v2 and v1) under a
subtree the test owns, and a real cgroup namespace."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.config import Config, EnforcementConfig, MemoryEnforcement
from deviceplugin.gpu.fake import FakeProcess
from deviceplugin.model import ProcessSample, allocation_id
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree, detect_layout, kubelet_layout
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
from tests.security.cgroup_support import cid, subtree
from tests.security.test_attribution_attacks import (
    OTHER_POD_UID,
    POD_UID,
    VICTIM,
    FakeProc,
    RealPodCgroups,
    alive,
    attributed,
    cgroupfs,
    in_cgroup,
    kills,
    v1,
    v2,
)

CTR = cid("forger")
FORGED = {
    # `kubepods` below a user's delegated subtree (cgroup v2 lets a user make these).
    "kubepods under a user's service": v2(
        f"/user.slice/user-1000.slice/user@1000.service/kubepods/besteffort/pod{POD_UID}/{CTR}"
    ),
    "kubepods in a host unit's name": v2(f"/system.slice/kubepods-x.service/pod{POD_UID}/{CTR}"),
    "the victim's pod inside another pod's container": v2(
        f"/kubepods/besteffort/pod{OTHER_POD_UID}/{CTR}/pod{POD_UID}/{CTR}"
    ),
    "relative to an unknown cgroup namespace root": v2(
        f"/../../../user.slice/user-1000.slice/pod{POD_UID}/{CTR}"
    ),
    "v1 kubepods under a user's slice": v1(
        f"/user.slice/user-1000.slice/kubepods/besteffort/pod{POD_UID}/{CTR}"
    ),
}


@pytest.mark.parametrize("forged", FORGED.values(), ids=FORGED.keys())
def test_a_forged_pod_cgroup_claiming_a_pods_id_gets_nothing_killed(
    tmp_path: Path, forged: str
) -> None:
    proc = FakeProc(tmp_path)
    proc.add(101, v2(cgroupfs(POD_UID, "main")), VICTIM.allocation_id)  # 19 of its 20 GiB
    proc.add(900, forged, VICTIM.allocation_id)  # 5 GiB more would put it over
    snapshot = attributed(
        proc, [ProcessSample(101, 19 * GiB, 10.0), ProcessSample(900, 5 * GiB, 10.0)]
    )
    (usage,) = snapshot.containers
    assert [p.pid for p in usage.processes] == [101]
    assert [p.pid for p in snapshot.gpus[0].misattributed] == [900]
    assert kills(snapshot) == []


@pytest.mark.parametrize("version", [2, 1], ids=["cgroup-v2", "cgroup-v1"])
def test_real_cgroups_only_the_kubelets_place_is_a_pods(version: int) -> None:
    with subtree(version) as tree:
        root = tree.name
        real = tree.spawn(f"{root}/kubepods/besteffort/pod{POD_UID}/{cid('main')}")
        forged = tree.spawn(
            f"{root}/user@1000.service/kubepods/besteffort/pod{POD_UID}/{cid('main')}"
        )
        nested = tree.spawn(
            f"{root}/kubepods/besteffort/pod{OTHER_POD_UID}/{cid('x')}/pod{POD_UID}/{CTR}"
        )
        layout = KubeletTree(CgroupLayout(CgroupLayout().driver, root))
        resolver = AllocationResolver(Path("/proc"), tree=layout, container_logs=None)
        resolver.resolve({real, forged, nested})
        assert resolver.pod_uid_of(real) == POD_UID
        assert resolver.pod_uid_of(forged) is None
        assert resolver.pod_uid_of(nested) == OTHER_POD_UID
        # The same places seen with the kubelet's root at "/": none is where it puts pods.
        default = AllocationResolver(Path("/proc"), container_logs=None)
        default.resolve({real, forged, nested})
        assert [default.pod_uid_of(p) for p in (real, forged, nested)] == [None, None, None]


_IN_NAMESPACE = """
import json, sys
from pathlib import Path
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree, find_namespace_root
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree, detect_layout, kubelet_layout
from deviceplugin.usage.procs import AllocationResolver
root, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
ns_root = find_namespace_root()
tree = KubeletTree(CgroupLayout("cgroupfs", root), namespace_root=ns_root)
resolver = AllocationResolver(Path("/proc"), tree=tree, container_logs=None)
resolver.resolve(set(pids))
at_root = KubeletTree(CgroupLayout("cgroupfs", "/"), namespace_root=ns_root)
inside = AllocationResolver(Path("/proc"), tree=at_root, container_logs=None)
inside.resolve(set(pids))
own = [l for l in Path("/proc/self/cgroup").read_text().splitlines() if l.startswith("0::")][0]
print(json.dumps({
    "ns_root": ns_root,
    "own": own,
    "pods": [resolver.pod_uid_of(p) for p in pids],
    "at_root": [inside.pod_uid_of(p) for p in pids],
}))
"""


@pytest.mark.parametrize("mounted", [True, False], ids=["host-hierarchy-mounted", "not-mounted"])
def test_real_cgroup_namespace_paths_are_resolved_from_its_root_or_refused(
    tmp_path: Path, mounted: bool
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    with subtree(2) as tree:
        root = tree.name
        real = tree.spawn(f"{root}/kubepods/besteffort/pod{POD_UID}/{cid('main')}")
        # Seen from the daemon's namespace as /../other/pod<uid>/<id>: today's parser took it.
        forged = tree.spawn(f"{root}/other/pod{POD_UID}/{cid('main')}")
        # Inside the daemon's own namespace, seen from there as /kubepods/...: a path from that
        # namespace's root, not the hierarchy's.
        inside = tree.spawn(f"{root}/daemon/kubepods/besteffort/pod{POD_UID}/{cid('main')}")
        procs = tree.hierarchy / root.lstrip("/") / "daemon" / "cgroup.procs"
        program = tmp_path / "in_namespace.py"
        program.write_text(_IN_NAMESPACE)
        python = f"{sys.executable} {program} {root} {real} {forged} {inside}"
        if not mounted:
            python = f"umount {tree.hierarchy} && {python}"
        unshare = "unshare --cgroup" + ("" if mounted else " --mount --propagation private")
        script = f'echo $$ > "{procs}" && exec {unshare} sh -c "{python}"'
        done = subprocess.run(
            ["sh", "-c", script], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["own"] == "0::/"  # in a cgroup namespace of its own
        if mounted:
            assert seen["ns_root"] == f"{root}/daemon"
            assert seen["pods"] == [POD_UID, None, None]
        else:
            assert seen["ns_root"] is None
            assert seen["pods"] == [None, None, None]
        assert seen["at_root"] == [None, None, None]


LAYOUTS = {
    "cgroupfs": (f"0::/kubepods/burstable/pod{POD_UID}/{CTR}\n", ("cgroupfs", "/")),
    "cgroupfs under a root": (
        f"0::/k8s/kubepods/pod{POD_UID}/{CTR}\n",
        ("cgroupfs", "/k8s"),
    ),
    "systemd": (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CTR}.scope\n",
        ("systemd", "/"),
    ),
    "systemd under kind's kubelet.slice": (
        "0::/kubelet.slice/kubelet-kubepods.slice/"
        f"kubelet-kubepods-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CTR}.scope\n",
        ("systemd", "/kubelet.slice"),
    ),
    "not in a pod": ("0::/user.slice/session-1.scope\n", None),
}


@pytest.mark.parametrize(("own", "expected"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_kubelets_layout_is_read_from_the_daemons_own_container(
    own: str, expected: tuple[str, str] | None
) -> None:
    layout = detect_layout(own.encode(), "")
    assert (None if layout is None else (layout.driver, layout.root)) == expected


def test_in_its_own_cgroup_namespace_the_daemon_reads_its_layout_from_the_namespace_root() -> None:
    ns_root = "/kubepods/burstable/pod" + POD_UID + "/" + CTR
    layout = detect_layout(b"0::/\n", ns_root)
    assert layout is not None
    assert (layout.driver, layout.root) == ("cgroupfs", "/")
    assert detect_layout(b"0::/\n", None) is None  # its namespace's root unknown


def test_with_the_layout_read_a_path_of_the_other_driver_is_no_pods() -> None:
    systemd_own = LAYOUTS["systemd"][0].encode()
    layout = detect_layout(systemd_own, "")
    assert layout is not None
    tree = KubeletTree(layout)
    assert tree.container_of(systemd_own) is not None
    assert tree.container_of(f"0::/kubepods/burstable/pod{POD_UID}/{CTR}\n".encode()) is None


@pytest.fixture(params=[2, 1], ids=["cgroup-v2", "cgroup-v1"])
def pod_cgroups(request: pytest.FixtureRequest) -> Iterator[RealPodCgroups]:
    cgroups = RealPodCgroups(request.param)
    if cgroups.root is None:
        pytest.skip(cgroups.skip_reason)
    try:
        yield cgroups
    finally:
        cgroups.close()


async def test_real_cgroups_a_forged_pod_cgroup_gets_the_daemon_to_kill_nothing(
    node: Node, workloads: Workloads, pod_cgroups: RealPodCgroups
) -> None:
    """The whole daemon: a process in a cgroup named like the victim's pod container but made
    below a test-owned subtree (as a user can under a delegated v2 subtree) names the victim's
    allocation; with its memory the victim's container would be over its limit."""
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
        victim = pod_cgroups.spawn(workloads, cgroupfs(pod.uid, f"main{tag}"), grant.envs)
        forged_path = f"/vgpu-test-{tag}" + cgroupfs(pod.uid, f"forger{tag}")
        forger = pod_cgroups.spawn(workloads, forged_path, grant.envs)
        await eventually(lambda: in_cgroup(forger, forged_path), 5)
        node.write_gpus(
            [
                with_processes(
                    g, FakeProcess(victim, limit - GiB, 10), FakeProcess(forger, 2 * GiB, 10)
                )
                if g is gpu
                else g
                for g in TWO_GPUS
            ]
        )

        def refused() -> bool:
            snap = daemon.poller.snapshot
            return snap is not None and any(
                p.pid == forger for g in snap.gpus for p in g.misattributed
            )

        await eventually(refused, 10, "the forged cgroup's tag refused")
        await asyncio.sleep(1.0)  # five grace periods
        assert alive(victim), "the pod's own process was killed"
        assert alive(forger)
        snapshot = daemon.poller.snapshot
        assert snapshot is not None
        (usage,) = [
            c for c in snapshot.containers if c.allocation_id == allocation_id(grant.device_ids)
        ]
        assert [p.pid for p in usage.processes] == [victim]


async def test_real_cgroups_the_daemon_charges_and_enforces_under_the_kubelet_root_it_is_given(
    node: Node, workloads: Workloads, pod_cgroups: RealPodCgroups
) -> None:
    """The whole daemon told the kubelet's cgroup root (`--kubelet-cgroup-driver cgroupfs
    --kubelet-cgroup-root /<root>`, as on a node whose kubelet runs with `cgroupRoot`): a pod's
    process in `/<root>/kubepods/besteffort/pod<uid>/<container ID>` is charged to its
    container, and killed once over its limit (the signal-time check reads the same layout)."""
    config = Config(
        enforcement=EnforcementConfig(
            poll_interval_s=0.05, memory=MemoryEnforcement(grace_period_s=0.2)
        )
    )
    tag = uuid.uuid4().hex[:12]
    root = f"/vgpu-test-{tag}"
    async with running_daemon(
        node, config, trust_host_processes=False, kubelet_cgroup_root=root
    ) as daemon:
        await registered(node, 8)
        pod = await node.sim.admit_pod("greedy", [("main", 1)])
        grant = pod.containers[0]
        gpu = next(g for g in TWO_GPUS if g.uuid in grant.envs["NVIDIA_VISIBLE_DEVICES"])
        limit = gpu.memory_total_bytes // 4
        path = root + cgroupfs(pod.uid, f"main{tag}")
        main = pod_cgroups.spawn(workloads, path, grant.envs)
        await eventually(lambda: in_cgroup(main, path), 5)

        def write(used: int) -> None:
            node.write_gpus(
                [
                    with_processes(g, FakeProcess(main, used, 10)) if g is gpu else g
                    for g in TWO_GPUS
                ]
            )

        def charged() -> int | None:
            snap = daemon.poller.snapshot
            for c in snap.containers if snap is not None else ():
                ours = c.allocation_id == allocation_id(grant.device_ids)
                if ours and [p.pid for p in c.processes] == [main]:
                    return c.memory_used_bytes
            return None

        write(GiB)
        await eventually(lambda: charged() == GiB, 10, "the pod's process charged to it")
        write(limit + GiB)
        await eventually(lambda: not alive(main), 10, "the pod's process over its limit killed")


def test_a_kubelet_cgroup_root_set_on_the_command_line_is_where_pods_are() -> None:
    with subtree(2) as tree:
        pod = tree.spawn(f"{tree.name}/kubepods/besteffort/pod{POD_UID}/{cid('main')}")
        elsewhere = tree.spawn(f"{tree.name}/other/kubepods/besteffort/pod{POD_UID}/{CTR}")
        layout = kubelet_layout("cgroupfs", tree.name)
        resolver = AllocationResolver(Path("/proc"), layout=layout, container_logs=None)
        resolver.resolve({pod, elsewhere})
        assert resolver.pod_uid_of(pod) == POD_UID
        assert resolver.pod_uid_of(elsewhere) is None
    assert kubelet_layout("auto", "") is None  # read at start from the daemon's own container


@pytest.mark.parametrize(
    "flags",
    [
        ["--kubelet-cgroup-root", "relative/root"],
        ["--kubelet-cgroup-root", "/a/../b"],
        ["--kubelet-cgroup-driver", "systemd", "--kubelet-cgroup-root", "/not-a-slice"],
    ],
    ids=["relative", "dot-dot", "systemd-not-a-slice"],
)
def test_serve_refuses_a_kubelet_cgroup_root_that_is_not_one(
    tmp_path: Path, flags: list[str]
) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "deviceplugin", "serve", *flags,
            "--backend", f"fake:{tmp_path / 'gpus.json'}", "--state-dir", str(tmp_path / "s"),
            "--device-plugin-dir", str(tmp_path / "dp"), "--metrics-address", "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--kubelet-cgroup-root" in result.stderr
