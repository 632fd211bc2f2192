"""Live reload: a new config applied to the running daemon, without a restart.

Two things ask for a reload: SIGHUP, and a change of the config file's content. The file is
watched through its directory, because a ConfigMap volume never rewrites a file in place: the
kubelet writes the new content into a new timestamped directory and swaps the `..data` symbolic
link over to it. Every change in the directory (or a SIGHUP) makes the reloader read the file and
compare the SHA-256 of its content with the running config's; only a different content is
parsed and applied.

A new config that does not parse is refused with the messages `check-config` prints, logged,
counted (`vgpu_config_reloads_total{result="refused"}`), and the running one kept. One that
parses is applied by `apply_config`, the one entry point (`Daemon.apply_config` calls it):

- slicing: the next poll builds the inventory from the new plan. A running allocation keeps
  what it was given (its grants: the memory and compute its environment states), whatever the
  new plan gives its slices, and a WARNING line names each one the new plan would have changed
  (its figures and the new plan's); only new allocations get the new plan. A slice that the new
  plan drops and that an allocation holds stays advertised Unhealthy until the kubelet frees it.
- slicing and MIG strategy: the poll that follows reconciles the set of resources with the new
  inventory: a resource it names (a MIG profile under the mixed strategy) is served and
  registered; one it no longer names goes once no allocation holds its slices.
- allocation settings: the next Allocate, on every resource, uses them.
- MPS: the running control daemon is sent quit and, when MPS stays enabled, one with the new
  settings is started and supervised; the next Allocate mounts the new pipe directory.
- node labels: the feature file follows a new path (the old one is removed), MIG strategy or
  resource name.
- enforcement: a new enforcer with the new settings replaces the old, which first resumes every
  process it holds stopped; the poll interval and utilisation window follow.
- resource name: the primary resource is served and registered under the new name at once; the
  old name's endpoint and socket go at the next poll, when no slice is left under it. The old
  name is retired, not forgotten: allocations held under it stay in the book (pod-resources and
  the checkpoint are still read for it) and enforced until the kubelet frees them, and their
  slices are advertised Unhealthy under the new name meanwhile, so that the kubelet cannot hand
  them out a second time.
- health checks: they belong to the GPU backend, opened once; a change takes effect at the next
  restart, and the reload says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin.config import Config, config_from_bytes
from deviceplugin.dra.settings import device_ids_ignored
from deviceplugin.errors import ConfigError
from deviceplugin.grants import held_changes
from deviceplugin.kubelet.dirwatch import DirectoryWatch

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from deviceplugin.app import Daemon

log = logging.getLogger(__name__)

# Where inotify is unavailable, the config's directory is listed this often.
CONFIG_POLL_INTERVAL_S = 5.0
RESULTS = ("applied", "refused")


def config_hash(content: bytes) -> str:
    """The hash by which a config's content is known: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(content).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: Config
    hash: str


def read_config(path: Path) -> LoadedConfig:
    """Read and parse the config file once; raises ConfigError as load_config does."""
    try:
        content = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"cannot read the file: {e.strerror or e}"], str(path)) from e
    return LoadedConfig(config_from_bytes(content, str(path)), config_hash(content))


class ReloadMetrics:
    """`vgpu_config_reloads_total{result}` (both results at 0 from the start) and
    `vgpu_config_info{hash}`, 1 for the running config."""

    def __init__(self, registry: CollectorRegistry, node_name: str, config_hash: str) -> None:
        # Here, not above: `serve` reads its config with this module before its first
        # registration, and the exporter comes after it.
        from prometheus_client import Counter, Gauge  # noqa: PLC0415

        self._reloads = Counter(
            "vgpu_config_reloads",
            "Config reloads, by result: applied, or refused (invalid; the running config kept).",
            labelnames=("node", "result"),
            registry=registry,
        )
        self._info = Gauge(
            "vgpu_config_info",
            "1 for the running config, labelled with the hash of its content.",
            labelnames=("node", "hash"),
            registry=registry,
        )
        self._node = node_name
        for result in RESULTS:
            self._reloads.labels(node=node_name, result=result)
        self._info.labels(node=node_name, hash=config_hash).set(1)

    def counted(self, result: str) -> None:
        self._reloads.labels(node=self._node, result=result).inc()

    def running(self, config_hash: str) -> None:
        self._info.clear()
        self._info.labels(node=self._node, hash=config_hash).set(1)


def describe_changes(old: Config, new: Config) -> list[str]:
    """The top-level sections that differ, e.g. ['slicing', 'enforcement']."""
    return [
        f.name
        for f in dataclasses.fields(Config)
        if f.compare and getattr(old, f.name) != getattr(new, f.name)
    ]


async def apply_config(daemon: Daemon, new: Config) -> None:
    """Apply `new` to the running daemon (see the module's docstring)."""
    new = daemon.settings.configured(new)
    old = daemon.settings.config
    daemon.settings = dataclasses.replace(daemon.settings, config=new)
    # Every resource's endpoint answers Allocate with the new settings; endpoints made from now
    # on take them from the daemon's settings.
    for endpoint in daemon.resources:
        endpoint.service.reconfigure(new)
    if new.enforcement != old.enforcement:
        await daemon.replace_enforcer()
    if new.resource_name != old.resource_name:
        log.warning(
            "config reload: resource renamed; registering again old=%s new=%s",
            old.resource_name,
            new.resource_name,
        )
        daemon.resources.set_primary(new.resource_name)
        daemon.reconcile_resources()
    # Running allocations keep what they were given (their grants); say where the new plan
    # would have given them something else.
    for line in held_changes(daemon.book, [p.gpu for p in daemon.inventory.value.plans], new):
        log.warning("config reload: %s", line)
    # And polls at once: the new plan reaches the kubelet now. The poll reconciles the resource
    # set with it: a new MIG strategy or slicing rule registers the resources it names, and
    # those it drops go once no allocation holds their slices.
    daemon.poller.reconfigure(new)
    if new.mps != old.mps:
        await daemon.reconfigure_mps(new.mps)
    if (
        new.node_labels != old.node_labels
        or new.mig.strategy != old.mig.strategy
        or new.resource_name != old.resource_name
    ):
        await daemon.reconfigure_node_labels(new)
    if new.health != old.health:
        log.warning(
            "config reload: the health settings take effect at the next restart of the daemon"
        )
    if daemon.dra is not None and new.allocation != old.allocation:
        ignored = device_ids_ignored(new)
        if ignored:
            log.warning("config reload: %s", ignored)
    for warning in new.warnings:
        log.warning("config: %s", warning)


async def report_hangups_without_a_config(stop: asyncio.Event, hangup: asyncio.Event) -> None:
    """Without --config there is nothing to reload: say so on each SIGHUP."""
    while True:
        waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(hangup.wait())}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if stop.is_set():
            return
        hangup.clear()
        log.warning("SIGHUP: no config file to reload (the daemon runs on the built-in defaults)")


class ConfigReloader:
    """Reloads the config at `path` on SIGHUP (`hangup` set) and on a change of its content."""

    def __init__(
        self,
        daemon: Daemon,
        path: Path | None,
        metrics: ReloadMetrics,
        running_hash: str,
        *,
        use_inotify: bool = True,
        poll_interval_s: float = CONFIG_POLL_INTERVAL_S,
        watch_dir: Path | None = None,
    ) -> None:
        # path None: the built-in defaults (a per-node config's `empty` choice), in watch_dir's
        # set of named configs.
        self._daemon = daemon
        self._path = path
        self._metrics = metrics
        self.running_hash = running_hash
        watched = watch_dir or (path.parent if path is not None else Path("."))
        self._watch = DirectoryWatch(
            watched, fallback_interval_s=poll_interval_s, use_inotify=use_inotify
        )

    async def switch(self, path: Path | None, trigger: str) -> str:
        """Run the config at `path` (None: the built-in defaults) from now on, as a reload."""
        self._path = path
        return await self.reload(trigger)

    def refuse(self, source: str, problems: list[str], trigger: str) -> str:
        """Refuse a new config chosen elsewhere (per-node configs): logged, counted, kept."""
        return self._refuse(source, problems, trigger)

    async def run(self, stop: asyncio.Event, hangup: asyncio.Event) -> None:
        self._watch.start()
        changed = self._watch.changed
        try:
            if self._path is not None:
                # The file may have changed since the daemon read it (`serve` starts the watch
                # after its first device list): compared once now, applied if it did.
                await self.reload("changed before the watch started")
            log.info(
                "watching the config for changes path=%s mode=%s hash=%s",
                self._path,
                self._watch.mode,
                self.running_hash,
            )
            while not stop.is_set():
                waiters = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(hangup.wait()),
                    asyncio.ensure_future(changed.wait()),
                }
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
                if stop.is_set():
                    return
                trigger = "SIGHUP" if hangup.is_set() else "file changed"
                hangup.clear()
                changed.clear()
                await self.reload(trigger)
        finally:
            await self._watch.close()

    async def reload(self, trigger: str) -> str:
        """Read the file; apply it if its content changed. Returns 'applied', 'refused' or
        'unchanged'."""
        try:
            if self._path is None:
                loaded = LoadedConfig(Config(), config_hash(b""))
            else:
                loaded = await asyncio.to_thread(read_config, self._path)
        except ConfigError as e:
            return self._refuse(e.source, e.problems, trigger)
        if loaded.hash == self.running_hash:
            # A ConfigMap update touches the directory several times for one new content.
            level = logging.INFO if trigger == "SIGHUP" else logging.DEBUG
            log.log(level, "config unchanged hash=%s trigger=%s", loaded.hash, trigger)
            return "unchanged"
        # Valid on its own, but its device list must also fit in one kubelet message here.
        too_large = self._daemon.plan_problem(loaded.config)
        if too_large is not None:
            return self._refuse(str(self._path or "built-in defaults"), [too_large], trigger)
        changes = describe_changes(
            self._daemon.settings.config, self._daemon.settings.configured(loaded.config)
        )
        await self._daemon.apply_config(loaded.config)
        log.info(
            "config reloaded hash=%s previous=%s changed=%s trigger=%s",
            loaded.hash,
            self.running_hash,
            ",".join(changes) or "nothing",
            trigger,
        )
        self.running_hash = loaded.hash
        self._metrics.counted("applied")
        self._metrics.running(loaded.hash)
        return "applied"

    def _refuse(self, source: str, problems: list[str], trigger: str) -> str:
        """Log why the new config is refused, count it, and keep the running one."""
        for problem in problems:
            log.error("config reload refused: %s: %s", source, problem)
        count = len(problems)
        log.error(
            "config reload refused: %s: invalid (%d problem%s); keeping the running config "
            "hash=%s trigger=%s",
            self._path,
            count,
            "s" if count != 1 else "",
            self.running_hash,
            trigger,
        )
        self._metrics.counted("refused")
        return "refused"
