"""Node labels through node feature discovery's feature file: what the daemon writes, and that
each change replaces the file whole (by a rename), never rewrites it in place."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from deviceplugin.config import (
    Config,
    GpuMatch,
    NodeLabelsConfig,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.memlimits.settings import MemoryLimitSettings
from deviceplugin.nodelabels import label_value
from tests.blackbox.daemon_harness import (
    FAST,
    Node,
    eventually,
    gpu,
    registered,
    running_daemon,
)


def labels_config(name: str, slicing: SlicingConfig | None = None) -> Config:
    return Config(
        enforcement=FAST,
        slicing=slicing or SlicingConfig(),
        node_labels=NodeLabelsConfig(file=name),
    )


def features_dir(node: Node) -> Path:
    """The directory the test daemons are started with (--node-features-dir)."""
    return node.root / "features.d"


def read_labels(path: Path) -> dict[str, str]:
    """The file as NFD's local source reads it: one name=value per line, `#` lines skipped."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def file_reads(path: Path, want: dict[str, str]) -> bool:
    try:
        return read_labels(path) == want
    except FileNotFoundError:
        return False


async def test_the_feature_file_names_the_slices_and_follows_gpu_health(node: Node) -> None:
    features = features_dir(node) / "vgpu"  # the directory is made when missing
    # Both GPUs the same model here, so that replicas is uniform: 4 slices of 80 GiB each.
    node.write_gpus((gpu(0), gpu(1)))
    healthy = {
        "nvidia.com/vgpu.count": "8",
        "nvidia.com/vgpu.replicas": "4",
        "nvidia.com/vgpu.memory-per-slice-mib": str(20 * 1024),
        "nvidia.com/vgpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/vgpu.mig-strategy": "none",
        "nvidia.com/vgpu.memory-enforcement": "poll",  # memory limits are off here
    }
    async with running_daemon(node, labels_config("vgpu")) as daemon:
        await registered(node, 8)
        await eventually(lambda: file_reads(features, healthy), what="the feature file")
        mode = stat.S_IMODE(features.stat().st_mode)
        assert mode == 0o644, oct(mode)  # NFD's worker may run as another user
        first_inode = features.stat().st_ino
        # Polls that change nothing leave the file alone (NFD is woken by every write).
        polls = daemon.poller.last_success_wall_s
        await eventually(lambda: daemon.poller.last_success_wall_s > polls + 0.2, what="polls")
        assert features.stat().st_ino == first_inode

        # GPU 1 falls ill: its four slices leave the count; the file is replaced, not edited.
        node.write_gpus((gpu(0), gpu(1, healthy=False)))
        sick = {**healthy, "nvidia.com/vgpu.count": "4"}
        await eventually(lambda: file_reads(features, sick), what="the count without GPU 1")
        assert features.stat().st_ino != first_inode
        # Nothing but the file itself is left in the directory (no temporary file).
        assert os.listdir(features.parent) == ["vgpu"]

        node.write_gpus((gpu(0), gpu(1)))
        await eventually(lambda: file_reads(features, healthy), what="the count restored")


async def test_mixed_gpus_leave_replicas_out_and_give_the_smallest_slice(node: Node) -> None:
    features = features_dir(node) / "vgpu.features"
    # TWO_GPUS: an A100 80 GiB and an L4 24 GiB; the L4 split in 3 (8 GiB slices).
    slicing = SlicingConfig(
        overrides=(SliceOverride(GpuMatch(model="*L4*"), SliceRule(replicas=3)),)
    )
    async with running_daemon(node, labels_config("vgpu.features", slicing)):
        await registered(node, 7)
        want = {
            "nvidia.com/vgpu.count": "7",
            "nvidia.com/vgpu.memory-per-slice-mib": str(8 * 1024),
            "nvidia.com/vgpu.product": "NVIDIA-A100-SXM4-80GB",
            "nvidia.com/vgpu.mig-strategy": "none",
            "nvidia.com/vgpu.memory-enforcement": "poll",
        }
        await eventually(lambda: file_reads(features, want), what="labels for mixed GPUs")


async def test_the_memory_enforcement_label_follows_the_gpus_drivers(node: Node) -> None:
    """With memory limits on and both GPUs' drivers partitioning memory, the node reads
    `driver`; one GPU unhealthy (polled) makes it `mixed`, and back."""
    features = features_dir(node) / "vgpu"
    partitioned = [
        dataclasses.replace(gpu(i), driver_version="615.71", memory_partitions="dmem")
        for i in (0, 1)
    ]
    node.write_gpus(tuple(partitioned))
    settings = MemoryLimitSettings(
        socket=node.root / "run" / "hook.sock", cdi_dir=node.root / "cdi"
    )
    label = "nvidia.com/vgpu.memory-enforcement"

    def reads(value: str) -> bool:
        try:
            return read_labels(features).get(label) == value
        except FileNotFoundError:
            return False

    async with running_daemon(node, labels_config("vgpu"), memory_limits=settings):
        await registered(node, 8)
        await eventually(lambda: reads("driver"), what="driver-enforced")
        node.write_gpus((partitioned[0], dataclasses.replace(partitioned[1], healthy=False)))
        await eventually(lambda: reads("mixed"), what="one GPU polled")
        node.write_gpus(tuple(partitioned))
        await eventually(lambda: reads("driver"), what="driver-enforced again")


async def test_no_path_writes_no_file(node: Node) -> None:
    async with running_daemon(node, Config(enforcement=FAST)) as daemon:
        await registered(node, 8)
        assert not any(p.active for p in daemon.optional.parts if p.name == "node-labels")
    assert sorted(p.name for p in node.root.iterdir()) == ["dp", "gpus.json", "pr", "state"]


async def test_an_unwritable_directory_is_logged_and_the_daemon_serves_on(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    features_dir(node).write_text("")  # the "directory" is a file: every write fails
    features = features_dir(node) / "vgpu"
    async with running_daemon(node, labels_config("vgpu")):
        await registered(node, 8)
        await eventually(
            lambda: "cannot write the node feature file" in caplog.text, what="the warning"
        )
        assert str(features) in caplog.text


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
        ("Tesla T4", "Tesla-T4"),
        ("NVIDIA H100 80GB HBM3 (PCIe)", "NVIDIA-H100-80GB-HBM3-PCIe"),
        ("x" * 80, "x" * 63),
    ],
)
def test_a_model_name_becomes_a_valid_label_value(name: str, value: str) -> None:
    assert label_value(name) == value
