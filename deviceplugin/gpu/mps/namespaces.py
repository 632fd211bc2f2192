"""MPS v3's servers and namespaces, as the supervisor keeps them (deviceplugin.gpu.mps.protocol
names them).

Servers: one per GPU, `--allowed-devices=<its UUID>`, and `all` (every GPU) once a container
holding several GPUs asks for a namespace: a client reaches one server only, through one pipe
directory. Each server's default namespace, which no container is given, is capped low: at most
DEFAULT_NAMESPACE_THREADS percent of the threads (one slice's share where that is less) and one
slice's memory.

Namespaces: one per container (device plugin) or claim (DRA), made by `provision` before the
container starts (`namespace create`, then `namespace set` with the container's compute share as
its active thread percentage and its memory limit as its pinned memory limit; on the `all`
server, its smallest share and limit over its GPUs, since a namespace's caps apply alike on
every GPU a client opens). `namespace set` fails once a client is attached, so the caps are
fixed for the container's life. `release`, once the container is gone, deletes it, retrying
every `retry_s` while a client is still attached.

After a restart of the control daemon (it forgets every server and namespace) `configure` makes
them all again. After a take-over of a control daemon an earlier run of this daemon left,
the namespaces found that no owner claims within `orphan_grace_s` (the caller provisions
those of live containers again, which adopts them) are deleted. Every `verify_interval_s` the
namespaces are listed: a held one that is missing (a client deleted it: multiuser MPS lets a
root client do that) is made again and counted as drift; an unknown one is an orphan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.allocation import MIB, DeviceLimits, MpsDefaults
from deviceplugin.errors import DevicePluginError
from deviceplugin.gpu.mps.defaults import mib
from deviceplugin.gpu.mps.protocol import (
    ALL_SERVER,
    fields,
    names,
    namespace_name,
    server_name,
    socket_path_fits,
)
from deviceplugin.gpu.mps.runner import ControlCommand, MpsCommandError
from deviceplugin.model import MpsNamespace

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE_THREADS = 10
DRIFT_NAMESPACE = "namespace"


class MpsNamespaceError(MpsCommandError, DevicePluginError):
    """A namespace cannot be made or changed; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class NamespaceTiming:
    retry_s: float = 5.0
    orphan_grace_s: float = 300.0
    verify_interval_s: float = 10.0


@dataclass(slots=True)
class _Deletion:
    next_try_s: float
    warned: bool = False


class NamespaceBook:
    """Servers and namespaces on one control daemon; not locked (the supervisor holds its lock
    around every call). Methods that talk to the control daemon raise MpsCommandError."""

    def __init__(
        self,
        runner: ControlCommand,
        pipe: Path,
        *,
        timing: NamespaceTiming = NamespaceTiming(),
        count_drift: Callable[[str], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._runner = runner
        self._pipe = pipe
        self._timing = timing
        self._count_drift = count_drift
        self._clock = clock
        self._servers: dict[str, tuple[str, ...]] = {}  # made on the control daemon
        self._defaults: MpsDefaults | None = None
        self._held: dict[str, MpsNamespace] = {}
        self._deleting: dict[tuple[str, str], _Deletion] = {}
        self._found: dict[tuple[str, str], float] = {}
        self._verified_s = 0.0

    def held(self) -> tuple[MpsNamespace, ...]:
        return tuple(self._held[owner] for owner in sorted(self._held))

    def servers(self) -> dict[str, tuple[str, ...]]:
        """Every server made, with its GPUs."""
        return dict(self._servers)

    # --- servers ----------------------------------------------------------------------------

    def _wanted_servers(self, defaults: MpsDefaults, with_all: bool) -> dict[str, tuple[str, ...]]:
        wanted: dict[str, tuple[str, ...]] = {
            server_name(uuid): (uuid,) for uuid, _ in defaults.pinned_mem_limit_mib
        }
        if with_all or ALL_SERVER in self._servers:
            wanted[ALL_SERVER] = tuple(uuid for uuid, _ in defaults.pinned_mem_limit_mib)
        return wanted

    def _default_caps(self, defaults: MpsDefaults, gpus: tuple[str, ...]) -> str:
        slice_mib = dict(defaults.pinned_mem_limit_mib)
        threads = min(DEFAULT_NAMESPACE_THREADS, defaults.active_thread_percentage or 100)
        memory = min((slice_mib[g] for g in gpus if g in slice_mib), default=0)
        caps = f"--active-thread-percentage={max(1, threads)}"
        return caps + (f" --pinned-memory-limit={memory}M" if memory else "")

    def _make_servers(
        self, defaults: MpsDefaults, existing: set[str], *, with_all: bool = False
    ) -> None:
        for name, gpus in self._wanted_servers(defaults, with_all).items():
            if name not in existing:
                self._runner.send(f"server create {name} --allowed-devices={','.join(gpus)}")
            self._runner.send(f"server set {name} {self._default_caps(defaults, gpus)}")
            self._servers[name] = gpus
        self._defaults = defaults

    def configure(self, defaults: MpsDefaults, *, fresh: bool) -> None:
        """After the control daemon started (`fresh`) or was taken over: its servers, each
        default namespace capped low, and every namespace held made again. After a take-over,
        the namespaces found that no owner holds are orphans."""
        with_all = ALL_SERVER in self._servers or any(
            len(n.gpu_uuids) > 1 for n in self._held.values()
        )
        self._servers = {}
        self._found = {}
        self._deleting = {}
        existing = set() if fresh else set(names(self._runner.send("server list")))
        self._make_servers(defaults, existing, with_all=with_all)
        now = self._clock()
        for server in self._servers:
            listed = set() if fresh else set(names(self._list(server)))
            for n in listed:
                if not any(h.server == server and h.name == n for h in self._held.values()):
                    self._found[(server, n)] = now
        for held in self._held.values():
            self._make(held, adopt=not fresh)
        if self._found:
            log.warning(
                "MPS namespaces found on the control daemon that no container holds yet; "
                "deleted unless claimed within %g s namespaces=%s",
                self._timing.orphan_grace_s,
                ",".join(f"{s}/{n}" for s, n in sorted(self._found)),
            )
        self._verified_s = now

    def _list(self, server: str) -> str:
        return self._runner.send(f"namespace list --server={server}")

    # --- namespaces -------------------------------------------------------------------------

    def _make(self, ns: MpsNamespace, *, adopt: bool) -> None:
        """`namespace create` and `namespace set`; one that exists with these caps is kept,
        one with other caps is set again (refused while a client is attached: then
        MpsNamespaceError)."""
        where = f"{ns.name} --server={ns.server}"
        caps = (
            f"--active-thread-percentage={ns.active_thread_percentage}"
            f" --pinned-memory-limit={ns.pinned_memory_mib}M"
        )
        try:
            self._runner.send(f"namespace create {where}")
        except MpsCommandError:
            found = self._read(ns)
            if found is None:
                raise
            if found == (ns.active_thread_percentage, ns.pinned_memory_mib):
                return
            if not adopt:
                raise
            try:
                self._runner.send(f"namespace set {where} {caps}")
            except MpsCommandError as e:
                raise MpsNamespaceError(
                    f"the MPS namespace {ns.server}/{ns.name} of {ns.owner} has other caps "
                    f"(active threads, MiB: {found}) and they cannot change while a client is "
                    f"attached ({e}): restart the container to change them"
                ) from e
            return
        self._runner.send(f"namespace set {where} {caps}")

    def _read(self, ns: MpsNamespace) -> tuple[int, int] | None:
        """The caps of an existing namespace, None when it does not exist."""
        try:
            shown = fields(self._runner.send(f"namespace get {ns.name} --server={ns.server}"))
        except MpsCommandError:
            return None
        try:
            threads = int(float(shown.get("active-thread-percentage") or 100))
        except ValueError:
            threads = -1
        memory = mib(shown.get("pinned-memory-limit") or "0")
        return threads, -1 if memory is None else round(memory)

    def provision(self, owner: str, devices: Sequence[DeviceLimits]) -> MpsNamespace:
        """The namespace of `owner` (an allocation ID or a claim UID), made or found, with its
        share and memory on `devices` as caps. Raises MpsNamespaceError."""
        if not devices:
            raise MpsNamespaceError(f"an MPS namespace for {owner} needs at least one GPU")
        if self._defaults is None:
            raise MpsNamespaceError("the MPS control daemon has not been configured yet")
        uuids = tuple(d.uuid for d in devices)
        served = {uuid for uuid, _ in self._defaults.pinned_mem_limit_mib}
        if not set(uuids) <= served:
            raise MpsNamespaceError(
                f"no MPS server serves GPU {', '.join(sorted(set(uuids) - served))}: MPS runs "
                "on this node's sliced GPUs only"
            )
        server = server_name(uuids[0]) if len(uuids) == 1 else ALL_SERVER
        name = namespace_name(owner)
        directory = self._pipe / server / name
        if not socket_path_fits(str(directory)):
            raise MpsNamespaceError(
                f"the MPS namespace socket {directory}/control is longer than the 107 bytes a "
                "unix socket path may have: set mps.root to a shorter directory"
            )
        ns = MpsNamespace(
            owner=owner,
            server=server,
            name=name,
            pipe_directory=str(directory),
            gpu_uuids=uuids,
            active_thread_percentage=max(1, min(d.share_percent for d in devices)),
            pinned_memory_mib=min(d.memory_bytes for d in devices) // MIB,
        )
        if self._held.get(owner) == ns:
            return ns
        try:
            if server not in self._servers:
                self._make_servers(self._defaults, set(self._servers), with_all=True)
            self._make(ns, adopt=True)
        except MpsNamespaceError:
            raise
        except MpsCommandError as e:
            raise MpsNamespaceError(
                f"cannot make the MPS namespace {server}/{name} for {owner}: {e}"
            ) from e
        if not directory.is_dir():
            raise MpsNamespaceError(
                f"the MPS control daemon made namespace {server}/{name} but not its pipe "
                f"directory {directory}"
            )
        self._held[owner] = ns
        self._deleting.pop((server, name), None)
        self._found.pop((server, name), None)
        log.info(
            "MPS namespace made owner=%s server=%s namespace=%s gpus=%s "
            "active_thread_percentage=%d pinned_memory_mib=%d pipe_directory=%s",
            owner,
            server,
            name,
            ",".join(uuids),
            ns.active_thread_percentage,
            ns.pinned_memory_mib,
            directory,
        )
        return ns

    def release(self, owner: str) -> None:
        """`owner`'s container is gone: delete its namespace now or, while a client is still
        attached, every `retry_s` until it can be. Raises nothing."""
        ns = self._held.pop(owner, None)
        if ns is None:
            return
        self._deleting[(ns.server, ns.name)] = _Deletion(self._clock())
        self._retry_deletions()

    def _retry_deletions(self) -> None:
        now = self._clock()
        for (server, name), deletion in list(self._deleting.items()):
            if deletion.next_try_s > now:
                continue
            try:
                self._runner.send(f"namespace delete {name} --server={server}")
            except MpsCommandError as e:
                try:
                    still = name in names(self._list(server))
                except MpsCommandError:
                    still = True
                if still:
                    deletion.next_try_s = now + self._timing.retry_s
                    if not deletion.warned:
                        deletion.warned = True
                        log.warning(
                            "MPS namespace not deleted yet (a client may still be attached); "
                            "retrying every %g s server=%s namespace=%s error=%s",
                            self._timing.retry_s,
                            server,
                            name,
                            e,
                        )
                    continue
            del self._deleting[(server, name)]
            log.info("MPS namespace deleted server=%s namespace=%s", server, name)

    def pending_deletions(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self._deleting))

    # --- every check ------------------------------------------------------------------------

    def check(self, defaults: MpsDefaults) -> None:
        """Servers for GPUs added since, deletions due, orphans past their grace, and every
        `verify_interval_s` the namespaces read back."""
        if defaults != self._defaults:
            self._make_servers(defaults, set(self._servers))
        now = self._clock()
        for key, since in list(self._found.items()):
            if now - since >= self._timing.orphan_grace_s:
                del self._found[key]
                log.warning("MPS namespace orphaned; deleting it server=%s namespace=%s", *key)
                self._deleting[key] = _Deletion(now)
        self._retry_deletions()
        if now - self._verified_s >= self._timing.verify_interval_s:
            self._verified_s = now
            self._verify(now)

    def _verify(self, now: float) -> None:
        for server in self._servers:
            listed = set(names(self._list(server)))
            for ns in self._held.values():
                if ns.server == server and ns.name not in listed:
                    log.warning(
                        "an MPS namespace was deleted behind this daemon's back; made again "
                        "owner=%s server=%s namespace=%s",
                        ns.owner,
                        server,
                        ns.name,
                    )
                    self._count_drift(DRIFT_NAMESPACE)
                    self._make(ns, adopt=True)
            held = {ns.name for ns in self._held.values() if ns.server == server}
            for name in listed - held:
                key = (server, name)
                if key not in self._deleting:
                    self._found.setdefault(key, now)
