"""The runtime hook and the daemon's memory-limit parts, put together for tests: the hook
binary compiled from deviceplugin/hook/vgpu-hook.c (once per session; skipped, with the reason,
without gcc or a static libc), and a `LimitRig` serving its socket over the fake backend, on a
hierarchy and /proc of a test's own (tests/support/cgroup_tree.py) or the real ones."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.memlimits.apply import LimitApplier
from deviceplugin.memlimits.book import LimitBook
from deviceplugin.memlimits.hookserver import HookServer
from deviceplugin.memlimits.reconcile import LimitReconciler
from deviceplugin.memlimits.record import LimitRecord
from deviceplugin.memlimits.source import LimitRefusedError
from deviceplugin.partitions import GpuLimit
from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree
from tests.support.cgroup_tree import gpu_entry

ROOT = Path(__file__).resolve().parents[2]
HOOK_SOURCE = ROOT / "deviceplugin" / "hook" / "vgpu-hook.c"
# As the Dockerfile's hook stage builds it.
HOOK_CFLAGS = ("-static", "-Os", "-s", "-std=c11", "-Wall", "-Wextra", "-Werror")


def compile_hook(directory: Path) -> Path:
    """The hook, built as the Dockerfile builds it; skips the test where it cannot be."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the runtime hook")
    binary = directory / "vgpu-hook"
    built = subprocess.run(
        [gcc, *HOOK_CFLAGS, "-o", str(binary), str(HOOK_SOURCE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if built.returncode != 0:
        if "cannot find -lc" in built.stderr:
            pytest.skip("no static C library (libc.a) to build the runtime hook")
        raise AssertionError(f"the hook does not compile:\n{built.stderr}")
    return binary


def oci_state(pid: int, **extra: Any) -> bytes:
    """The state an OCI runtime hands a createRuntime hook."""
    state = {
        "ociVersion": "1.2.0",
        "id": "c" * 64,
        "status": "creating",
        "pid": pid,
        "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/" + "c" * 64,
        "annotations": {"io.kubernetes.cri.container-type": "container"},
        **extra,
    }
    return json.dumps(state).encode()


@dataclass
class Grant:
    pod_uid: str
    limits: Mapping[str, GpuLimit]
    held: bool = True


class TableSource:
    """A LimitSource from a table: grant ID -> the pod holding it and its limits per GPU."""

    def __init__(self) -> None:
        self.grants: dict[str, Grant] = {}
        self.asked: list[tuple[str, str]] = []

    async def limits_for(self, grant_id: str, pod_uid: str) -> Mapping[str, GpuLimit]:
        self.asked.append((grant_id, pod_uid))
        grant = self.grants.get(grant_id)
        if grant is None:
            raise LimitRefusedError("no allocation or claim has this ID on this node")
        if grant.pod_uid != pod_uid:
            raise LimitRefusedError(f"it is held by pod {grant.pod_uid}, not {pod_uid}")
        return grant.limits

    async def still_holds(self, grant_id: str, pod_uid: str) -> bool:
        grant = self.grants.get(grant_id)
        return grant is not None and grant.held and grant.pod_uid == pod_uid


@dataclass(frozen=True)
class HookRun:
    returncode: int
    stderr: str


class LimitRig:
    """The daemon's memory-limit parts over a fake backend whose GPUs are `GPU-dmem`,
    `GPU-misc` and `GPU-poll` (a driver without partitions)."""

    def __init__(
        self,
        base: Path,
        hook: Path,
        *,
        cgroup_mount: Path,
        proc_root: Path,
        layout: CgroupLayout | None = None,
    ) -> None:
        self.base = base
        self.hook = hook
        self.state_file = base / "gpus.json"
        gpus = [
            gpu_entry("GPU-dmem", 0, driver_version="615.71", memory_partitions="dmem"),
            gpu_entry("GPU-misc", 1, driver_version="615.71", memory_partitions="misc"),
            gpu_entry("GPU-poll", 2, driver_version="580.95"),
        ]
        self.state_file.write_text(json.dumps({"gpus": gpus}))
        self.limits_file = base / "gpus.json.memory-limits.json"
        self.cgroup_mount = cgroup_mount
        self.proc_root = proc_root
        self.layout = layout
        self.socket = base / "run" / "hook.sock"
        self.source = TableSource()
        self.backend = FakeBackend(self.state_file, cgroup_root=cgroup_mount)
        self.start_components()

    def start_components(self) -> None:
        """The daemon's parts, as a (re)started daemon makes them, on the backend and files."""
        self.record = LimitRecord(self.base / "state", boot=lambda: "boot")
        self.record.load()
        self.book = LimitBook(self.backend, self.record, cgroup_mount=self.cgroup_mount)
        tree = KubeletTree(self.layout)
        self.applier = LimitApplier(self.book, self.source, tree, proc_root=self.proc_root)
        self.server = HookServer(self.socket, self.applier, allowed_uids={os.geteuid()})
        self.reconciler = LimitReconciler(self.book, self.source, sweep_interval_s=0.1)

    async def restart(self) -> None:
        """As a daemon killed outright and started again: new backend, record and parts, from
        what the files hold (the fake driver's limits; the state directory's record)."""
        await self.server.close()
        self.backend.close()
        self.backend = FakeBackend(self.state_file, cgroup_root=self.cgroup_mount)
        self.start_components()

    async def close(self) -> None:
        await self.server.close()
        self.backend.close()

    async def run_hook(
        self, pid: int, grant: str, *, state: bytes | None = None, timeout_ms: int = 10000
    ) -> HookRun:
        proc = await asyncio.create_subprocess_exec(
            str(self.hook),
            "apply",
            "--id",
            grant,
            "--socket",
            str(self.socket),
            "--timeout-ms",
            str(timeout_ms),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await proc.communicate(oci_state(pid) if state is None else state)
        assert proc.returncode is not None
        return HookRun(proc.returncode, stderr.decode(errors="replace"))

    def limits(self) -> dict[str, Any]:
        """The fake driver's limits file."""
        if not self.limits_file.exists():
            return {}
        content: dict[str, Any] = json.loads(self.limits_file.read_text())
        return content

    def limit_on(self, gpu: str, cgroup: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = (
            self.limits().get("gpus", {}).get(gpu, {}).get("limits", {}).get(cgroup)
        )
        return found
