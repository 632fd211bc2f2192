"""MPS on the real node (kubelet v1.36.2, containerd 2.x + runc), on the project's fake control
command (tests/support/fake_mps_control.py) in place of nvidia-cuda-mps-control: the daemon runs
it as on a GPU node, and each pod's container is a real fake MPS client (the host's python3,
mounted read-only with the repository) that attaches through the pipe directory its container
was given, as a CUDA process would.

- MPS v3, device plugins: Allocate makes each container's namespace, capped at its share and
  memory, before the container starts; the container's environment names only its namespace's
  directory and that directory alone is mounted, read-only; its client attaches there.
- The stops: the enforcer's memory kill of a container's client drains it through the control
  daemon first; a pod deleted with its client's work in flight (the kubelet's kill, which nothing
  can drain on containerd) wedges the GPU, the canary finds it, MPS is restarted, and the pod's
  namespace is deleted.
- MPS v3, DRA: NodePrepareResources makes the claim's namespace before its CDI spec names it.
- MPS v2 (mps.protocol: v2) keeps working: the whole pipe directory, the per-client limits.

Every assertion reads what the container has (/proc/PID/environ, /proc/PID/mountinfo) or what
the fake control daemon was told (its record, its answers)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeProcess, FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import REPO, Cluster, Daemon, container, pod_manifest, wait_until
from tests.e2e.test_dra import DRIVER, _install, start_dra
from tests.support.fake_mps.harness import namespace_caps as caps
from tests.support.fake_mps.harness import namespaces, records

RUNTIME = "containerd"
GiB = 1024**3
A100 = gpu(0)  # 80 GiB, four slices: 20 GiB and 25 % each
GPUS = FakeState(gpus=(A100,))
FAKE_CONTROL = REPO / "tests" / "support" / "fake_mps_control.py"
# The host's python3 in a busybox container: its /usr mounted read-only, started through the
# dynamic loader (the image has no /lib64; on a merged-/usr host the loader is under /usr).
LOADER = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
LIBRARIES = "/usr/lib/x86_64-linux-gnu"


def mps_config(root: Path, protocol: str = "auto") -> str:
    return f"""\
slicing: {{replicas: 4}}
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {{action: kill, gracePeriod: 500ms}}
mps:
  enabled: true
  root: {root}
  controlCommand: {FAKE_CONTROL}
  canaryCommand: {sys.executable} {FAKE_CONTROL} canary
  protocol: {protocol}
"""


def using(*processes: FakeProcess) -> FakeState:
    """The node's GPU, running `processes`."""
    return FakeState(gpus=(dataclasses.replace(A100, processes=processes),))


def client_pod(
    name: str, limits: dict[str, int] | None = None, *, work: bool = True
) -> dict[str, Any]:
    """A pod whose container is a fake MPS client (with GPU work in flight unless `work` is
    false: then its kill wedges nothing), attached through the pipe directory its environment
    names."""
    main = container(
        "main",
        limits,
        command=[LOADER, "--library-path", LIBRARIES, "/usr/bin/python3", str(FAKE_CONTROL),
                 "client", *(["--work"] if work else [])],
    )  # fmt: skip
    main["env"] = [
        {"name": "PYTHONHOME", "value": "/usr"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    main["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True},
        {"name": "repo", "mountPath": str(REPO), "readOnly": True},
    ]
    pod = pod_manifest(name, containers=[main])
    pod["spec"]["volumes"] = [
        {"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}},
        {"name": "repo", "hostPath": {"path": str(REPO), "type": "Directory"}},
    ]
    return pod


@pytest.fixture(autouse=True)
def host_python_in_containers() -> None:
    if not LOADER.startswith("/usr/") or not Path(LIBRARIES).is_dir():
        pytest.skip(f"the host's python3 cannot run from its /usr alone (loader {LOADER})")


@pytest.fixture
def mps_root(node: Cluster, request: pytest.FixtureRequest) -> Path:
    """An MPS root of the test's own, under the node's scratch directory (short enough for a
    namespace's socket path)."""
    root = node.paths.root / f"mps{len(node.daemons)}"
    root.mkdir()
    return root


@pytest.fixture
def daemons(node: Cluster) -> Iterator[list[Daemon]]:
    """The test's daemons, stopped with SIGTERM (which sends their control daemon quit)."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.stop()


def start(node: Cluster, daemons: list[Daemon], root: Path, protocol: str = "auto") -> Daemon:
    daemon = node.start_daemon(config=mps_config(root, protocol), gpus=GPUS)
    daemons.append(daemon)
    daemon.wait_registered(count=4)
    return daemon


def mounts(pid: int) -> dict[str, str]:
    """The process's mount points, with their mount options (/proc/PID/mountinfo)."""
    found = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        found[fields[4]] = fields[5]
    return found


def event(root: Path, name: str, pid: int) -> dict[str, Any]:
    """The fake control daemon's record of event `name` of client `pid`, once it is there."""

    def found() -> dict[str, Any] | None:
        return next((e for e in records(root) if e["event"] == name and e["client"] == pid), None)

    return wait_until(found, timeout_s=20, what=f"client {pid}: {name}")


def attached(root: Path, pid: int) -> dict[str, Any]:
    return event(root, "attached", pid)


def lost(root: Path, pid: int) -> dict[str, Any]:
    return event(root, "client-lost", pid)


def container_mps(daemon: Daemon, pod: str) -> dict[str, Any] | None:
    mine = [c for c in daemon.status()["containers"] if c["pod"] == pod]
    return mine[0]["mps"] if mine else None


def assert_in_its_namespace(node: Cluster, root: Path, pod: str) -> tuple[int, str]:
    """The container's environment and mounts name its own namespace, and its client attached
    there; (its client's host PID, the namespace's directory)."""
    env = node.container_env(pod, "main")
    directory = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert directory.startswith(f"{root}/pipe/"), directory
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    pid = node.container_init_pid(pod, "main")
    mounted = mounts(pid)
    assert mounted.get(directory, "").split(",")[0] == "ro", mounted.get(directory)
    assert f"{root}/pipe" not in mounted  # the node's pipe directory is not mounted
    assert "/dev/shm" in mounted
    server, name = Path(directory).parts[-2:]
    record = attached(root, pid)
    assert (record["server"], record["namespace"]) == (server, name)
    return pid, directory


def test_v3_each_container_gets_its_own_namespace_before_it_starts(
    node: Cluster, mps_root: Path, daemons: list[Daemon]
) -> None:
    daemon = start(node, daemons, mps_root)
    assert daemon.status()["health"]["mps"]["protocol"] == 3
    node.create_pod(client_pod("two", {"nvidia.com/vgpu": 2}))
    node.create_pod(client_pod("one", {"nvidia.com/vgpu": 1}))
    node.wait_running("two")
    node.wait_running("one")
    two_pid, two_dir = assert_in_its_namespace(node, mps_root, "two")
    _, one_dir = assert_in_its_namespace(node, mps_root, "one")
    assert two_dir != one_dir
    # The namespace's caps are the container's share and memory of the A100.
    assert caps(mps_root, two_dir)["active-thread-percentage"] == "50"
    assert caps(mps_root, two_dir)["pinned-memory-limit"] in ("40960M", "40G")
    assert caps(mps_root, one_dir)["active-thread-percentage"] == "25"
    # /status: the container's namespace, and its client (a GPU process of it) flagged as root
    # (the pod runs as root).
    node.write_gpus(using(FakeProcess(two_pid, GiB, 10)))

    def flagged() -> dict[str, Any] | None:
        mps = container_mps(daemon, "two")
        return mps if mps is not None and mps["root_clients"] else None

    shown = wait_until(flagged, timeout_s=20, what="the container's MPS namespace in /status")
    assert shown["pipe_directory"] == two_dir
    assert shown["active_thread_ratio"] == 0.5
    assert shown["root_clients"] == [two_pid]


def test_v3_a_memory_kill_drains_the_client_and_pod_deletion_is_found_by_the_canary(
    node: Cluster, mps_root: Path, daemons: list[Daemon]
) -> None:
    daemon = start(node, daemons, mps_root)
    node.create_pod(client_pod("hog", {"nvidia.com/vgpu": 1}))
    node.create_pod(client_pod("gone", {"nvidia.com/vgpu": 1}))
    node.wait_running("hog")
    node.wait_running("gone")
    hog, _ = assert_in_its_namespace(node, mps_root, "hog")
    gone, gone_dir = assert_in_its_namespace(node, mps_root, "gone")

    # The enforcer's kill: 25 GiB on a 20 GiB slice. Drained first: nothing wedged.
    node.write_gpus(using(FakeProcess(hog, 25 * GiB, 10)))
    end = lost(mps_root, hog)
    assert (end["terminated"], end["wedged"]) == (True, False), end
    node.write_gpus(GPUS)
    wait_until(lambda: daemon.status()["health"]["mps"]["drains_total"] == 1, timeout_s=10,
               what="the drain counted")  # fmt: skip

    # The kubelet's kill at pod deletion (no drain can come first on containerd): the GPU is
    # wedged until MPS restarts, which the canary finds.
    node.delete_pod("gone")
    end = lost(mps_root, gone)
    assert (end["terminated"], end["wedged"]) == (False, True), end

    def restarted() -> dict[str, Any] | None:
        mps: dict[str, Any] = daemon.status()["health"]["mps"]
        return mps if mps["wedges_total"] == 1 and mps["up"] else None

    mps = wait_until(restarted, timeout_s=60, what="the wedge found and MPS started again")
    assert mps["restarts_total"] >= 1
    # The deleted pod's namespace is gone; the running pod's is there again, and its restarted
    # client (the kill ended its container; the kubelet started it again) attaches to it.
    held = "/".join(Path(gone_dir).parts[-2:])
    wait_until(lambda: held not in namespaces(mps_root), timeout_s=60, what="namespace deleted")
    node.wait_running("hog")
    assert_in_its_namespace(node, mps_root, "hog")
    assert 'vgpu_mps_wedges_total{node="e2e-node"} 1.0' in daemon.metrics()


def test_v3_a_claim_gets_its_own_namespace_before_its_spec(
    node: Cluster, mps_root: Path, daemons: list[Daemon]
) -> None:
    _install(node)
    daemon = start_dra(node, config=mps_config(mps_root))
    daemons.append(daemon)
    # No work in flight: the pod's deletion wedges nothing, and MPS stays up throughout.
    pod = client_pod("claimed", work=False)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "m15-c30"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    node.create_pod(pod)
    node.wait_running("claimed")
    _, directory = assert_in_its_namespace(node, mps_root, "claimed")
    assert caps(mps_root, directory)["active-thread-percentage"] == "30"
    assert caps(mps_root, directory)["pinned-memory-limit"] in ("15360M", "15G")
    spec = next(node.paths.cdi_dir.glob(f"{DRIVER}-claim_*.json"))
    edits = json.loads(spec.read_text())["devices"][0]["containerEdits"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={directory}" in edits["env"]
    node.delete_pod("claimed")
    held = "/".join(Path(directory).parts[-2:])
    wait_until(lambda: held not in namespaces(mps_root), timeout_s=60, what="namespace deleted")


def test_v2_keeps_working_on_the_real_node(
    node: Cluster, mps_root: Path, daemons: list[Daemon]
) -> None:
    daemon = start(node, daemons, mps_root, protocol="v2")
    assert daemon.status()["health"]["mps"]["protocol"] == 2
    node.create_pod(client_pod("old", {"nvidia.com/vgpu": 2}))
    node.wait_running("old")
    env = node.container_env("old", "main")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{mps_root}/pipe"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    pid = node.container_init_pid("old", "main")
    assert mounts(pid)[f"{mps_root}/pipe"].split(",")[0] == "ro"
    record = attached(mps_root, pid)
    assert (record["server"], record["namespace"]) == ("", "default")  # the node's main socket
