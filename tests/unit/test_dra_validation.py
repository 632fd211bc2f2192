"""The API server's rules for a ResourceSlice, as the driver checks them before writing one:
each rule, broken on its own, is reported on the field the API server names."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from deviceplugin.dra.validation import request_policy_errors, slice_errors

GIB = 1 << 30
MIB = 1 << 20


def _slice(**device: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "gpu-0",
        "attributes": {"uuid": {"string": "GPU-0"}, "index": {"int": 0}},
        "capacity": {
            "memory": {
                "value": str(40 * GIB),
                "requestPolicy": {
                    "default": str(10 * GIB),
                    "validRange": {
                        "min": str(256 * MIB),
                        "max": str(40 * GIB),
                        "step": str(256 * MIB),
                    },
                },
            },
        },
        "allowMultipleAllocations": True,
    }
    base.update(device)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-1-vgpu.dev"},
        "spec": {
            "driver": "vgpu.dev",
            "nodeName": "node-1",
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "devices": [base],
        },
    }


def _fields(obj: dict[str, Any]) -> list[str]:
    return [e.field for e in slice_errors(obj)]


def test_a_slice_within_every_rule_has_no_error() -> None:
    assert slice_errors(_slice()) == []


POLICY = "spec.devices[0].capacity[memory].requestPolicy"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        # The range's max off the step grid: what NVML's 23034Mi for an L4 used to publish.
        ({"max": str(23034 * MIB)}, f"{POLICY}.validRange.step", "not a multiple of a given step"),
        ({"default": str(10 * GIB + MIB)}, f"{POLICY}.validRange.step", "not a multiple"),
        ({"min": str(41 * GIB)}, f"{POLICY}.validRange.min", "min is larger than capacity"),
        ({"default": str(128 * MIB)}, f"{POLICY}.validRange.min", "default is less than min"),
        ({"max": str(48 * GIB)}, f"{POLICY}.validRange.max", "max is larger than capacity"),
        ({"default": str(40 * GIB), "max": str(20 * GIB)}, f"{POLICY}.validRange.max",
         "default is more than max"),
        ({"step": str(40 * GIB)}, f"{POLICY}.validRange.step", "one step"),
        ({"default": None}, f"{POLICY}.default", "Required"),
        ({"min": None}, f"{POLICY}.validRange.min", "Required"),
    ],
)  # fmt: skip
def test_each_request_policy_rule_is_reported_on_its_field(
    change: dict[str, str | None], field: str, words: str
) -> None:
    obj = _slice()
    policy = obj["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    for key, value in change.items():
        target = policy if key == "default" else policy["validRange"]
        if value is None:
            del target[key]
        else:
            target[key] = value
    errors = slice_errors(obj)
    assert field in [e.field for e in errors], errors
    assert any(words in e.detail for e in errors if e.field == field), errors


def test_the_rules_match_the_api_servers_arithmetic() -> None:
    # Mirrors validateRequestPolicyRange: a value v is on the grid when (v - min) % step == 0.
    valid_range = {"min": "2", "max": "12", "step": "5"}
    policy: dict[str, Any] = {"default": "7", "validRange": valid_range}
    assert request_policy_errors(12, policy, "p") == []
    valid_range["max"] = "11"
    assert [e.field for e in request_policy_errors(12, policy, "p")] == ["p.validRange.step"]
    # min + one step may equal the capacity, not exceed it.
    no_max = {"default": "2", "validRange": {"min": "2", "step": "5"}}
    assert request_policy_errors(7, no_max, "p") == []
    assert [e.field for e in request_policy_errors(6, no_max, "p")] == ["p.validRange.step"]


def test_a_request_policy_needs_a_shared_device() -> None:
    obj = _slice(allowMultipleAllocations=False)
    assert _fields(obj) == [f"{POLICY}"]
    assert "allowMultipleAllocations must be true" in str(slice_errors(obj)[0])


def test_names_and_values_are_checked_as_the_api_server_does() -> None:
    assert _fields(_slice(name="GPU_0")) == ["spec.devices[0].name"]
    long = {"productName": {"string": "x" * 65}}
    assert _fields(_slice(attributes=long)) == ["spec.devices[0].attributes[productName].string"]
    assert _fields(_slice(attributes={"9lives": {"int": 1}})) == [
        "spec.devices[0].attributes[9lives]"
    ]
    assert _fields(_slice(attributes={"two": {"int": 1, "string": "1"}})) == [
        "spec.devices[0].attributes[two]"
    ]
    many = {f"a{i}": {"int": i} for i in range(32)}
    assert _fields(_slice(attributes=many)) == ["spec.devices[0]"]
    obj = _slice()
    obj["spec"]["driver"] = "9" * 64
    assert _fields(obj) == ["spec.driver"]


def test_taints_and_the_device_count() -> None:
    bad = [{"key": "vgpu.dev/unhealthy", "effect": "Sometimes"}]
    assert _fields(_slice(taints=bad)) == ["spec.devices[0].taints[0].effect"]
    assert _fields(_slice(taints=[{"key": "", "effect": "NoSchedule"}])) == [
        "spec.devices[0].taints[0].key"
    ]
    obj = _slice()
    device = obj["spec"]["devices"][0]
    obj["spec"]["devices"] = [dict(copy.deepcopy(device), name=f"gpu-{i}") for i in range(128)]
    assert slice_errors(obj) == []
    obj["spec"]["devices"][0]["taints"] = [{"key": "vgpu.dev/unhealthy", "effect": "NoSchedule"}]
    # With a taint on one device, a slice holds at most 64.
    assert _fields(obj) == ["spec.devices"]
    obj["spec"]["devices"] = [dict(copy.deepcopy(device), name="gpu-0")] * 2
    assert _fields(obj) == ["spec.devices[1].name"]
