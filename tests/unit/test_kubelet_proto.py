"""The generated code is current, and the wire names match what the kubelet speaks."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deviceplugin.kubelet.proto import dp, podres

ROOT = Path(__file__).resolve().parents[2]


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_stale_check_notices_an_edited_proto(tmp_path: Path) -> None:
    gen = _gen_protos()
    gen.generate(tmp_path)
    fresh = tmp_path / "deviceplugin" / "_proto"
    assert gen.stale_files(gen.OUT, fresh) == []
    target = fresh / "deviceplugin" / "v1beta1" / "api_pb2.py"
    target.write_text(target.read_text() + "\n# edited\n")
    (fresh / "extra.py").write_text("")
    assert gen.stale_files(gen.OUT, fresh) == [
        "deviceplugin/v1beta1/api_pb2.py",
        "extra.py",
    ]
    shutil.rmtree(fresh)


@pytest.mark.parametrize(
    ("descriptor", "service", "methods"),
    [
        (dp.DESCRIPTOR, "v1beta1.Registration", ["Register"]),
        (
            dp.DESCRIPTOR,
            "v1beta1.DevicePlugin",
            [
                "GetDevicePluginOptions",
                "ListAndWatch",
                "GetPreferredAllocation",
                "Allocate",
                "PreStartContainer",
            ],
        ),
        (
            podres.DESCRIPTOR,
            "v1.PodResourcesLister",
            ["List", "GetAllocatableResources", "Get"],
        ),
    ],
)
def test_service_and_method_names_match_the_kubelet(
    descriptor: object, service: str, methods: list[str]
) -> None:
    pool_service = dp.DESCRIPTOR.pool.FindServiceByName(service)
    assert [m.name for m in pool_service.methods] == methods


# (message, field, number) as in k8s.io/kubelet/pkg/apis/{deviceplugin/v1beta1,podresources/v1}.
WIRE_FIELDS = [
    ("v1beta1.RegisterRequest", "version", 1),
    ("v1beta1.RegisterRequest", "endpoint", 2),
    ("v1beta1.RegisterRequest", "resource_name", 3),
    ("v1beta1.RegisterRequest", "options", 4),
    ("v1beta1.DevicePluginOptions", "pre_start_required", 1),
    ("v1beta1.DevicePluginOptions", "get_preferred_allocation_available", 2),
    ("v1beta1.Device", "ID", 1),
    ("v1beta1.Device", "health", 2),
    ("v1beta1.Device", "topology", 3),
    ("v1beta1.NUMANode", "ID", 1),
    ("v1beta1.ContainerPreferredAllocationRequest", "available_deviceIDs", 1),
    ("v1beta1.ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2),
    ("v1beta1.ContainerPreferredAllocationRequest", "allocation_size", 3),
    ("v1beta1.ContainerPreferredAllocationResponse", "deviceIDs", 1),
    ("v1beta1.ContainerAllocateRequest", "devices_ids", 1),
    ("v1beta1.ContainerAllocateResponse", "envs", 1),
    ("v1beta1.ContainerAllocateResponse", "mounts", 2),
    ("v1beta1.ContainerAllocateResponse", "devices", 3),
    ("v1beta1.ContainerAllocateResponse", "annotations", 4),
    ("v1beta1.ContainerAllocateResponse", "cdi_devices", 5),
    ("v1beta1.Mount", "read_only", 3),
    ("v1beta1.DeviceSpec", "permissions", 3),
    ("v1beta1.PreStartContainerRequest", "devices_ids", 1),
    ("v1.PodResources", "name", 1),
    ("v1.PodResources", "namespace", 2),
    ("v1.PodResources", "containers", 3),
    ("v1.ContainerResources", "devices", 2),
    ("v1.ContainerResources", "dynamic_resources", 5),
    ("v1.ContainerDevices", "resource_name", 1),
    ("v1.ContainerDevices", "device_ids", 2),
    ("v1.ContainerDevices", "topology", 3),
    ("v1.AllocatableResourcesResponse", "devices", 1),
    ("v1.GetPodResourcesRequest", "pod_name", 1),
    ("v1.GetPodResourcesRequest", "pod_namespace", 2),
    ("v1.DynamicResource", "claim_name", 2),
    ("v1.ClaimResource", "device_name", 4),
]


@pytest.mark.parametrize(("message", "field", "number"), WIRE_FIELDS)
def test_field_numbers_match_the_kubelet(message: str, field: str, number: int) -> None:
    descriptor = dp.DESCRIPTOR.pool.FindMessageTypeByName(message)
    assert descriptor.fields_by_name[field].number == number
