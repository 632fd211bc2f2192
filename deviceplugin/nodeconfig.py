"""Per-node configs: one of several named config files, chosen by a label of the node.

A directory (a ConfigMap mounted as a volume, one file per key) holds named configs. The node's
label `nvidia.com/device-plugin.config` names the one this node runs, as NVIDIA's config-manager
does it:

1. the label's value, when set: it must name a file of the directory;
2. else the default config (`--default-config`), when set: it must name a file too;
3. else the fallback strategies, in order: `named` takes the config named `default`; `single`
   takes the only config when there is exactly one; `empty` takes none (the built-in defaults).

A name that is not there, or no choice at all, is an error that names the label, the value and
the configs there are. At start it stops the daemon (exit 2); later, a label that changes to such a
value is refused like an invalid config: logged, counted, and the running config kept.

The daemon reads its own Node object with a GET every `interval_s` (RBAC: `get` on nodes, and
nothing else); a change of the label's value switches the config through the live-reload path
(`ConfigReloader.switch`). A change of a file's content is the reloader's own business, as for a
single config file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.core.exceptions import ConfigError as KubeConfigError
from lightkube.resources.core_v1 import Node

from deviceplugin.errors import ConfigError, StartupError

log = logging.getLogger(__name__)

NODE_LABEL = "nvidia.com/device-plugin.config"
FALLBACK_NAMED = "named"
FALLBACK_SINGLE = "single"
FALLBACK_EMPTY = "empty"
FALLBACK_STRATEGIES = (FALLBACK_NAMED, FALLBACK_SINGLE, FALLBACK_EMPTY)
# NVIDIA's Helm chart: the config named `default`, else the only one.
DEFAULT_FALLBACK = (FALLBACK_NAMED, FALLBACK_SINGLE)
NAMED_FALLBACK = "default"
DEFAULT_INTERVAL_S = 15.0
API_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class NodeConfigRules:
    """Where the named configs are and how one is chosen."""

    directory: Path
    label: str = NODE_LABEL
    default: str = ""
    fallback: tuple[str, ...] = DEFAULT_FALLBACK


def parse_fallback(value: str) -> tuple[str, ...]:
    """`named,single` -> ('named', 'single'); ValueError naming an unknown strategy."""
    strategies = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in strategies if s not in FALLBACK_STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown fallback strateg{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(unknown)}: use any of {', '.join(FALLBACK_STRATEGIES)}, comma-separated"
        )
    return strategies


def config_names(directory: Path) -> list[str]:
    """The named configs of `directory`: its files, but for a ConfigMap volume's own `..data`
    entries, sorted."""
    try:
        entries = list(directory.iterdir())
    except OSError as e:
        raise ConfigError(
            [f"cannot list the config directory: {e.strerror or e}"], str(directory)
        ) from e
    return sorted(p.name for p in entries if not p.name.startswith("..") and p.is_file())


def choose(rules: NodeConfigRules, label_value: str, names: Sequence[str]) -> str | None:
    """The config name for a node whose label has `label_value` ("" when unset), or None for
    the built-in defaults (the `empty` fallback). Raises ConfigError saying what to do."""
    source = str(rules.directory)
    there = ", ".join(names) if names else "none"
    if not names:
        raise ConfigError(
            ["no config file in the directory: give the ConfigMap at least one key"], source
        )
    if label_value:
        if label_value not in names:
            raise ConfigError(
                [
                    f"the node's label {rules.label}={label_value} names no config here (the "
                    f"configs are: {there}): set the label to one of them, or add that key "
                    "to the ConfigMap"
                ],
                source,
            )
        return label_value
    if rules.default:
        if rules.default not in names:
            raise ConfigError(
                [
                    f"the default config {rules.default!r} is not here (the configs are: "
                    f"{there}): set the default to one of them"
                ],
                source,
            )
        return rules.default
    for strategy in rules.fallback:
        if strategy == FALLBACK_NAMED and NAMED_FALLBACK in names:
            return NAMED_FALLBACK
        if strategy == FALLBACK_SINGLE and len(names) == 1:
            return names[0]
        if strategy == FALLBACK_EMPTY:
            return None
    raise ConfigError(
        [
            f"the node has no label {rules.label}, no default config is set, and the fallback "
            f"strategies ({', '.join(rules.fallback) or 'none'}) chose none of the configs "
            f"({there}): label the node, set a default config, or add a config named "
            f"{NAMED_FALLBACK!r}"
        ],
        source,
    )


def path_of(rules: NodeConfigRules, name: str | None) -> Path | None:
    return None if name is None else rules.directory / name


# A reloader's two entry points: switch to a config file (None: the built-in defaults), and
# refuse (log and count) a choice that failed, keeping the running config.
Switch = Callable[[Path | None, str], Awaitable[str]]
Refuse = Callable[[str, list[str], str], str]


class NodeConfig:
    """Reads the node's label through the Kubernetes API and keeps the chosen config running."""

    def __init__(
        self,
        rules: NodeConfigRules,
        node_name: str,
        *,
        kubeconfig: str = "",
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        if not node_name:
            raise StartupError(
                "per-node configs need the node's name: set --node-name (env NODE_NAME, from "
                "the downward API's spec.nodeName)"
            )
        self.rules = rules
        self.node_name = node_name
        self._kubeconfig = kubeconfig
        self.interval_s = interval_s
        # The label's value last acted on.
        self.label_value = ""

    def _client(self) -> AsyncClient:
        try:
            config = (
                KubeConfig.from_file(self._kubeconfig)
                if self._kubeconfig
                else KubeConfig.from_env()
            )
        except (KubeConfigError, KeyError) as e:  # KeyError: no KUBERNETES_SERVICE_HOST
            raise StartupError(
                f"per-node configs read the node's labels from the Kubernetes API, but {e}: "
                "mount the service account token (automountServiceAccountToken) or set "
                "--kubeconfig"
            ) from e
        return AsyncClient(config, timeout=httpx2.Timeout(API_TIMEOUT_S), trust_env=False)

    async def read_label(self, client: AsyncClient) -> str:
        """The label's value on this node, "" when unset. Raises ApiError or OSError."""
        node = await client.get(Node, name=self.node_name)
        labels = (node.metadata.labels if node.metadata else None) or {}
        return str(labels.get(self.rules.label, ""))

    async def initial(self) -> Path | None:
        """The config file to start with (None: the built-in defaults). Raises StartupError when
        the API cannot be read, ConfigError when no config can be chosen."""
        client = self._client()
        try:
            value = await self._read_or_explain(client)
        finally:
            await client.close()
        self.label_value = value
        names = await asyncio.to_thread(config_names, self.rules.directory)
        name = choose(self.rules, value, names)
        log.info(
            "per-node config chosen node=%s label=%s value=%s config=%s",
            self.node_name,
            self.rules.label,
            value or "(unset)",
            name or "(built-in defaults)",
        )
        return path_of(self.rules, name)

    async def _read_or_explain(self, client: AsyncClient) -> str:
        try:
            return await self.read_label(client)
        except ApiError as e:
            raise StartupError(
                f"cannot read node {self.node_name} from the Kubernetes API: {e.status.message} "
                "(the daemon's ServiceAccount needs `get` on nodes)"
            ) from e
        except (httpx2.HTTPError, OSError) as e:  # refused, DNS, TLS, timeout
            raise StartupError(
                f"cannot reach the Kubernetes API to read node {self.node_name}'s labels: {e}"
            ) from e

    async def run(self, stop: asyncio.Event, switch: Switch, refuse: Refuse) -> None:
        """Every `interval_s` until `stop`: read the label; on a new value, switch to the config
        it chooses, or refuse it (the running config stays)."""
        client = self._client()
        try:
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                    return
                except TimeoutError:
                    pass
                try:
                    value = await self.read_label(client)
                except (ApiError, httpx2.HTTPError, OSError) as e:
                    log.warning(
                        "cannot read node %s's labels; keeping the running config: %s",
                        self.node_name,
                        e,
                    )
                    continue
                if value == self.label_value:
                    continue
                self.label_value = value
                trigger = f"node label {self.rules.label}={value or '(unset)'}"
                try:
                    names = await asyncio.to_thread(config_names, self.rules.directory)
                    name = choose(self.rules, value, names)
                except ConfigError as e:
                    refuse(e.source, e.problems, trigger)
                    continue
                log.info(
                    "node label changed node=%s %s config=%s",
                    self.node_name,
                    trigger,
                    name or "(built-in defaults)",
                )
                await switch(path_of(self.rules, name), trigger)
        finally:
            await client.close()
