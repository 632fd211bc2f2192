"""The demo's driver-limited container (docs/design.md §15): the demo plays the container runtime
for one pod. It makes the container's cgroup, a real one in the kubelet's cgroupfs layout under
a subtree of the cgroup v2 hierarchy that the demo owns (`/vgpu-demo-<random>/kubepods/
burstable/pod<uid>/<container id>`), places the container's process in it before that process
asks for GPU memory, and sends the daemon's hook socket what the runtime's createRuntime hook
sends, with the grant ID of the CDI device Allocate answered. The fake GPU the pod lands on
partitions memory as an R615 driver does, so the process is held at its hard limit: an ask past
it fails, nothing is killed.

That needs root and a writable cgroup v2 hierarchy; without them `DriverLimits.prepare` says in
one line why the container is left out, and the rest of the demo runs unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.gpu.fake.partitionstate import default_path, read_partitions
from deviceplugin.sim.demo_workloads import DRIVER_LIMITED_ASKS, GROW_AFTER_S, DemoWorkloads
from deviceplugin.sim.records import ContainerGrant
from deviceplugin.slicing import format_bytes

# The CDI device Allocate answers for a grant whose spec carries the hook (docs/design.md §15.7).
ALLOCATION_CDI_PREFIX = "vgpu.dev/allocation="
HOOK_TIMEOUT_S = 10.0


def cgroup2_mount(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    """Where the unified (v2) hierarchy is mounted (on a hybrid host, its `unified` mount)."""
    with contextlib.suppress(OSError):
        for line in mounts.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


def demo_subtree_name() -> str:
    """The name of the demo's own subtree, under the hierarchy's root."""
    return f"vgpu-demo-{uuid.uuid4().hex[:10]}"


def remove_tree(top: Path) -> bool:
    """Remove a cgroup subtree, deepest first (a cgroup is removed with rmdir alone, once no
    process is in it); whether it is gone."""
    if not top.is_dir():
        return True
    for path, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(path)
    return not top.exists()


@dataclass(frozen=True, slots=True)
class DriverLimits:
    """The demo-owned subtree `<mount>/<name>`; the kubelet's cgroup root as the daemon is told
    it (`--kubelet-cgroup-driver cgroupfs --kubelet-cgroup-root /<name>`)."""

    mount: Path
    name: str

    @classmethod
    def prepare(cls, name: str) -> tuple[DriverLimits | None, str]:
        """The subtree made, or None and why the driver-limited container is left out."""
        if os.geteuid() != 0:
            return None, "making a container's cgroup needs root"
        mount = cgroup2_mount()
        if mount is None:
            return None, "this machine has no cgroup v2 hierarchy"
        try:
            (mount / name).mkdir()
        except OSError as e:
            return None, f"the cgroup v2 hierarchy at {mount} is not writable ({e.strerror})"
        return cls(mount, name), ""

    @property
    def top(self) -> Path:
        return self.mount / self.name

    @property
    def root(self) -> str:
        return f"/{self.name}"

    def container_cgroup(self, pod_uid: str, container: str) -> Path:
        """The container's cgroup, made, as the runtime makes it in the kubelet's layout."""
        container_id = hashlib.sha256(f"{pod_uid}/{container}".encode()).hexdigest()
        path = self.top / "kubepods" / "burstable" / f"pod{pod_uid}" / container_id
        path.mkdir(parents=True)
        return path

    def remove(self) -> bool:
        return remove_tree(self.top)


def grant_id(container: ContainerGrant) -> str | None:
    """The grant ID of the CDI device Allocate answered for the hook; None without one."""
    for name in container.cdi_devices:
        if name.startswith(ALLOCATION_CDI_PREFIX):
            return name[len(ALLOCATION_CDI_PREFIX) :]
    return None


def place(pid: int, cgroup: Path) -> None:
    """Move the process into the cgroup, as the runtime starts a container's init there."""
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


async def hook_request(socket_path: Path, pid: int, grant: str) -> str:
    """What the runtime's createRuntime hook asks the daemon (docs/design.md §15.2); the
    daemon's one-line answer (`OK ...` or `ERR ...`)."""

    async def ask() -> str:
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            writer.write(f"VGPU-HOOK 1 apply {pid} {grant}\n".encode())
            await writer.drain()
            return (await reader.readline()).decode("utf-8", "replace").strip()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        return await asyncio.wait_for(ask(), HOOK_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        return f"ERR the daemon's hook socket did not answer: {e!r}"


class HeldAtLimit:
    """The driver-limited container in the live view: `GROW_AFTER_S` in, its process asks for
    more than its limit; once the fake driver refused the ask (a `refused` event in its file,
    `deviceplugin/gpu/fake/partitionstate.py`), what it did, once."""

    def __init__(
        self, workloads: DemoWorkloads, owner: str, pid: int, limit_bytes: int, state_file: Path
    ) -> None:
        self._workloads = workloads
        self._owner = owner
        self._pid = pid
        self._limit = limit_bytes
        self._partitions = default_path(state_file)
        self._asked = False
        self._told = False

    def tick(self, elapsed_s: float) -> list[str]:
        """The event lines due `elapsed_s` into the live view."""
        if not self._asked:
            if elapsed_s < GROW_AFTER_S:
                return []
            self._asked = True
            if self._workloads.grow(self._owner, DRIVER_LIMITED_ASKS) is None:
                return [f"{self._owner} has no running process to grow: it exited", ""]
            return [
                f"{self._owner} (pid {self._pid}) now asks for "
                f"{format_bytes(DRIVER_LIMITED_ASKS)} of GPU memory, over its "
                f"{format_bytes(self._limit)} limit",
                "",
            ]
        if self._told:
            return []
        for event in read_partitions(self._partitions).get("events", []):
            if event.get("action") == "refused" and event.get("pid") == self._pid:
                self._told = True
                return [
                    f"driver: held {self._owner} (pid {self._pid}) at its "
                    f"{format_bytes(self._limit)} hard limit: it asked for "
                    f"{format_bytes(int(event['asked_bytes']))}, got "
                    f"{format_bytes(int(event['granted_bytes']))};",
                    "  its allocation past the limit fails with out-of-memory in the process, "
                    "and nothing kills it",
                    "",
                ]
        return []
