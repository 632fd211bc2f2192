"""A cgroup tree read from a directory: the real unified hierarchy, or a plain directory that a
test or the demo lays out like one.

A cgroup exists when its directory does, reached without passing a symbolic link. Its dmem files
exist when its parent's `cgroup.subtree_control` names `dmem` (as the kernel writes it, or as a
test does), or, for the fake GPUs (`dmem="always"`), always: the fake's GPUs behave alike on a
host whose kernel has no dmem controller, on cgroup v1 and hybrid hierarchies too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from deviceplugin.safefs import open_directory

DmemFiles = Literal["always", "subtree_control"]
_MAX_CONTROL_BYTES = 4096


class DirectoryTree:
    """The cgroups under `root` (the hierarchy's mount, or a directory standing in for it)."""

    def __init__(self, root: Path, dmem: DmemFiles = "subtree_control") -> None:
        self.root = Path(root)
        self.dmem: DmemFiles = dmem

    def path(self, cgroup: str) -> Path:
        return self.root / cgroup.lstrip("/")

    def exists(self, cgroup: str) -> bool:
        try:
            handle = open_directory(str(self.path(cgroup)), create=False)
        except (OSError, ValueError):
            return False
        os.close(handle.fd)
        return True

    def has_dmem_files(self, cgroup: str) -> bool:
        if cgroup == "/" or not self.exists(cgroup):
            return False
        if self.dmem == "always":
            return True
        parent = cgroup.rsplit("/", 1)[0] or "/"
        return "dmem" in subtree_controllers(self.path(parent))


def subtree_controllers(directory: Path) -> list[str]:
    """The controllers a cgroup enables for its children (its `cgroup.subtree_control`, with or
    without `+`); [] when it cannot be read. Never through a symbolic link."""
    try:
        fd = os.open(directory / "cgroup.subtree_control", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        content = os.read(fd, _MAX_CONTROL_BYTES)
    except OSError:
        return []
    finally:
        os.close(fd)
    return [word.lstrip("+") for word in content.decode("ascii", "replace").split()]
