"""Applying a container's GPU memory limits when its runtime hook asks (docs/design.md §15).

The hook names a process (the container's init, created and not yet started) and a grant (the
allocation or claim ID its CDI spec was written with). The applier:
1. resolves the container from `/proc/<pid>/cgroup` alone (`usage.cgroups.container_leaf`: one
   unified line, a plain path, exactly a container's cgroup in the kubelet's layout), and checks
   that cgroup's directory under the mount, reached without a symbolic link, lists the process;
2. asks the `LimitSource` what the grant gives that container per GPU (the source checks that
   the container's pod holds the grant; nothing comes from the container's environment or
   annotations);
3. adds the grant to the container's record and, per GPU whose driver partitions memory, sets
   the sum of the container's grants there (several devices of one container each run a hook),
   recording the limit before the driver is called and the time once it returned.
A GPU whose memory is polled takes no limit: it is named in the answer, and polling enforces it.
Any refusal or failure raises ApplyError with the reason the hook prints; the container is then
not started.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.errors import MemoryLimitError
from deviceplugin.memlimits.book import CallTimeoutError, LimitBook
from deviceplugin.memlimits.record import AppliedLimit, GrantLimits, LeafRecord
from deviceplugin.memlimits.source import LimitRefusedError, LimitSource
from deviceplugin.partitions import GpuLimit, PartitionMode, PartitionSupport
from deviceplugin.safefs import open_directory
from deviceplugin.usage.cgroups import (
    KubeletTree,
    LeafRefusedError,
    PodContainer,
    container_leaf,
    pods_root,
)

log = logging.getLogger(__name__)

_MAX_CGROUP_FILE_BYTES = 64 << 10
_MAX_PROCS_BYTES = 1 << 20


class ApplyError(Exception):
    """The limits could not be applied: `action` is "refused" (nothing was promised or the
    request is not valid) or "failed" (a promised limit could not be set)."""

    def __init__(self, action: str, reason: str) -> None:
        self.action = action
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    """What a hook's request set: the container, per GPU the limits applied (mode), and the
    GPUs left to polling with the reason."""

    container: PodContainer
    applied: tuple[tuple[str, GpuLimit, PartitionMode], ...]
    polled: tuple[tuple[str, str], ...]

    def summary(self) -> str:
        parts = [
            f"{uuid} soft={limit.soft_bytes} hard={limit.hard_bytes} {mode.value}"
            for uuid, limit, mode in self.applied
        ]
        parts += [f"{uuid} polled ({why})" for uuid, why in self.polled]
        return "; ".join(parts) or "no GPU memory to limit"


class LimitApplier:
    """Applies what a hook asks; see the module docstring. `proc_root` is /proc (a test's fake
    one)."""

    def __init__(
        self,
        book: LimitBook,
        source: LimitSource,
        tree: KubeletTree,
        *,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.book = book
        self.source = source
        self.tree = tree
        self.proc_root = proc_root

    def resolve(self, pid: int) -> PodContainer:
        """The container whose init `pid` is; ApplyError("refused") naming what is wrong."""
        try:
            with open(self.proc_root / str(pid) / "cgroup", "rb") as f:
                content = f.read(_MAX_CGROUP_FILE_BYTES + 1)
        except OSError as e:
            raise ApplyError("refused", f"process {pid} cannot be read: {e.strerror or e}") from e
        if len(content) > _MAX_CGROUP_FILE_BYTES:
            raise ApplyError("refused", f"process {pid}'s cgroup file is too long")
        try:
            container = container_leaf(self.tree, content)
        except LeafRefusedError as e:
            raise ApplyError("refused", f"process {pid}'s cgroup: {e}") from e
        if pods_root(container.cgroup) is None:
            raise ApplyError("refused", f"{container.cgroup} is under no kubepods cgroup")
        self._check_member(pid, container.cgroup)
        return container

    def _check_member(self, pid: int, cgroup: str) -> None:
        """The cgroup's directory, reached without a symbolic link, lists the process."""
        path = f"{self.book.cgroup_mount}{cgroup}"
        try:
            directory = open_directory(path, create=False)
        except OSError as e:
            raise ApplyError("refused", f"cgroup {cgroup} cannot be opened: {e}") from e
        try:
            fd = os.open("cgroup.procs", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory.fd)
            with os.fdopen(fd, "rb") as f:
                members = f.read(_MAX_PROCS_BYTES).split()
        except OSError as e:
            raise ApplyError("refused", f"cgroup {cgroup} lists no processes: {e}") from e
        finally:
            os.close(directory.fd)
        if str(pid).encode() not in members:
            raise ApplyError("refused", f"process {pid} is not in {cgroup}")

    async def apply(self, pid: int, grant_id: str) -> ApplyOutcome:
        container = self.resolve(pid)
        try:
            limits = dict(await self.source.limits_for(grant_id, container.pod_uid))
        except LimitRefusedError as e:
            raise ApplyError("refused", f"grant {grant_id}: {e}") from e
        support = await self.book.call("memory_partitioning", self.book.backend.memory_partitioning)
        async with self.book.lock:
            return await self._apply_locked(container, grant_id, limits, support)

    async def _apply_locked(
        self,
        container: PodContainer,
        grant_id: str,
        limits: dict[str, GpuLimit],
        support: Mapping[str, PartitionSupport],
    ) -> ApplyOutcome:
        book = self.book
        top = pods_root(container.cgroup)
        assert top is not None
        leaf = book.record.get(container.cgroup) or LeafRecord(
            container.cgroup, top, container.pod_uid, container.container_id
        )
        leaf = leaf.with_grant(GrantLimits(grant_id, tuple(sorted(limits.items()))))
        applied: list[tuple[str, GpuLimit, PartitionMode]] = []
        polled: list[tuple[str, str]] = []
        to_set: list[tuple[str, GpuLimit, PartitionMode, AppliedLimit | None]] = []
        for uuid, total in sorted(leaf.totals().items()):
            gpu = support.get(uuid)
            if gpu is None or not gpu.enforced:
                polled.append((uuid, gpu.reason if gpu else "its memory partitions are unknown"))
                continue
            before = leaf.applied_on(uuid)
            if before is not None and before.limit == total and before.set_at_s is not None:
                applied.append((uuid, total, before.mode))  # set by an earlier hook
                continue
            to_set.append((uuid, total, gpu.mode, before))
            leaf = leaf.with_applied(AppliedLimit(uuid, total, gpu.mode, None))
        # Recorded before the driver is called: a limit it may hold is never missing.
        book.record.put(leaf)
        book.save()
        for n, (uuid, total, mode, _) in enumerate(to_set):
            try:
                await book.call(
                    f"setting the memory limit of {container.cgroup} on {uuid}",
                    book.backend.set_memory_limits,
                    uuid,
                    container.cgroup,
                    total.soft_bytes,
                    total.hard_bytes,
                )
            except MemoryLimitError as e:
                # Refused: the driver holds what it held, here and on the GPUs not yet tried; a
                # call that timed out may have been done, and stays recorded for the clean-up.
                failed = [] if isinstance(e, CallTimeoutError) else to_set[n : n + 1]
                for untried, _, _, was in failed + to_set[n + 1 :]:
                    leaf = _without_applied(leaf, untried, was)
                book.record.put(leaf)
                book.save()
                book.container_action("failed", container, uuid, total, reason=repr(str(e)))
                raise ApplyError("failed", str(e)) from e
            leaf = leaf.with_applied(AppliedLimit(uuid, total, mode, book.wall_clock()))
            applied.append((uuid, total, mode))
            book.container_action("set", container, uuid, total, mode=mode.value, grant=grant_id)
        if to_set:
            book.record.put(leaf)
            book.save()
        return ApplyOutcome(container, tuple(applied), tuple(polled))


def _without_applied(leaf: LeafRecord, uuid: str, before: AppliedLimit | None) -> LeafRecord:
    if before is not None:
        return leaf.with_applied(before)
    return LeafRecord(
        leaf.cgroup,
        leaf.pods_root,
        leaf.pod_uid,
        leaf.container_id,
        leaf.grants,
        tuple(a for a in leaf.applied if a.gpu_uuid != uuid),
    )
