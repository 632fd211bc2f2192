"""The one atomic writer: whole files, exact modes, never through a symlink, no leftovers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deviceplugin import statefiles


def test_a_file_is_replaced_whole_with_its_exact_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        statefiles.write_file(tmp_path, "a.json", b"one", mode=0o644)
        statefiles.write_file(tmp_path, "a.json", b"two", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").read_bytes() == b"two"
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["a.json"]  # no temporary left behind


def test_a_symlink_at_the_name_is_replaced_never_written_through(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "a.json").symlink_to(target)
    statefiles.write_file(tmp_path / "state", "a.json", b"new", sync=False)
    assert target.read_bytes() == b"keep"
    assert not (tmp_path / "state" / "a.json").is_symlink()
    assert (tmp_path / "state" / "a.json").read_bytes() == b"new"


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(NotADirectoryError):
        statefiles.write_file(tmp_path / "link", "a.json", b"x")
    assert os.listdir(real) == []


def test_a_missing_directory_is_made_owner_only_unless_told_not_to(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        statefiles.write_file(tmp_path / "missing", "a.json", b"x", create=False)
    statefiles.write_file(tmp_path / "made" / "here", "a.json", b"x")
    assert stat.S_IMODE((tmp_path / "made" / "here").stat().st_mode) == 0o700
    statefiles.sync_file(tmp_path / "made" / "here", "a.json")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    statefiles.write_file(tmp_path, "a.json", b"old")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(IsADirectoryError):  # a directory cannot be renamed over
        statefiles.write_file(tmp_path, "dir.json", b"new")
    assert sorted(os.listdir(tmp_path)) == ["a.json", "dir.json"]
    assert (tmp_path / "a.json").read_bytes() == b"old"


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_only_plain_names_are_taken(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="not a plain file name"):
        statefiles.write_file(tmp_path, name, b"x")
