"""What a real kubelet v1.36.2 (containerd + runc when installed) makes happen to held slices:
a deleted pod's slices go free without passing through `unconfirmed`, and a daemon restarted
while pod-resources does not answer knows what the kubelet's checkpoint lists.

Expectations come from the contracts (docs/design.md §5) and from the kubelet's own device
checkpoint, never from vgpu's own answers."""

from __future__ import annotations

import hashlib
import time

from deviceplugin.gpu.fake import FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import RESOURCE, Cluster, Daemon, pod_manifest, wait_until

FAST = "enforcement: {pollInterval: 100ms, idlePollInterval: 100ms}\n"
CONFIG = "slicing: {replicas: 4}\n" + FAST
TWO_GPUS = FakeState(gpus=(gpu(0), gpu(1)))


def allocation_id(device_ids: list[str]) -> str:
    return hashlib.sha256(",".join(sorted(device_ids)).encode()).hexdigest()[:16]


def slices(daemon: Daemon) -> dict[str, int]:
    total: dict[str, int] = {}
    for g in daemon.status()["gpus"]:
        for state, count in g["slices"].items():
            total[state] = total.get(state, 0) + count
    return total


def test_a_deleted_pods_slices_go_free_without_being_unconfirmed(node: Cluster) -> None:
    daemon = node.start_daemon(config=CONFIG, gpus=TWO_GPUS)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    node.create_pod(pod_manifest("brief", {RESOURCE: 3}))
    node.wait_running("brief")
    wait_until(lambda: slices(daemon).get("allocated") == 3, timeout_s=20, what="3 allocated")
    node.delete_pod("brief", wait=False)
    deleted = time.monotonic()
    seen: list[dict[str, int]] = []
    while time.monotonic() - deleted < 20:
        now = slices(daemon)
        seen.append(now)
        if now.get("allocated") == 0:
            break
        time.sleep(0.1)
    freed_s = time.monotonic() - deleted
    print(f"a deleted pod's slices free after {freed_s:.2f} s")
    assert seen[-1].get("allocated") == 0, seen[-5:]
    assert all(s.get("unconfirmed", 0) == 0 for s in seen), [s for s in seen if s["unconfirmed"]]
    assert freed_s < 15


def test_a_daemon_restarted_without_pod_resources_knows_what_the_checkpoint_lists(
    node: Cluster,
) -> None:
    first = node.start_daemon(config=CONFIG, gpus=TWO_GPUS)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    node.create_pod(pod_manifest("kept", {RESOURCE: 2}))
    node.wait_running("kept")
    devices = node.checkpoint_devices("kept", "main")
    first.kill()
    node.wait_no_extended_resources()
    # Started again while pod-resources does not answer it (a socket nothing listens on).
    again = node.start_daemon(
        config=CONFIG, args=["--pod-resources-socket", "/run/vgpu-no-pod-resources.sock"]
    )
    node.wait_allocatable(RESOURCE, 8, capacity=8)

    def held() -> list[str] | None:
        for a in again.status()["allocations"]:
            if a["allocation_id"] == allocation_id(devices):
                return sorted(a["slice_ids"])
        return None

    wait_until(lambda: held() == devices, timeout_s=20, what="the allocation from the checkpoint")
    assert again.status()["health"]["pod_resources_ok"] is False
    assert slices(again).get("allocated") == 2
