"""`mps.root` comes from the config, and the daemon is root: a symlink on the way to it or in it
is refused rather than followed, and a directory the daemon did not create keeps its mode (no
chmod of a host directory to 0755 or 1777 because a config named it)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.allocation import MpsDefaults
from deviceplugin.config import MpsConfig
from deviceplugin.errors import StartupError
from deviceplugin.gpu.mps import MpsControlDaemon

FAKE_CONTROL = Path(__file__).resolve().parents[1] / "support" / "fake_mps_control.py"


@pytest.fixture
def started() -> Iterator[list[MpsControlDaemon]]:
    """Control daemons a test started, stopped at its end (quit, then its own child only)."""
    daemons: list[MpsControlDaemon] = []
    yield daemons
    for daemon in daemons:
        daemon.stop()


def supervisor(root: Path, started: list[MpsControlDaemon]) -> MpsControlDaemon:
    daemon = MpsControlDaemon(
        MpsConfig(enabled=True, root=str(root), control_command=str(FAKE_CONTROL))
    )
    started.append(daemon)
    return daemon


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_root_reached_through_a_symlink_is_refused(
    short_tmp: Path, started: list[MpsControlDaemon]
) -> None:
    elsewhere = short_tmp / "host-directory"
    elsewhere.mkdir(mode=0o700)
    (short_tmp / "link").symlink_to(elsewhere)
    daemon = supervisor(short_tmp / "link" / "mps", started)
    with pytest.raises(StartupError, match="symbolic link"):
        daemon.start(MpsDefaults())
    assert list(elsewhere.iterdir()) == []
    assert mode(elsewhere) == 0o700


@pytest.mark.parametrize("name", ["pipe", "log", "shm"])
def test_a_symlink_planted_for_a_subdirectory_is_not_followed(
    short_tmp: Path, started: list[MpsControlDaemon], name: str
) -> None:
    root = short_tmp / "mps"
    root.mkdir(mode=0o755)
    victim = short_tmp / "victim"
    victim.mkdir(mode=0o700)
    (root / name).symlink_to(victim)
    daemon = supervisor(root, started)
    with pytest.raises(StartupError, match="symbolic link"):
        daemon.start(MpsDefaults())
    assert mode(victim) == 0o700  # not opened up to 0755 or 1777
    assert list(victim.iterdir()) == []


def test_directories_it_did_not_create_keep_their_mode(
    short_tmp: Path, started: list[MpsControlDaemon], caplog: pytest.LogCaptureFixture
) -> None:
    root = short_tmp / "mps"
    root.mkdir(mode=0o700)
    (root / "shm").mkdir(mode=0o700)
    daemon = supervisor(root, started)
    daemon.start(MpsDefaults())
    assert daemon.status.up
    assert mode(root) == 0o700
    assert mode(root / "shm") == 0o700
    assert "did not create is left as it is" in caplog.text
    # What it created itself is opened to clients and servers of other users.
    assert mode(root / "pipe") == 0o755
    assert mode(root / "log") == 0o755
