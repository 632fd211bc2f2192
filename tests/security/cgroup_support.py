"""Real cgroups for the security suite: a subtree owned by one test under a real hierarchy,
real processes placed in it, all removed afterwards."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def cid(name: str) -> str:
    """A container runtime ID (64 hex digits) for a container called `name` in a test."""
    return hashlib.sha256(name.encode()).hexdigest()


def _hierarchy(version: int) -> tuple[Path | None, str]:
    """A writable hierarchy of cgroup `version` on this machine, or why there is none."""
    if os.geteuid() != 0:
        return None, "creating cgroups needs root"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            wanted = fields[2] == "cgroup2" if version == 2 else fields[2] == "cgroup"
            if not wanted or (version == 1 and "pids" not in fields[3].split(",")):
                continue
            probe = Path(fields[1]) / f"vgpu-probe-{uuid.uuid4().hex[:8]}"
            try:
                probe.mkdir()
                probe.rmdir()
            except OSError:
                continue
            return Path(fields[1]), ""
    return None, f"no writable cgroup v{version} hierarchy"


class Subtree:
    """`/<name>` under one hierarchy, made by and for one test."""

    def __init__(self, hierarchy: Path) -> None:
        self.hierarchy = hierarchy
        self.name = f"/vgpu-test-{uuid.uuid4().hex[:10]}"
        self.made: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir(self.name)

    def dir(self, path: str) -> Path:
        """Make `path` (from the hierarchy's root, inside this subtree) and its parents."""
        assert path.startswith(self.name)
        parts = Path(path.lstrip("/")).parts
        for n in range(1, len(parts) + 1):
            d = self.hierarchy.joinpath(*parts[:n])
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        return self.hierarchy / path.lstrip("/")

    def spawn(self, path: str, envs: dict[str, str] | None = None, *argv: str) -> int:
        """A process that moved itself into cgroup `path` before exec (of `argv`, or a sleep)."""
        procs = self.dir(path) / "cgroup.procs"
        command = " ".join(argv) if argv else "sleep 300"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(envs or {})}
        proc = subprocess.Popen(["sh", "-c", f'echo $$ > "{procs}" && exec {command}'], env=env)
        self.procs.append(proc)
        deadline = time.monotonic() + 5
        while path not in _cgroup_of(proc.pid):
            assert time.monotonic() < deadline, f"process {proc.pid} never reached {path}"
            time.sleep(0.01)
        return proc.pid

    def move(self, pid: int, path: str) -> None:
        (self.dir(path) / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
        for d in reversed(self.made):
            deadline = time.monotonic() + 5
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)


def _cgroup_of(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cgroup").read_text()
    return ""


@contextlib.contextmanager
def subtree(version: int) -> Iterator[Subtree]:
    hierarchy, reason = _hierarchy(version)
    if hierarchy is None:
        pytest.skip(reason)
    tree = Subtree(hierarchy)
    try:
        yield tree
    finally:
        tree.close()
