"""What the memory-limit tests on the real node share (docs/design.md §15): fake GPUs whose
driver partitions memory, the runtime hook built from its source, the daemon started with it, and
readers of the fake driver's limits file and of what a container saw at its first instruction.

The node's containers live under `/vgpu-e2e-<id>/kubepods/...` on every hierarchy; the unified
(v2) one is at /sys/fs/cgroup/unified on this hybrid host (`--cgroup-mount`), and the fake
driver keeps its limits on those directories. Each pod the tests make copies the fake driver's
file, as its very first instruction, into its own root (/seen.json): what it holds there is what
the driver held before the container's program ran.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from deviceplugin.gpu.fake import FakeGpu, FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import Cluster, Daemon, container, pod_manifest, wait_until
from tests.support.memlimits import compile_hook

GiB = 1024**3
# The unified hierarchy on this host as the daemon (in the node's mount namespace) sees it.
CGROUP_MOUNT = "/sys/fs/cgroup/unified"
HOST_DIR = "/vgpu-fake"  # where a pod sees the cluster's directory (the fake driver's file)
LIMITS_FILE = "gpus.json.memory-limits.json"
# The container's first instruction: what the fake driver holds then, kept in its own root.
SEEN = ["/bin/sh", "-c", f"cat {HOST_DIR}/{LIMITS_FILE} > /seen.json; exec sleep 3600"]


def partitioned(g: FakeGpu, store: str = "dmem") -> FakeGpu:
    return dataclasses.replace(g, driver_version="615.71", memory_partitions=store)


# 40 GiB: 10 GiB a slice with 4 replicas, and the DRA claims' room.
GPU = partitioned(gpu(0, name="NVIDIA A100-PCIE-40GB", memory_gib=40))
GPUS = FakeState(gpus=(GPU,))


def build_hook(cluster: Cluster) -> Path:
    """The runtime hook, compiled into the cluster's directory (seen inside the node)."""
    directory = cluster.paths.root / "hook"
    directory.mkdir(exist_ok=True)
    return compile_hook(directory)


def limit_args(cluster: Cluster, hook: Path) -> list[str]:
    return [
        "--cgroup-mount", CGROUP_MOUNT,
        "--memory-limit-hook", str(hook),
        "--cdi-dir", "/var/run/cdi",
    ]  # fmt: skip


RESOURCE = "nvidia.com/vgpu"


def seeing_pod(
    cluster: Cluster, name: str, containers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A pod whose containers (default: one `main` of one slice) each keep what the fake
    driver held at their first instruction; the cluster's directory mounted read-only."""
    pod = pod_manifest(name, containers=containers or [container("main", {RESOURCE: 1})])
    for c in pod["spec"]["containers"]:
        c["command"] = SEEN
        c["volumeMounts"] = [{"name": "fake", "mountPath": HOST_DIR, "readOnly": True}]
    pod["spec"]["volumes"] = [
        {"name": "fake", "hostPath": {"path": str(cluster.paths.root), "type": "Directory"}}
    ]
    return pod


def driver_limits(cluster: Cluster) -> dict[str, Any]:
    """The fake driver's file: per GPU, per cgroup, the limits it holds."""
    path = cluster.paths.root / LIMITS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def limits_on(cluster: Cluster, uuid: str) -> dict[str, dict[str, Any]]:
    return dict(driver_limits(cluster).get("gpus", {}).get(uuid, {}).get("limits", {}))


def under_node(cluster: Cluster, limits: dict[str, Any]) -> dict[str, Any]:
    """The entries of `limits` on the node's own cgroups (its pods and their ancestors)."""
    return {c: v for c, v in limits.items() if c.startswith(cluster.cgroup_root)}


def seen_by(cluster: Cluster, pod: str, name: str = "main") -> dict[str, Any]:
    """What the fake driver held when the container's program started (its /seen.json)."""
    pid = cluster.container_init_pid(pod, name)
    path = Path(f"/proc/{pid}/root/seen.json")
    text = wait_until(
        lambda: path.read_text() if path.exists() and path.stat().st_size else None,
        timeout_s=10,
        what=f"{pod}/{name} copying the driver's file",
    )
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def started_at_wall_s(pid: int) -> float:
    """When a process started, on the wall clock (to the clock tick, rounded down)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def container_status(daemon: Daemon, pod: str, name: str = "main") -> dict[str, Any] | None:
    for c in daemon.status()["containers"]:
        if c["pod"] == pod and c["container"] == name:
            return dict(c)
    return None


def enforced(daemon: Daemon, pod: str, name: str = "main") -> dict[str, Any]:
    """The container's /status entry once the driver holds it to its limit."""

    def found() -> dict[str, Any] | None:
        c = container_status(daemon, pod, name)
        return c if c is not None and c["memory_enforced_by"].startswith("driver-") else None

    result: dict[str, Any] = wait_until(found, timeout_s=20, what=f"{pod}/{name} enforced")
    return result


def gpu_status(daemon: Daemon, uuid: str) -> dict[str, Any]:
    (found,) = [g for g in daemon.status()["gpus"] if g["uuid"] == uuid]
    return dict(found)


def wait_nothing_left(cluster: Cluster, uuid: str, timeout_s: float = 30) -> None:
    """Until the fake driver holds nothing on the node's cgroups: no limit, no reservation."""
    started = time.monotonic()
    try:
        wait_until(
            lambda: not under_node(cluster, limits_on(cluster, uuid)),
            timeout_s=timeout_s,
            what="every limit cleared",
        )
    except TimeoutError:
        raise AssertionError(
            f"left after {time.monotonic() - started:.1f}s: "
            f"{json.dumps(under_node(cluster, limits_on(cluster, uuid)), indent=1)}"
        ) from None


def hook_failures_after_restart(cluster: Cluster, pod: str) -> list[str]:
    """Kill the container's process (the daemon already stopped): the kubelet creates it again
    with the same CDI devices, and its hook finds no daemon. The pod's events from the hook."""
    pid = cluster.container_init_pid(pod, "main")
    cluster.run_in_namespaces(["kill", "-KILL", str(pid)])

    def failed() -> list[str] | None:
        events = [e for e in cluster.events(pod) if "vgpu-hook" in e]
        return events or None

    events: list[str] = wait_until(
        failed, timeout_s=60, what="the hook's failure in the pod's events"
    )
    assert any("cannot reach the vgpu daemon" in e for e in events), events
    (status,) = cluster.pod(pod)["status"]["containerStatuses"]
    assert not status["state"].get("running"), status
    return events
