"""A directory laid out like the unified cgroup hierarchy, and a /proc beside it, for tests that
need no root and no real cgroup: a cgroup is a directory with `cgroup.procs`, `cgroup.events`
and `cgroup.subtree_control` files that the test writes as the kernel would. And the fake GPUs
that take memory limits on them (`gpu_entry`)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

POD_UID = "0123abcd-0000-4000-8000-00000000000a"
GiB = 1 << 30


def container_id(name: str) -> str:
    """A runtime's container ID (64 hex digits) for a container called `name`."""
    return hashlib.sha256(name.encode()).hexdigest()


def leaf_of(name: str, pod_uid: str = POD_UID, qos: str = "burstable") -> str:
    """The cgroup the kubelet (cgroupfs driver, root "/") gives container `name` of a pod."""
    return f"/kubepods/{qos}/pod{pod_uid}/{container_id(name)}"


class Hierarchy:
    """`root` stands for /sys/fs/cgroup and `proc` for /proc."""

    def __init__(self, base: Path) -> None:
        self.root = base / "cgroup"
        self.proc = base / "proc"
        self.root.mkdir(parents=True)
        self.proc.mkdir()
        self.enable_dmem("/")

    def path(self, cgroup: str) -> Path:
        return self.root / cgroup.lstrip("/")

    def mkdir(self, cgroup: str, *, procs: Iterable[int] = (), dmem: bool = True) -> Path:
        """Make `cgroup` and its parents; each made one enables dmem for its children unless
        `dmem` is False. `procs` are listed in it (populated)."""
        parts = [p for p in cgroup.split("/") if p]
        for n in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:n])
            directory = self.path(sub)
            if not directory.exists():
                directory.mkdir()
                (directory / "cgroup.procs").write_text("")
                self.set_populated(sub, False)
                if dmem:
                    self.enable_dmem(sub)
                else:
                    (directory / "cgroup.subtree_control").write_text("cpu memory\n")
        pids = list(procs)
        if pids:
            (self.path(cgroup) / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
            self.set_populated(cgroup, True)
        return self.path(cgroup)

    def enable_dmem(self, cgroup: str) -> None:
        (self.path(cgroup) / "cgroup.subtree_control").write_text("cpu memory dmem\n")

    def set_populated(self, cgroup: str, populated: bool) -> None:
        (self.path(cgroup) / "cgroup.events").write_text(f"populated {int(populated)}\nfrozen 0\n")

    def remove(self, cgroup: str) -> None:
        shutil.rmtree(self.path(cgroup))

    def process(self, pid: int, cgroup_file: str) -> None:
        """Process `pid` in the fake /proc, with this content for its cgroup file."""
        directory = self.proc / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "cgroup").write_text(cgroup_file)

    def container(self, pid: int, cgroup: str) -> None:
        """Process `pid` as a container's init: in `cgroup` (made), on a hybrid host."""
        self.mkdir(cgroup, procs=[pid])
        self.process(pid, f"12:memory:/kubepods\n1:name=systemd:/\n0::{cgroup}\n")


def gpu_entry(uuid: str, index: int, **extra: Any) -> dict[str, Any]:
    """A fake state file's GPU: an H200 at `index`, with `extra` keys."""
    return {
        "uuid": uuid,
        "index": index,
        "name": "NVIDIA H200",
        "memory_total_bytes": 141 * GiB,
        "minor": index,
        **extra,
    }
