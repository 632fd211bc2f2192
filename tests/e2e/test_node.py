"""vgpu on a real kubelet v1.36.2 (containerd + runc when installed): registration, pods,
their environment, accounting, evidence and enforcement."""

from __future__ import annotations

from deviceplugin.gpu.fake import FakeState
from tests.blackbox.daemon_harness import gpu
from tests.e2e.harness import RESOURCE, Cluster

GPUS = FakeState(gpus=(gpu(0), gpu(1, name="NVIDIA L4", memory_gib=24, numa_node=1)))
CONFIG = """\
slicing: {replicas: 4}
enforcement: {pollInterval: 100ms, idlePollInterval: 100ms}
"""


def test_registration_node_capacity_and_allocatable_are_the_plan(node: Cluster) -> None:
    daemon = node.start_daemon(config=CONFIG, gpus=GPUS)
    node.wait_allocatable(RESOURCE, 8, capacity=8)
    status = daemon.status()
    assert status["health"]["registered"] is True
    planned = sum(g["slices"]["total"] for g in status["gpus"])
    assert planned == 8
    assert node.capacity(RESOURCE) == planned == node.allocatable(RESOURCE)
