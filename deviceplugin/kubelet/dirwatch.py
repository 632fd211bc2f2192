"""Noticing that a directory's entries changed, without a busy timer.

`DirectoryWatch` sets its `changed` event when an entry of one directory is created, deleted,
renamed, replaced or written. It leaves the question "what changed" to its user, who clears the
event, looks at what it cares about (a socket's inode, a file's content hash), and waits again.

Where the kernel offers inotify (Linux), the watch costs nothing while nothing happens: the event
loop reads the inotify descriptor when the kernel has news. Where it does not (no inotify, the
per-user watch limit reached, a file system that does not report changes), the watch falls back to
a slow poll: it lists the directory every `fallback_interval_s` and sets `changed` when an entry's
inode, size or modification time differs. The user sees the same thing either way, later with the
fallback.

inotify comes through asyncinotify, which reads the descriptor from the asyncio event loop
(`loop.add_reader`), with no thread and no timer of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Literal

from asyncinotify import Inotify, Mask

log = logging.getLogger(__name__)

DEFAULT_FALLBACK_INTERVAL_S = 0.25

WatchMode = Literal["inotify", "poll"]

_Listing = dict[str, tuple[int, int, int, int]]


def list_entries(directory: Path) -> _Listing:
    """Each entry's (device, inode, size, mtime_ns), symbolic links not followed; empty when the
    directory cannot be read."""
    listing: _Listing = {}
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                listing[entry.name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return {}
    return listing


class DirectoryWatch:
    """Sets `changed` when an entry of `directory` changes. Start it with `start()` (inside the
    event loop, the directory existing), end it with `close()`. `use_inotify=False` forces the
    poll fallback."""

    def __init__(
        self,
        directory: Path,
        *,
        fallback_interval_s: float = DEFAULT_FALLBACK_INTERVAL_S,
        use_inotify: bool = True,
    ) -> None:
        self.directory = directory
        self.fallback_interval_s = fallback_interval_s
        self._use_inotify = use_inotify
        self.changed = asyncio.Event()
        self.mode: WatchMode = "poll"
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("DirectoryWatch already started")
        inotify = self._open_inotify() if self._use_inotify else None
        if inotify is not None:
            self.mode = "inotify"
            self._task = asyncio.create_task(self._read_events(inotify), name="dirwatch")
        else:
            self.mode = "poll"
            # Listed now, not when the task first runs: a change made right after start counts.
            listing = list_entries(self.directory)
            self._task = asyncio.create_task(self._poll(listing), name="dirwatch-poll")
        log.debug("watching directory=%s mode=%s", self.directory, self.mode)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> DirectoryWatch:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _open_inotify(self) -> Inotify | None:
        try:
            inotify = Inotify()
        except OSError as e:
            log.warning(
                "inotify unavailable; polling the directory every %gs instead "
                "directory=%s reason=%r",
                self.fallback_interval_s,
                self.directory,
                str(e),
            )
            return None
        try:
            inotify.add_watch(
                self.directory,
                Mask.CREATE
                | Mask.DELETE
                | Mask.MOVED_FROM
                | Mask.MOVED_TO
                | Mask.ATTRIB
                | Mask.MODIFY
                | Mask.CLOSE_WRITE
                | Mask.DELETE_SELF
                | Mask.MOVE_SELF
                | Mask.ONLYDIR,
            )
        except OSError as e:
            inotify.close()
            log.warning(
                "cannot watch the directory with inotify; polling it every %gs instead "
                "directory=%s reason=%r",
                self.fallback_interval_s,
                self.directory,
                str(e),
            )
            return None
        return inotify

    async def _read_events(self, inotify: Inotify) -> None:
        try:
            while True:
                event = await inotify.get()
                self.changed.set()
                if Mask.IGNORED in event.mask:
                    # The directory itself went away: nothing left to watch with inotify.
                    log.warning(
                        "watched directory removed; polling it every %gs directory=%s",
                        self.fallback_interval_s,
                        self.directory,
                    )
                    break
        finally:
            inotify.close()
        self.mode = "poll"
        await self._poll(list_entries(self.directory))

    async def _poll(self, before: _Listing) -> None:
        # A listing of a local directory of a few entries: cheap enough for the event loop.
        while True:
            await asyncio.sleep(self.fallback_interval_s)
            now = list_entries(self.directory)
            if now != before:
                before = now
                self.changed.set()
