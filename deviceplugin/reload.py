"""Live reload: a new config applied to the running daemon, without a restart.

Two things ask for a reload: SIGHUP, and a change of the config file's content. The file is
watched through its directory, because a ConfigMap volume never rewrites a file in place: the
kubelet writes the new content into a new timestamped directory and swaps the `..data` symbolic
link over to it. Every change in the directory (or a SIGHUP) makes the reloader read the file and
compare the SHA-256 of its content with the running config's; only a different content is
considered, and only once it is complete:

- it has settled: read again after `SETTLE_S`, it is the same (a file written in place with
  `>` is empty, then half written, for a moment);
- it holds a document: an empty file (nothing, blanks, comments) is refused while the daemon
  runs, never taken for the built-in defaults (`{}` or `version: v1` are those). At start an
  empty file is the built-in defaults, as before.

A new config that does not parse is refused with the messages `check-config` prints, logged,
counted (`vgpu_config_reloads_total{result="refused"}`), and the running one kept;
`vgpu_config_refused` is 1 until the file holds a config that is applied (or the running one
again). A refused content is reported once: the events that follow in its directory (a log file
beside it) read the same content and say nothing; a SIGHUP reports it again. In DRA mode a
config whose `dra` policy makes a ResourceSlice the API server would refuse on this node's
devices is refused the same way, before it is applied; one that the API server itself refuses
once applied (where it took the slice before) is undone and counted refused.

One that passes is applied by `live.LiveConfig.apply`, the one entry point: each part of the
running daemon follows it through `reconfigure(old, new)`, in the order the composition root
lists them (neither this module nor `live` knows the parts but by that method):

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

from deviceplugin.config import Config, config_from_bytes, is_empty_document
from deviceplugin.errors import ConfigError
from deviceplugin.kubelet.dirwatch import DirectoryWatch
from deviceplugin.live import LiveConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

# Where inotify is unavailable, the config's directory is listed this often.
CONFIG_POLL_INTERVAL_S = 5.0
RESULTS = ("applied", "refused")
# A new content is applied once it reads the same this long after it was first read; a file
# still changing after SETTLE_TRIES reads waits for its next change.
SETTLE_S = 0.5
SETTLE_TRIES = 20
EMPTY = (
    "is empty: while the daemon runs, an empty file is taken for one being written, not for the "
    "built-in defaults; write {} (or version: v1) to run on the defaults"
)


def config_hash(content: bytes) -> str:
    """The hash by which a config's content is known: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(content).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: Config
    hash: str


def read_config(path: Path) -> LoadedConfig:
    """Read and parse the config file once; raises ConfigError as load_config does."""
    return parse_content(_read(path), path)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError([f"cannot read the file: {e.strerror or e}"], str(path)) from e


def parse_content(content: bytes, path: Path) -> LoadedConfig:
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
        self._refused = Gauge(
            "vgpu_config_refused",
            "1 while the config file holds a config the daemon refused (it runs the one before, "
            "vgpu_config_info); 0 once it holds one that runs.",
            labelnames=("node",),
            registry=registry,
        )
        self._node = node_name
        for result in RESULTS:
            self._reloads.labels(node=node_name, result=result)
        self._info.labels(node=node_name, hash=config_hash).set(1)
        self._refused.labels(node=node_name).set(0)

    def counted(self, result: str) -> None:
        self._reloads.labels(node=self._node, result=result).inc()
        self._refused.labels(node=self._node).set(1 if result == "refused" else 0)

    def file_runs(self) -> None:
        """The file holds the running config again."""
        self._refused.labels(node=self._node).set(0)

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
        live: LiveConfig,
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
        self._live = live
        self._path = path
        self._metrics = metrics
        self.running_hash = running_hash
        # The last refused content's hash (or read error): not said again but on SIGHUP.
        self._refused_key: str | None = None
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
        """Read the file; apply it if its content changed and is complete. Returns 'applied',
        'refused' or 'unchanged'."""
        if self._path is None:
            return await self._consider(LoadedConfig(Config(), config_hash(b"")), trigger)
        path = self._path
        try:
            first: bytes | ConfigError = await asyncio.to_thread(_read, path)
        except ConfigError as e:
            first = e
        if isinstance(first, bytes) and self._seen(config_hash(first), trigger):
            return "unchanged" if config_hash(first) == self.running_hash else "refused"
        settled = await self._settle(path, first)
        if settled is None:
            log.info("config file still changing; waiting for its next change path=%s", path)
            return "unchanged"
        if isinstance(settled, ConfigError):
            key = repr(settled.problems)
            if key == self._refused_key and trigger != "SIGHUP":
                return "refused"
            return self._refuse(settled.source, settled.problems, trigger, key=key)
        content = settled
        digest = config_hash(content)
        if self._seen(digest, trigger):
            return "unchanged" if digest == self.running_hash else "refused"
        if is_empty_document(content):
            return self._refuse(str(path), [EMPTY], trigger, key=digest)
        try:
            loaded = parse_content(content, path)
        except ConfigError as e:
            return self._refuse(e.source, e.problems, trigger, key=digest)
        return await self._consider(loaded, trigger)

    def _seen(self, digest: str, trigger: str) -> bool:
        """Whether this content needs nothing more: the running one, or one refused already
        (said again on SIGHUP only)."""
        if digest == self.running_hash:
            # A ConfigMap update touches the directory several times for one new content.
            level = logging.INFO if trigger == "SIGHUP" else logging.DEBUG
            log.log(level, "config unchanged hash=%s trigger=%s", digest, trigger)
            self._refused_key = None
            self._metrics.file_runs()
            return True
        if digest == self._refused_key and trigger != "SIGHUP":
            log.debug("config still refused hash=%s trigger=%s", digest, trigger)
            return True
        return False

    async def _settle(self, path: Path, first: bytes | ConfigError) -> bytes | ConfigError | None:
        """The file's content once it reads the same SETTLE_S apart; None while it keeps
        changing (SETTLE_TRIES reads), the error when it cannot be read."""
        previous = first
        for _ in range(SETTLE_TRIES):
            await asyncio.sleep(SETTLE_S)
            try:
                current: bytes | ConfigError = await asyncio.to_thread(_read, path)
            except ConfigError as e:
                current = e
            if current == previous or (
                isinstance(current, ConfigError)
                and isinstance(previous, ConfigError)
                and current.problems == previous.problems
            ):
                return current
            previous = current
        return None

    async def _consider(self, loaded: LoadedConfig, trigger: str) -> str:
        """Apply a parsed config that passes the checks on this node; else refuse it."""
        source = str(self._path or "built-in defaults")
        if loaded.hash == self.running_hash:
            self._seen(loaded.hash, trigger)
            return "unchanged"
        # Valid on its own, but it must also be servable here (its device list must fit in one
        # kubelet message; in DRA mode the API server must take its ResourceSlice).
        problems = self._live.refuses(loaded.config)
        if problems:
            return self._refuse(source, problems, trigger, key=loaded.hash)
        old = self._live.config
        changes = describe_changes(old, self._live.configured(loaded.config))
        await self._live.apply(loaded.config)
        refusal = await self._live.verdict()
        if refusal:
            await self._live.apply(old)
            problem = f"the API server refuses the ResourceSlice this config makes: {refusal}"
            return self._refuse(source, [problem], trigger, key=loaded.hash)
        log.info(
            "config reloaded hash=%s previous=%s changed=%s trigger=%s",
            loaded.hash,
            self.running_hash,
            ",".join(changes) or "nothing",
            trigger,
        )
        self.running_hash = loaded.hash
        self._refused_key = None
        self._metrics.counted("applied")
        self._metrics.running(loaded.hash)
        return "applied"

    def _refuse(
        self, source: str, problems: list[str], trigger: str, key: str | None = None
    ) -> str:
        """Log why the new config is refused, count it, and keep the running one. `key` (the
        content's hash) marks it said: the same content is not said again but on SIGHUP."""
        self._refused_key = key
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
