"""Optional supervised parts: what the config may turn on or off while the daemon runs (the MPS
control daemon, the node feature file; later the GPU memory-limit hook and MPS v3's servers).

The root lists them (`OptionalParts([...])`): that list is where a new one plugs in. Each is
started after the first poll (a failure there stops the daemon's start), then, while it has
something to run, supervised as a task of the daemon's task group: a part that fails for good
ends the daemon, which exits non-zero and is restarted. A reload that concerns a part stops its
task, lets it follow the new config, and starts its task again; every part is closed on every
exit path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from deviceplugin.config import Config

log = logging.getLogger(__name__)


class OptionalPart(Protocol):
    """A part the config may turn on or off while the daemon runs."""

    name: str

    @property
    def active(self) -> bool:
        """Whether it has something to run now (the config turns it on)."""
        ...

    async def start(self) -> None:
        """At the daemon's start, after the first poll; raises StartupError to stop it."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Supervised while active, until `stop`; raising ends the daemon."""
        ...

    def affected(self, old: Config, new: Config) -> bool:
        """Whether a reload from `old` to `new` concerns it."""
        ...

    async def replace(self, new: Config) -> None:
        """Between two runs (the last one stopped): follow `new`."""
        ...

    def close(self) -> None:
        """On every exit path of the daemon."""
        ...


class OptionalParts:
    """The optional parts, started, supervised, reconfigured and closed together."""

    def __init__(self, parts: Sequence[OptionalPart]) -> None:
        self.parts = tuple(parts)
        # While running: the daemon's task group and stop, and each running part's own stop
        # and task.
        self._tasks: asyncio.TaskGroup | None = None
        self._stop: asyncio.Event | None = None
        self._running: dict[str, tuple[asyncio.Event, asyncio.Task[Any]]] = {}

    async def start(self) -> None:
        for part in self.parts:
            await part.start()

    def run(self, tasks: asyncio.TaskGroup, stop: asyncio.Event) -> None:
        """Supervise every active part as a task of `tasks` until `stop`."""
        self._tasks, self._stop = tasks, stop
        for part in self.parts:
            if part.active:
                self._run(part)

    def stopped(self) -> None:
        """The daemon's task group has ended."""
        self._tasks = self._stop = None
        self._running.clear()

    def _run(self, part: OptionalPart) -> None:
        """Run `part.run(stop)` as a task of the running daemon, stopped by `_halt(part)` or
        when the daemon stops."""
        if self._tasks is None or self._stop is None:
            return
        stop = asyncio.Event()
        relay = asyncio.ensure_future(self._stop.wait())
        relay.add_done_callback(functools.partial(_set_on_done, stop))
        task = self._tasks.create_task(part.run(stop), name=part.name)
        task.add_done_callback(lambda _: relay.cancel())
        self._running[part.name] = (stop, task)

    async def _halt(self, part: OptionalPart) -> None:
        running = self._running.pop(part.name, None)
        if running is not None:
            stop, task = running
            stop.set()
            await asyncio.wait({task})

    async def reconfigure(self, old: Config, new: Config) -> None:
        for part in self.parts:
            if part.affected(old, new):
                await self._halt(part)
                await part.replace(new)
                if part.active:
                    self._run(part)

    def close(self) -> None:
        """Close every part, whatever ends the daemon (each part's failure is logged, and the
        others are closed all the same)."""
        errors: list[Exception] = []
        for part in self.parts:
            try:
                part.close()
            except Exception as e:  # noqa: BLE001 (the others are closed first; raised below)
                log.error("closing an optional part failed part=%s error=%r", part.name, e)
                errors.append(e)
        if errors:
            raise errors[0]


def _set_on_done(event: asyncio.Event, _: asyncio.Future[Any]) -> None:
    event.set()
