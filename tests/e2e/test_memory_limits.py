"""GPU memory limits the driver enforces, with device plugins, on the real node (docs/design.md
§15): a real kubelet v1.36.2 passes the CDI device Allocate answers (`vgpu.dev/allocation=<ID>`)
to containerd 2.x, which runs the spec's createRuntime hook, the real static binary, through
runc; the hook asks the daemon, which sets the limit on the container's own cgroup through the
fake driver before the container's first instruction, and clears it as the container goes.

Everything is real but the GPU, the fake backend's (its driver's partitions on the node's real
cgroup directories). The tests read what the kubelet and the runtime did (events, the
container's own view at its first instruction, its cgroup) and the fake driver's file, never the
daemon's answers alone."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.gpu.fake import FakeMigDevice, FakeProcess, FakeState
from tests.e2e.harness import Cluster, ContainerdOptions, Daemon, container, wait_until
from tests.e2e.memlimits import (
    GPU,
    GPUS,
    RESOURCE,
    GiB,
    build_hook,
    container_status,
    enforced,
    gpu_status,
    hook_failures_after_restart,
    limit_args,
    limits_on,
    partitioned,
    seeing_pod,
    seen_by,
    started_at_wall_s,
    under_node,
    wait_nothing_left,
)

RUNTIME = "containerd"
CONTAINERD_OPTIONS = ContainerdOptions()
SLICE = 10 * GiB
# One slice is the request, two its limit (burst); reclaim once less than 20 GiB is free.
CONFIG = """\
slicing: {replicas: 4}
memoryLimits:
  resources: [{resource: nvidia.com/vgpu, limitPerSlice: 20Gi}]
enforcement:
  pollInterval: 100ms
  idlePollInterval: 100ms
  memory: {action: kill, gracePeriod: 1s, pressureFreeBelow: 20Gi}
"""


@pytest.fixture(scope="module")
def hook(cluster: Cluster) -> Path:
    return build_hook(cluster)


def start(cluster: Cluster, hook: Path, gpus: FakeState = GPUS) -> Daemon:
    daemon = cluster.start_daemon(config=CONFIG, gpus=gpus, args=limit_args(cluster, hook))
    daemon.wait_registered()
    wait_until(lambda: daemon.status()["memory_limits"]["served"], timeout_s=20, what="hook served")
    return daemon


@pytest.fixture
def daemon(node: Cluster, hook: Path) -> Iterator[Daemon]:
    yield start(node, hook)
    node.write_gpus(GPUS)


def test_a_containers_limit_is_set_on_its_own_cgroup_before_its_first_instruction(
    node: Cluster, daemon: Daemon
) -> None:
    node.create_pod(seeing_pod(node, "first"))
    node.wait_running("first")
    cgroup = node.container_cgroup("first", "main")
    pid = node.container_init_pid("first", "main")
    # The kubelet asked containerd for the allocation's CDI device; its spec carries the hook.
    allocation = node.container_env("first", "main")["VGPU_ALLOCATION_ID"]
    spec = json.loads((node.paths.cdi_dir / f"vgpu.dev-allocation_{allocation}.json").read_text())
    (device,) = spec["devices"]
    (hook,) = device["containerEdits"]["hooks"]
    assert (hook["hookName"], hook["args"][:4]) == (
        "createRuntime",
        ["vgpu-hook", "apply", "--id", allocation],
    )
    # What the driver held when the container's program started: its own cgroup's limit, the
    # slice as the request and two slices as the limit.
    seen = seen_by(node, "first")["gpus"][GPU.uuid]["limits"][cgroup]
    assert (seen["soft_bytes"], seen["hard_bytes"]) == (SLICE, 2 * SLICE)
    # Set once the container's process existed (its init, which then ran the program).
    assert seen["set_at_s"] >= started_at_wall_s(pid)
    status = enforced(daemon, "first")
    assert (status["memory_request_bytes"], status["memory_limit_bytes"]) == (SLICE, 2 * SLICE)
    assert status["memory_enforced_by"] == "driver-dmem"
    assert status["memory_limit_set_at"].endswith("Z")
    assert "." in status["memory_limit_set_at"]
    assert gpu_status(daemon, GPU.uuid)["memory_enforcement"] == "driver-dmem"
    assert "memory limit set" in daemon.log()
    # Gone with the pod: nothing left on the node's cgroups, the allocation's spec removed.
    node.delete_pod("first")
    wait_nothing_left(node, GPU.uuid)
    spec_file = node.paths.cdi_dir / f"vgpu.dev-allocation_{allocation}.json"
    wait_until(lambda: not spec_file.exists(), timeout_s=30, what="the spec removed")
    assert daemon.status()["memory_limits"]["actions"]["cleared"] >= 1


def test_two_containers_of_a_pod_on_one_gpu_get_a_limit_each(node: Cluster, daemon: Daemon) -> None:
    pod = seeing_pod(node, "pair", [container("a", {RESOURCE: 1}), container("b", {RESOURCE: 2})])
    node.create_pod(pod)
    node.wait_running("pair")
    limits = limits_on(node, GPU.uuid)
    for name, slices in (("a", 1), ("b", 2)):
        cgroup = node.container_cgroup("pair", name)
        assert (limits[cgroup]["soft_bytes"], limits[cgroup]["hard_bytes"]) == (
            slices * SLICE,
            min(40 * GiB, 2 * slices * SLICE),
        ), name
        assert cgroup in seen_by(node, "pair", name)["gpus"][GPU.uuid]["limits"]
        enforced(daemon, "pair", name)


def test_a_mig_device_and_an_unhealthy_gpu_are_polled(node: Cluster, hook: Path) -> None:
    """A MIG device's memory is polled: its container gets no hook, and /status says why; a GPU
    that turns unhealthy is polled from then on."""
    mig = dataclasses.replace(
        partitioned(GPU),
        uuid="GPU-00000000-0000-4000-8000-000000000009",
        index=1,
        minor=1,
        mig_enabled=True,
        mig_block=True,
        mig_devices=(FakeMigDevice("MIG-1111", 1, 0, "3g.20gb", 20 * GiB),),
    )
    gpus = FakeState(gpus=(GPU, mig))
    daemon = node.start_daemon(
        config=CONFIG + "mig: {strategy: mixed}\n", gpus=gpus, args=limit_args(node, hook)
    )
    node.wait_allocatable("nvidia.com/mig-3g.20gb", 1)
    node.create_pod(seeing_pod(node, "on-mig", [container("main", {"nvidia.com/mig-3g.20gb": 1})]))
    node.wait_running("on-mig")
    status = wait_until(
        lambda: container_status(daemon, "on-mig"), timeout_s=20, what="on-mig in /status"
    )
    assert status["memory_enforced_by"] == "poll"
    assert not any(name.startswith("vgpu.dev-allocation_") for name in
                   (p.name for p in node.paths.cdi_dir.iterdir()))  # fmt: skip
    device = gpu_status(daemon, "MIG-1111")
    assert (device["memory_enforcement"], device["memory_enforcement_cause"]) == ("poll", "mig")
    # The full GPU turns unhealthy: polled, saying why.
    node.write_gpus(
        FakeState(gpus=(dataclasses.replace(GPU, healthy=False, health_reason="Xid 79"), mig))
    )

    def unhealthy() -> bool:
        found = gpu_status(daemon, GPU.uuid)
        return bool(found["memory_enforcement_cause"] == "unhealthy")

    wait_until(unhealthy, timeout_s=20, what="the unhealthy GPU polled")
    assert "Xid 79" in gpu_status(daemon, GPU.uuid)["memory_enforcement_reason"]
    node.write_gpus(GPUS)


def test_limits_a_daemon_killed_outright_left_are_cleared_at_its_next_start(
    node: Cluster, hook: Path
) -> None:
    daemon = start(node, hook)
    node.create_pod(seeing_pod(node, "orphan"))
    node.wait_running("orphan")
    cgroup = node.container_cgroup("orphan", "main")
    assert cgroup in limits_on(node, GPU.uuid)
    daemon.signal(signal.SIGKILL)
    daemon.proc.wait(5)
    # The container goes while no daemon watches: its leaf is removed with its soft limit
    # reserved in every ancestor (the dmem leak: the driver propagated it up).
    node.delete_pod("orphan")
    ancestors = {c: v for c, v in under_node(node, limits_on(node, GPU.uuid)).items()
                 if cgroup.startswith(c + "/")}  # fmt: skip
    assert len(ancestors) == cgroup.count("/") - 1, ancestors
    assert all(v["soft_bytes"] == SLICE for v in ancestors.values()), ancestors
    start(node, hook)
    wait_nothing_left(node, GPU.uuid)


def test_a_hook_that_cannot_reach_the_daemon_keeps_the_container_from_starting(
    node: Cluster, hook: Path
) -> None:
    daemon = start(node, hook)
    node.create_pod(seeing_pod(node, "stranded"))
    node.wait_running("stranded")
    daemon.stop()
    events = hook_failures_after_restart(node, "stranded")
    assert any("is not started" in e for e in events), events


def test_a_burstable_container_above_its_request_is_reclaimed_under_pressure(
    node: Cluster, daemon: Daemon
) -> None:
    """Both hold one slice (10 GiB request, 20 GiB limit): the one using 18 GiB, above its
    request, loses its process once the GPU has less than 20 GiB free; the one within its
    request is untouched."""
    for pod in ("burst", "steady"):
        node.create_pod(seeing_pod(node, pod))
    for pod in ("burst", "steady"):
        node.wait_running(pod)
        enforced(daemon, pod)
    pids = {pod: node.container_init_pid(pod, "main") for pod in ("burst", "steady")}
    node.write_gpus(
        FakeState(
            gpus=(
                dataclasses.replace(
                    GPU,
                    processes=(
                        FakeProcess(pid=pids["burst"], used_memory_bytes=18 * GiB),
                        FakeProcess(pid=pids["steady"], used_memory_bytes=8 * GiB),
                    ),
                ),
            )
        )
    )
    started = time.monotonic()
    wait_until(lambda: not Path(f"/proc/{pids['burst']}").exists(), timeout_s=20, what="reclaim")
    print(f"\nreclaimed {time.monotonic() - started:.2f}s after the pressure")
    node.write_gpus(GPUS)
    assert Path(f"/proc/{pids['steady']}").exists()
    (steady,) = node.pod("steady")["status"]["containerStatuses"]
    assert steady["restartCount"] == 0
    actions = [(e["pod"], e["action"]) for e in daemon.status()["enforcement"]]
    assert ("burst", "reclaim") in actions
    assert not any(p == "steady" for p, _ in actions)
    assert "memory reclaimed under pressure action=reclaim" in daemon.log()


def test_the_fake_driver_holds_a_process_to_its_hard_limit(node: Cluster, daemon: Daemon) -> None:
    """A process asking for more than its cgroup's hard limit gets the limit (its allocation
    past it fails); the refusal is in the driver's file, and the driver's count of the
    cgroup's use is in /status."""
    node.create_pod(seeing_pod(node, "greedy"))
    node.wait_running("greedy")
    enforced(daemon, "greedy")
    pid = node.container_init_pid("greedy", "main")
    cgroup = node.container_cgroup("greedy", "main")
    node.write_gpus(
        FakeState(
            gpus=(
                dataclasses.replace(
                    GPU, processes=(FakeProcess(pid=pid, used_memory_bytes=30 * GiB),)
                ),
            )
        )
    )
    try:

        def held() -> dict[str, object] | None:
            c = container_status(daemon, "greedy")
            return c if c and c["memory_driver_used_bytes"] == 2 * SLICE else None

        status = wait_until(held, timeout_s=20, what="the driver's count at the limit")
        assert status["memory_used_bytes"] == 2 * SLICE
        events = json.loads((node.paths.root / "gpus.json.memory-limits.json").read_text())
        refused = [e for e in events["events"] if e["action"] == "refused" and e["pid"] == pid]
        assert refused
        assert refused[-1]["cgroup"] == cgroup
        assert (refused[-1]["asked_bytes"], refused[-1]["granted_bytes"]) == (30 * GiB, 2 * SLICE)
    finally:
        node.write_gpus(GPUS)
