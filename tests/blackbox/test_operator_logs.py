"""The log lines an operator reads (daemonset/README.md, "Troubleshooting"), in both modes: an
unhealthy GPU is one line with its index, UUID and reason; a DRA driver's start speaks DRA."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from tests.blackbox.daemon_harness import Node, eventually, gpu, running_daemon
from tests.blackbox.test_dra import _dra, _register, dra_daemon
from tests.support.fake_apiserver import FakeApiServer

GPU0 = gpu(0, name="NVIDIA A100-PCIE-40GB", memory_gib=40)
GPU1 = gpu(1, name="NVIDIA L4", memory_gib=24)
XID = "Xid 79 (GPU has fallen off the bus)"


@pytest.fixture
def dra_node(short_tmp: Path) -> Node:
    return Node(short_tmp, [GPU0, GPU1])


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def _about_gpu1(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The WARNING and ERROR lines that name GPU 1 as unhealthy."""
    return [m for m in _lines(caplog, logging.WARNING) if "unhealthy" in m and GPU1.uuid in m]


async def test_an_unhealthy_gpu_is_one_line_with_index_uuid_and_reason_as_a_device_plugin(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node.write_gpus([GPU0, GPU1])
    async with running_daemon(node):
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids("nvidia.com/vgpu")) == 8, 10)
        bad = dataclasses.replace(GPU1, healthy=False, health_reason=XID)
        node.write_gpus([GPU0, bad])
        await node.sim.wait_for(lambda: len(node.sim.healthy_ids("nvidia.com/vgpu")) == 4, 10)
        await eventually(lambda: bool(_about_gpu1(caplog)), what="the line")
        (line,) = _about_gpu1(caplog)
        assert line == f"gpu unhealthy index=1 uuid={GPU1.uuid} reason={XID!r}"
        node.write_gpus([GPU0, GPU1])
        await eventually(
            lambda: f"gpu healthy again index=1 uuid={GPU1.uuid}" in _lines(caplog),
            what="the recovery line",
        )
        assert len(_about_gpu1(caplog)) == 1


async def test_an_unhealthy_gpu_is_one_line_with_index_uuid_and_reason_as_a_dra_driver(
    dra_node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with dra_daemon(dra_node, api):
        await _register(_dra(dra_node, api))
        await eventually(lambda: len(api.slice_list()) == 1, 10, "the slice")
        dra_node.write_gpus([GPU0, dataclasses.replace(GPU1, healthy=False, health_reason=XID)])

        def tainted() -> bool:
            return "taints" in api.slice_list()[0]["spec"]["devices"][1]

        await eventually(tainted, 10, "the device tainted")
        await eventually(lambda: bool(_about_gpu1(caplog)), what="the line")
        (line,) = _about_gpu1(caplog)
        assert line == f"gpu unhealthy index=1 uuid={GPU1.uuid} reason={XID!r}"


async def test_a_dra_driver_starts_speaking_dra(
    dra_node: Node, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with dra_daemon(dra_node, api):
        await _register(_dra(dra_node, api))
        await eventually(lambda: len(api.slice_list()) == 1, 10, "the slice")
    lines = _lines(caplog)
    start = next(m for m in lines if m.startswith("starting vgpu"))
    assert start.startswith("starting vgpu DRA driver ")
    assert "driver=vgpu.dev" in start
    assert f"kubelet_root_dir={dra_node.root / 'kubelet'}" in start
    assert f"gpu published as DRA device gpu-1 index=1 uuid={GPU1.uuid}" in "\n".join(lines)
    # Nothing of the device plugin's: no resource, slices, device checkpoint or its tracker.
    for line in lines:
        for words in (
            "device plugin",
            "resource=",
            "slices=",
            "device checkpoint",
            "pod-resources API",
        ):
            assert words not in line, line
