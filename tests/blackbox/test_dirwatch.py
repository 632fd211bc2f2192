"""The directory watch, with inotify and with its poll fallback: every kind of change it must
notice, and silence while nothing changes."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.kubelet.dirwatch import DirectoryWatch

MODES = pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "poll"])
FALLBACK_S = 0.05


def _unix_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def _configmap(root: Path, version: str, content: str) -> None:
    """Lay out `content` as the kubelet lays out a ConfigMap volume, and swap `..data` over."""
    target = root / f"..{version}"
    target.mkdir()
    (target / "config.yaml").write_text(content)
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.rename(tmp, root / "..data")
    if not (root / "config.yaml").is_symlink():
        (root / "config.yaml").symlink_to("..data/config.yaml")


async def _noticed(watch: DirectoryWatch, change: Callable[[], object]) -> None:
    watch.changed.clear()
    change()
    await asyncio.wait_for(watch.changed.wait(), 5)


@MODES
async def test_each_kind_of_change_is_noticed(short_tmp: Path, use_inotify: bool) -> None:
    directory = short_tmp / "dp"
    directory.mkdir()
    sockets: list[socket.socket] = []
    async with DirectoryWatch(
        directory, fallback_interval_s=FALLBACK_S, use_inotify=use_inotify
    ) as watch:
        assert watch.mode == ("inotify" if use_inotify else "poll")
        # A socket created (the kubelet's, or ours).
        await _noticed(watch, lambda: sockets.append(_unix_socket(directory / "kubelet.sock")))
        await _noticed(watch, lambda: sockets.append(_unix_socket(directory / "ours.sock")))

        # Every socket deleted (a kubelet restart), then kubelet.sock created again.
        def kubelet_cleans_up() -> None:
            for path in directory.iterdir():
                path.unlink()

        await _noticed(watch, kubelet_cleans_up)
        await _noticed(watch, lambda: sockets.append(_unix_socket(directory / "kubelet.sock")))
        # Our socket replaced by another file under the same name.
        sockets.append(_unix_socket(directory / "ours.sock"))
        await asyncio.sleep(3 * FALLBACK_S)
        sockets.append(_unix_socket(directory / "other.sock"))
        await asyncio.sleep(3 * FALLBACK_S)
        await _noticed(watch, lambda: os.rename(directory / "other.sock", directory / "ours.sock"))
        # A file written in place, and a ConfigMap's `..data` swap.
        (directory / "plain.yaml").write_text("a")
        await asyncio.sleep(3 * FALLBACK_S)
        await _noticed(watch, lambda: (directory / "plain.yaml").write_text("bb"))
        _configmap(directory, "v1", "one")
        await asyncio.sleep(3 * FALLBACK_S)
        await _noticed(watch, lambda: _configmap(directory, "v2", "two"))
    for sock in sockets:
        sock.close()


@MODES
async def test_nothing_is_reported_while_nothing_changes(
    short_tmp: Path, use_inotify: bool
) -> None:
    (short_tmp / "kubelet.sock").write_text("")
    async with DirectoryWatch(
        short_tmp, fallback_interval_s=FALLBACK_S, use_inotify=use_inotify
    ) as watch:
        await asyncio.sleep(10 * FALLBACK_S)
        assert not watch.changed.is_set()


async def test_a_removed_directory_falls_back_to_polling_and_sees_it_return(
    short_tmp: Path,
) -> None:
    directory = short_tmp / "dp"
    directory.mkdir()
    async with DirectoryWatch(directory, fallback_interval_s=FALLBACK_S) as watch:
        assert watch.mode == "inotify"
        await _noticed(watch, directory.rmdir)
        await asyncio.sleep(3 * FALLBACK_S)
        assert watch.mode == "poll"  # type: ignore[comparison-overlap]

        def recreate() -> None:
            directory.mkdir()
            (directory / "kubelet.sock").write_text("")

        await _noticed(watch, recreate)
