"""Config files a careless operator could write: each is refused by check-config and serve
alike with exit 2, the key path and the bound, never a traceback or a plan the kubelet cannot
take (a device list over its 4 MiB message limit)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deviceplugin.config import SliceRule, SlicingConfig
from deviceplugin.kubelet.limits import (
    KUBELET_MAX_MESSAGE_BYTES,
    device_list_bytes,
    device_list_problem,
)
from deviceplugin.model import GpuInfo, GpuPlan, GpuReading, NodeReading
from deviceplugin.plugin.server import device_list
from deviceplugin.slicing import build_inventory, plan_gpus

CLI = [sys.executable, "-m", "deviceplugin"]
PiB = 1 << 50

BAD: dict[str, tuple[str, str]] = {
    "memoryPerSlice 1Mi": ("slicing: {memoryPerSlice: 1Mi}", "slicing.memoryPerSlice"),
    "memoryPerSlice 1": ("slicing: {memoryPerSlice: 1}", "slicing.memoryPerSlice"),
    "replicas 100000000": ("slicing: {replicas: 100000000}", "<= 1024"),
    "override replicas": (
        "slicing: {overrides: [{match: {index: 0}, replicas: 5000}]}",
        "slicing.overrides[0].replicas",
    ),
    "400-digit duration": (f"enforcement: {{pollInterval: {'9' * 400}s}}", "pollInterval"),
    "pollInterval 2m": ("enforcement: {pollInterval: 2m}", "<= 1m"),
    "gracePeriod 2h": ("enforcement: {memory: {gracePeriod: 2h}}", "gracePeriod"),
    "5000-digit integer": (f"slicing: {{replicas: {'1' * 5000}}}", "invalid YAML"),
    "nested 5000 deep": ("x: " + "[" * 5000 + "]" * 5000, "nested too deep"),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("body", "named"), BAD.values(), ids=BAD.keys())
def test_check_config_refuses_naming_the_key_and_the_bound(
    tmp_path: Path, body: str, named: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\n{body}\n")
    result = run("check-config", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert named in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) < 400


@pytest.mark.parametrize(("body", "named"), BAD.values(), ids=BAD.keys())
def test_serve_refuses_the_same_configs(tmp_path: Path, body: str, named: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\n{body}\n")
    result = run("serve", "--config", str(config), "--backend", "fake:/nonexistent")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert named in result.stderr


def big_gpus_file(tmp_path: Path, count: int = 2) -> Path:
    gpus = [
        {
            "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}",
            "index": i,
            "name": "Huge",
            "memory_total_bytes": 64 << 30,
            "minor": i,
            "numa_node": 0,
        }
        for i in range(count)
    ]
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": gpus}))
    return path


def test_a_device_list_over_the_kubelets_limit_is_refused_by_check_config_and_serve(
    tmp_path: Path,
) -> None:
    # 1024 slices per GPU (the most allowed) on 64 GPUs: about 5 MiB of device list.
    state = big_gpus_file(tmp_path, count=64)
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nslicing: {replicas: 1024}\n")
    checked = run("check-config", str(config), "--backend", f"fake:{state}")
    assert checked.returncode == 2
    assert "slicing.replicas" in checked.stderr
    assert str(KUBELET_MAX_MESSAGE_BYTES) in checked.stderr
    served = run(
        "serve", "--config", str(config), "--backend", f"fake:{state}",
        "--device-plugin-dir", str(tmp_path / "dp"), "--state-dir", str(tmp_path / "s"),
        "--metrics-address", "",
    )  # fmt: skip
    assert served.returncode == 2, served.stderr
    assert "slicing.replicas" in served.stderr
    assert "Traceback" not in served.stderr


def test_the_size_bound_is_an_upper_bound_of_the_real_message() -> None:
    gpus = [
        GpuInfo(f"GPU-00000000-0000-4000-8000-{i:012d}", i, "A100", 80 << 30, minor=i, numa_node=1)
        for i in range(4)
    ]
    cfg = SlicingConfig(default=SliceRule(replicas=1000))
    reading = NodeReading(0.0, tuple(GpuReading(g) for g in gpus))
    real = device_list(build_inventory(reading, cfg)).ByteSize()
    bound = device_list_bytes(plan_gpus(gpus, cfg))
    assert real <= bound <= real * 1.05


def test_the_size_bound_holds_per_resource_since_each_has_its_own_device_list() -> None:
    """Each resource is advertised on a ListAndWatch stream of its own (MIG mixed: one per
    profile), so two lists that each fit are not refused for their sum."""
    gpus = [
        GpuInfo(f"GPU-00000000-0000-4000-8000-{i:012d}", i, "A100", 80 << 30, minor=i, numa_node=1)
        for i in range(80)
    ]
    one_resource = [
        GpuPlan(g, 1000, 80 << 20, 0.001, resource_name="nvidia.com/vgpu") for g in gpus
    ]
    two_resources = [
        replace(plan, resource_name="nvidia.com/mig-1g.10gb") if plan.gpu.index % 2 else plan
        for plan in one_resource
    ]
    assert device_list_bytes(one_resource[::2]) < KUBELET_MAX_MESSAGE_BYTES
    assert device_list_bytes(one_resource) > KUBELET_MAX_MESSAGE_BYTES
    assert device_list_problem(two_resources, SlicingConfig()) is None
    problem = device_list_problem(one_resource, SlicingConfig())
    assert problem is not None
    assert "80000 slices of nvidia.com/vgpu" in problem
