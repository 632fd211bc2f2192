"""The running config and the parts of the daemon that follow a live reload (docs/design.md §11):
each reacts to `reconfigure(old, new)`, in the order the composition root lists them. The
reloader (`reload`) reads and checks a new config and hands it to `LiveConfig.apply`; nothing
here knows the parts but by that one method."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from deviceplugin.config import Config
from deviceplugin.enforcement_mode import mode_line

log = logging.getLogger(__name__)


class Reconfigurable(Protocol):
    """A part of the running daemon that follows a live reload."""

    async def reconfigure(self, old: Config, new: Config) -> None: ...


class LiveConfig:
    """The running config, and the parts that follow it, in order.

    `configured` applies what wins over the config file (flags); `checks` say why a config
    cannot be served on this node (the first that objects refuses it, before anything is
    applied); `verdict`, once a config is applied, why the kubelet's side refuses it (the reload
    is then undone)."""

    def __init__(
        self,
        config: Config,
        parts: Sequence[Reconfigurable],
        *,
        configured: Callable[[Config], Config] = lambda config: config,
        checks: Sequence[Callable[[Config], list[str]]] = (),
        verdict: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.configured = configured
        self.config = configured(config)
        self._parts = tuple(parts)
        self._checks = tuple(checks)
        self._verdict = verdict

    def refuses(self, config: Config) -> list[str]:
        for check in self._checks:
            problems = check(config)
            if problems:
                return problems
        return []

    async def apply(self, new: Config) -> None:
        """Apply `new` to the running daemon (see the module's docstring)."""
        new = self.configured(new)
        old, self.config = self.config, new
        for part in self._parts:
            await part.reconfigure(old, new)

    async def verdict(self) -> str:
        return "" if self._verdict is None else await self._verdict()


class ReloadNotes:
    """The reload's own lines, after the parts followed it: what takes effect only at the next
    restart, a turn into or out of monitor mode (or a dry run), the new config's warnings."""

    def __init__(self, enforce_nvidia_config: bool) -> None:
        self._enforce = enforce_nvidia_config

    async def reconfigure(self, old: Config, new: Config) -> None:
        if new.health != old.health:
            log.warning(
                "config reload: the health settings take effect at the next restart of the daemon"
            )
        for warning in new.warnings:
            log.warning("config: %s", warning)
        if old.enforcement.dry_run != new.enforcement.dry_run:
            line = mode_line(new, self._enforce) or "enforcement: on, as the config says"
            log.warning("config reload: %s", line)
