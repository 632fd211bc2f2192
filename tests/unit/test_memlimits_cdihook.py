"""The memory-limit hook in CDI specs (deviceplugin.memlimits.cdihook): which grants carry it,
and the device-plugin allocations' specs the runtime reads."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from deviceplugin.memlimits.cdihook import (
    DEFAULT_HOOK_PATH,
    AllocationSpecs,
    HookCommand,
    LimitHooks,
)

ENFORCED = "GPU-enforced"
POLLED = "GPU-polled"


def hooks(command: HookCommand | None = HookCommand()) -> LimitHooks:  # noqa: B008
    made = LimitHooks(command)
    made.enforced = frozenset({ENFORCED})
    return made


def test_a_grant_on_a_driver_enforced_gpu_carries_one_create_runtime_hook() -> None:
    (entry,) = hooks().for_grant("alloc-1", [POLLED, ENFORCED])
    assert entry["hookName"] == "createRuntime"  # host namespaces, before the program runs
    assert entry["path"] == DEFAULT_HOOK_PATH
    assert entry["args"] == ["vgpu-hook", "apply", "--id", "alloc-1"]
    assert entry["timeout"] > 10  # above the hook's own, which says why


def test_no_hook_on_polled_gpus_alone_or_with_memory_limits_off() -> None:
    assert hooks().for_grant("alloc-1", [POLLED]) == []
    assert hooks(None).for_grant("alloc-1", [ENFORCED]) == []


def test_a_socket_elsewhere_is_named_in_the_hooks_arguments() -> None:
    command = HookCommand("/usr/local/bin/vgpu-hook", Path("/run/other/hook.sock"))
    (entry,) = hooks(command).for_grant("alloc-1", [ENFORCED])
    assert entry["path"] == "/usr/local/bin/vgpu-hook"
    assert entry["args"][-2:] == ["--socket", "/run/other/hook.sock"]


def test_an_allocations_spec_names_its_hook_and_goes_with_it(tmp_path: Path) -> None:
    specs = AllocationSpecs(tmp_path, hooks())
    name = specs.write("abc123", [ENFORCED])
    assert name == "vgpu.dev/allocation=abc123"
    path = tmp_path / "vgpu.dev-allocation_abc123.json"
    spec = json.loads(path.read_text())
    assert spec["kind"] == "vgpu.dev/allocation"
    (device,) = spec["devices"]
    assert device["name"] == "abc123"
    assert device["containerEdits"] == {"hooks": hooks().for_grant("abc123", [ENFORCED])}
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0  # no one else may edit a hook
    assert specs.written() == ["abc123"]
    assert specs.remove({"abc123", "gone"}) == ["abc123"]
    assert not path.exists()
    assert specs.written() == []


def test_an_allocation_on_polled_gpus_gets_no_spec(tmp_path: Path) -> None:
    specs = AllocationSpecs(tmp_path, hooks())
    assert specs.write("abc123", [POLLED]) is None
    assert list(tmp_path.iterdir()) == []


def test_a_symbolic_link_at_the_specs_name_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / "vgpu.dev-allocation_abc123.json").symlink_to(outside)
    AllocationSpecs(cdi, hooks()).write("abc123", [ENFORCED])
    assert outside.read_text() == "keep"
    assert not (cdi / "vgpu.dev-allocation_abc123.json").is_symlink()
