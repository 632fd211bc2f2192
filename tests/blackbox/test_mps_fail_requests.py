"""An NVIDIA file with sharing.mps and failRequestsGreaterThanOne unset (or true), or with
sharing.timeSlicing and it true: the kubelet's Allocate for a container asking for more than one
slice is refused with NVIDIA's reason, and the pod is not admitted; one slice is admitted."""

from __future__ import annotations

import dataclasses

import pytest

from deviceplugin.config import Config
from deviceplugin.sim.records import AdmissionError
from tests.blackbox.daemon_harness import FAST, Node, registered, running_daemon
from tests.blackbox.test_mps import mps_config, no_stray_control_daemon  # noqa: F401
from tests.unit.test_config_nvidia import parse


@pytest.mark.parametrize(("written", "refused"), [("", True), ("false", False)])
async def test_a_request_for_two_shared_slices_is_refused_as_nvidia_does(
    node: Node, written: str, refused: bool
) -> None:
    flag = f"failRequestsGreaterThanOne: {written}," if written else ""
    nvidia = parse(f"sharing: {{mps: {{{flag} resources: [{{name: gpu, replicas: 4}}]}}}}")
    config = dataclasses.replace(mps_config(node), allocation=nvidia.allocation)
    async with running_daemon(node, config):
        await registered(node, 8)
        if refused:
            with pytest.raises(AdmissionError) as e:
                await node.sim.admit_pod("two", [("c", 2)])
            assert (
                "request for 'nvidia.com/vgpu: 2' too large: maximum request size for shared"
                " resources is 1" in e.value.message
            )
        else:
            assert len((await node.sim.admit_pod("two", [("c", 2)])).containers[0].device_ids) == 2
        grant = (await node.sim.admit_pod("one", [("c", 1)])).containers[0]
        assert len(grant.device_ids) == 1


@pytest.mark.parametrize(("written", "refused"), [("true", True), ("", False)])
async def test_time_slicing_refuses_two_slices_only_when_fail_requests_is_true(
    node: Node, written: str, refused: bool
) -> None:
    flag = f"failRequestsGreaterThanOne: {written}," if written else ""
    nvidia = parse(f"sharing: {{timeSlicing: {{{flag} resources: [{{name: gpu, replicas: 4}}]}}}}")
    async with running_daemon(node, Config(enforcement=FAST, allocation=nvidia.allocation)):
        await registered(node, 8)
        if refused:
            with pytest.raises(AdmissionError) as e:
                await node.sim.admit_pod("two", [("c", 2)])
            assert "maximum request size for shared resources is 1" in e.value.message
        else:
            assert len((await node.sim.admit_pod("two", [("c", 2)])).containers[0].device_ids) == 2
