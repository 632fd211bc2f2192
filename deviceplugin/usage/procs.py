"""Which allocation a GPU process names (its allocation tag) and which pod it runs in, read from
/proc; whether the
daemon sees host PIDs.

Allocate gives every container `VGPU_ALLOCATION_ID`, and `VGPU_ALLOCATION_ID_<suffix>` per device
(docs/design.md §3): a container holding slices of several resources keeps one `VGPU_ALLOCATION_ID`
of them, so for a process on device U its tag is `VGPU_ALLOCATION_ID_<U>` where set (the
resolver returns `DeviceTags` for `usage.charges` to pick from per device). The GPU driver lists
processes by host PID, so the daemon reads `/proc/<pid>/environ` of each GPU process for those
variables, and falls back to the nearest ancestor that sets one (a process started with a cleared
environment still belongs to the container that started it). Nothing else from a process
environment is kept, returned or logged: it may hold secrets.

That variable is only a tag: any process can set it, and the ID is predictable. So the daemon
also reads where the process runs, which it cannot choose: `/proc/<pid>/cgroup` gives the pod
container it is in, only when that cgroup is where the kubelet puts a pod's containers
(`usage.cgroups`: its pod UID, container runtime ID and container cgroup), and the kubelet's
container log links (`usage.containerlogs`) name that container. `usage.attribution` checks the
tag against the kubelet's device checkpoint with them (docs/design.md §12): a tag stands
only from the container the checkpoint gives that allocation (from its pod, where the kubelet's
container names cannot be read); a tag from a host process or from another pod or container
is refused; without a readable checkpoint every tag stands.

The /proc readers, pidfds and the host-PID check are `usage.procfs`. Everything is read under an
injected `proc_root`, so tests use a fake tree in a temporary directory.

On the real /proc, every resolved process is also held by a pidfd (Linux 5.3+): a pidfd refers to
one process, never to a later one that reuses its PID, and turns readable when that process exits.
One poll(2) over all of them then tells which cached processes are still the same, where a stat of
each one's /proc entry would cost a system call per process and poll. Where a pidfd cannot be had
(an older kernel, too few file descriptors) that process is checked by its stat file as before.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.usage.cgroups import CgroupLayout, KubeletTree, PodContainer, kubelet_tree_of
from deviceplugin.usage.containerlogs import (
    DEFAULT_CONTAINER_LOG_DIR,
    ContainerLogIndex,
    ContainerNames,
)
from deviceplugin.usage.procfs import (
    ENV_NAME,
    PidfdWatch,
    pid_namespace_warning,
    read_all,
    tags_in,
)
from deviceplugin.usage.tags import Tag

__all__ = [
    "ENV_NAME",
    "AllocationResolver",
    "pid_namespace_warning",
    "pod_cgroup",
    "pod_uid_in_cgroup",
]


# Fields of /proc/<pid>/stat counted after the ")" that closes the command name: field 3 (the run
# state) is index 0 there, so field 4 (ppid) is index 1 and field 22 (start time) is index 19.
_PPID_FIELD = 1
_START_TIME_FIELD = 19


class _GoneError(Exception):
    """The process exited, or its /proc entry cannot be read right now: try again next call."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """A resolved process.

    `identity` is the (inode, ctime) of its stat file when that file is a procfs one (size 0):
    procfs gives every process its own inodes, so an unchanged identity proves the same process
    without reading the file again. `settled` is False after a first look found the process's own
    environment empty: that is a process started with a cleared environment, or one caught in the
    middle of exec (the kernel shows the new environment only once the new program is mapped), so
    the next call looks again before the answer is served from the cache."""

    start_time: int
    allocation_id: Tag
    identity: tuple[int, int] | None
    settled: bool = True
    pod_uid: str | None = None
    cgroup: str | None = None
    container_id: str | None = None


_DEFAULT_TREE = KubeletTree()


def pod_uid_in_cgroup(content: bytes, tree: KubeletTree = _DEFAULT_TREE) -> str | None:
    """The pod UID (lowercase, with dashes) in the content of `/proc/<pid>/cgroup`; None when the
    process is in no pod container's cgroup (see `usage.cgroups`)."""
    found = tree.container_of(content)
    return None if found is None else found.pod_uid


def pod_cgroup(content: bytes, tree: KubeletTree = _DEFAULT_TREE) -> tuple[str, str] | None:
    """The pod UID in the content of `/proc/<pid>/cgroup`, and the cgroup of its container (the
    kubelet's, from the hierarchy's root: processes with the same one share their container);
    None when the process is in no pod container's cgroup (see `usage.cgroups`)."""
    found = tree.container_of(content)
    return None if found is None else (found.pod_uid, found.cgroup)


class _Default:
    """The default of an argument whose None means "none"."""


_DEFAULT = _Default()


class AllocationResolver:
    """Maps GPU process PIDs to the allocation IDs found in their (or an ancestor's) environment,
    and knows the pod each of them runs in.

    Results are cached per (pid, start time), so a recycled PID is resolved afresh; the cache holds
    only the PIDs of the latest call. `hits` and `misses` count the PIDs served from the cache and
    those resolved afresh. An allocation ID found here is a tag, not a proof: `pod_uid_of` gives
    what `usage.attribute` checks it against."""

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        *,
        max_ancestors: int = 16,
        tree: KubeletTree | None = None,
        layout: CgroupLayout | None = None,
        container_logs: ContainerLogIndex | _Default | None = _DEFAULT,
    ) -> None:
        if max_ancestors < 0:
            raise ValueError(f"max_ancestors must be >= 0, got {max_ancestors}")
        self._root = str(proc_root)
        self._max_ancestors = max_ancestors
        self._cache: dict[int, _Entry] = {}
        real = os.path.realpath(proc_root) == "/proc"
        # Only the real /proc names real processes to hold.
        self._pidfds = PidfdWatch() if real else None
        # The kubelet's layout; on the real /proc, paths relative to this process's cgroup
        # namespace are resolved when its root can be found, and refused otherwise.
        if tree is None:
            tree = kubelet_tree_of(proc_root, layout) if real else KubeletTree(layout)
        self.tree = tree
        if isinstance(container_logs, _Default):
            container_logs = ContainerLogIndex(DEFAULT_CONTAINER_LOG_DIR) if real else None
        self._container_logs = container_logs
        self._containers: ContainerNames | None = None
        self.hits = 0
        self.misses = 0
        # Bumped by every `resolve` that changed an answer of `pod_uid_of` or `cgroup_of` (or of
        # the tags it returns): a PID resolved afresh, or one no longer held.
        self.generation = 0
        # The last call's answers, and whether every PID in it was served from the cache, held
        # by a pidfd: then the same PIDs again, none exited, get the same answers at once.
        self._found: dict[int, Tag] = {}
        self._held_all = False

    @property
    def pidfds(self) -> int:
        """How many resolved processes are held by a pidfd."""
        return 0 if self._pidfds is None else len(self._pidfds)

    def close(self) -> None:
        """Release the pidfds; the cache empties, so a later call resolves afresh."""
        if self._pidfds is not None:
            self._pidfds.close()
        self._cache = {}
        self._held_all = False
        self.generation += 1

    def __len__(self) -> int:
        """How many PIDs the cache holds."""
        return len(self._cache)

    def resolve(self, pids: Iterable[int]) -> dict[int, Tag]:
        """The allocation tag of each PID: its allocation ID, `DeviceTags` where its environment
        sets per-device keys, or None: not found, or not readable now (a vanished or unreadable
        process is not cached, so that the next call tries again)."""
        if self._container_logs is not None:
            containers = self._container_logs.read()
            if containers is not self._containers:
                self._containers = containers
                self.generation += 1
        previous = self._cache
        fresh: dict[int, _Entry] = {}
        found: dict[int, Tag] = {}
        # Ancestors resolved during this call, shared by siblings.
        memo: dict[int, Tag] = {}
        watch = self._pidfds
        exited = watch.exited() if watch is not None else set()
        wanted = pids if isinstance(pids, (set, frozenset)) else None
        if not exited and self._held_all and wanted is not None and wanted == previous.keys():
            # The same PIDs as the last call, every one settled and held by a pidfd that is not
            # readable: the very processes, the same answers (a steady node, most polls).
            self.hits += len(previous)
            return dict(self._found)
        changed = False
        held_all = watch is not None
        for pid in exited:
            # Gone, or its PID already taken by another process: resolved afresh below.
            if watch is not None:
                watch.drop(pid)
            previous.pop(pid, None)
        for pid in pids:
            if pid in found:
                continue
            cached = previous.get(pid)
            if cached is not None and cached.settled and watch is not None and pid in watch:
                # Held by a pidfd that is not readable: the very process resolved before.
                self.hits += 1
                fresh[pid] = cached
                found[pid] = cached.allocation_id
                continue
            held_all = False
            found[pid] = None
            if pid <= 0:
                continue
            try:
                entry, hit = self._lookup(pid, cached, memo)
                if watch is not None and pid not in watch:
                    entry = self._hold(watch, pid, entry)
            except _GoneError:
                self.misses += 1
                continue
            if hit:
                self.hits += 1
            else:
                self.misses += 1
            changed = changed or entry is not cached
            fresh[pid] = entry
            found[pid] = entry.allocation_id
        if watch is not None:
            for pid in previous.keys() - fresh.keys():
                watch.drop(pid)
        # (Every entry of `fresh` is the one of `previous` unless `changed`: then the same
        # number of entries means the same PIDs.)
        if changed or exited or len(fresh) != len(previous):
            self.generation += 1
        self._cache = fresh
        self._found = found
        self._held_all = held_all
        return dict(found)

    def _hold(self, watch: PidfdWatch, pid: int, entry: _Entry) -> _Entry:
        """Hold `pid` by a pidfd, once the process behind it is proven to be the one `entry`
        was read from (its start time read again after the pidfd was opened). Raises _GoneError
        when it is not: that PID now names another process, to be resolved at the next call."""
        if watch.hold(pid) is None:
            return entry
        try:
            _, start_time, _ = self._stat(f"{self._root}/{pid}/stat")
        except _GoneError:
            watch.drop(pid)
            raise
        if start_time != entry.start_time:
            watch.drop(pid)
            raise _GoneError
        return entry

    def pod_uid_of(self, pid: int) -> str | None:
        """The UID of the pod whose cgroup holds `pid` (from `/proc/<pid>/cgroup`, read once per
        pid and start time), for a PID that the latest `resolve` call resolved; None for a process
        in no pod cgroup, and for one that call could not read or was not given."""
        entry = self._cache.get(pid)
        return None if entry is None else entry.pod_uid

    def cgroup_of(self, pid: int) -> str | None:
        """The cgroup path that names the pod of `pid` (its container's cgroup), for a PID that
        the latest `resolve` call resolved; None as for `pod_uid_of`."""
        entry = self._cache.get(pid)
        return None if entry is None else entry.cgroup

    def container_of(self, pid: int) -> tuple[str, str] | None:
        """(pod UID, container name) of the container `pid` runs in, as the kubelet's container
        log links name it, for a PID the latest `resolve` call resolved; None when its container
        is not one the kubelet made, and for one that call could not read or was not given.
        Meaningful only while `containers_known`."""
        entry = self._cache.get(pid)
        if entry is None or entry.container_id is None or self._containers is None:
            return None
        return self._containers.get(entry.container_id)

    @property
    def containers_known(self) -> bool:
        """Whether the kubelet's container log links could be read at the latest `resolve`."""
        return self._containers is not None

    def container_now(self, pid: int) -> str | None:
        """The cgroup of the pod container `pid` is in now, read afresh (not cached): for a
        check right before a signal. None when it is in no pod container, or is gone."""
        try:
            content, _ = read_all(f"{self._root}/{pid}/cgroup")
        except OSError:
            return None
        found = self.tree.container_of(content)
        return None if found is None else found.cgroup

    def _lookup(self, pid: int, cached: _Entry | None, memo: dict[int, Tag]) -> tuple[_Entry, bool]:
        """The entry for `pid`, and whether it came from the cache. Raises _GoneError."""
        stat_path = f"{self._root}/{pid}/stat"
        if cached is not None and cached.settled and cached.identity is not None:
            try:
                st = os.stat(stat_path)
            except OSError as e:
                raise _GoneError from e
            if st.st_size == 0 and (st.st_ino, st.st_ctime_ns) == cached.identity:
                return cached, True
        ppid, start_time, identity = self._stat(stat_path)
        same_process = cached is not None and cached.start_time == start_time
        if cached is not None and same_process and cached.settled:
            if cached.identity != identity:
                cached = dataclasses.replace(cached, identity=identity)
            return cached, True
        allocation, own_environ_empty = self._search(pid, ppid, memo)
        settled = same_process or not own_environ_empty  # a second look is final
        pod = self._pod_cgroup(pid, stat_path)
        if pod is None:
            return _Entry(start_time, allocation, identity, settled), False
        return _Entry(
            start_time,
            allocation,
            identity,
            settled,
            pod.pod_uid,
            pod.cgroup,
            pod.container_id,
        ), False

    def _pod_cgroup(self, pid: int, stat_path: str) -> PodContainer | None:
        """The pod UID in the process's cgroup file; None where the file does not exist (a fake
        tree, or a kernel without cgroups). Raises _GoneError."""
        try:
            content, _ = read_all(f"{self._root}/{pid}/cgroup")
        except FileNotFoundError as e:
            if not os.path.exists(stat_path):  # the process has exited since its stat was read
                raise _GoneError from e
            return None
        except OSError as e:
            raise _GoneError from e
        return self.tree.container_of(content)

    def _stat(self, path: str) -> tuple[int, int, tuple[int, int] | None]:
        """(ppid, start time, procfs identity) from a stat file. Raises _GoneError."""
        try:
            data, st = read_all(path)
        except OSError as e:
            raise _GoneError from e
        fields = data[data.rfind(b")") + 1 :].split()
        try:
            ppid = int(fields[_PPID_FIELD])
            start_time = int(fields[_START_TIME_FIELD])
        except (IndexError, ValueError) as e:
            raise _GoneError from e
        identity = (st.st_ino, st.st_ctime_ns) if st.st_size == 0 else None
        return ppid, start_time, identity

    def _environ(self, pid: int) -> tuple[bool, Tag, bool]:
        """Whether the process's environment sets the variable (or a per-device one), its tag,
        and whether the environment is empty."""
        try:
            environ, _ = read_all(f"{self._root}/{pid}/environ")
        except OSError as e:
            raise _GoneError from e
        present, value = tags_in(environ)
        return present, value, not environ

    def _search(self, pid: int, ppid: int, memo: dict[int, Tag]) -> tuple[Tag, bool]:
        """The variable of `pid`, else of its nearest ancestor below PID 1 that sets it, at most
        `max_ancestors` generations up; and whether the environment of `pid` itself is empty."""
        chain: list[int] = []
        current, parent = pid, ppid
        value: Tag = None
        own_environ_empty = False
        for generation in range(self._max_ancestors + 1):
            if current in memo:
                value = memo[current]
                break
            chain.append(current)
            present, value, empty = self._environ(current)
            if generation == 0:
                own_environ_empty = empty
            if present or parent <= 1 or parent == current:
                break
            if generation == self._max_ancestors:
                # Out of generations: not a definitive answer for the ancestors, so not memoised.
                return None, own_environ_empty
            current = parent
            parent = self._stat(f"{self._root}/{current}/stat")[0]
        for member in chain:
            memo[member] = value
        return value, own_environ_empty
