"""Which containers the kubelet made: its container log links, `/var/log/containers`.

For every container it creates, the kubelet links `<pod>_<namespace>_<container>-<container
ID>.log` in `/var/log/containers` to `/var/log/pods/<namespace>_<pod>_<pod UID>/<container>/
<n>.log` right after it starts the container, and removes the link with the container (a GPU
process caught in between is refused for a poll or two, never charged). Both directories are
root's. The link's name and target (read with readlink, never followed) give, per container ID,
the pod UID and the container's name: what the kubelet's device checkpoint records per
allocation. So a process's allocation tag can be checked against the one container that holds the
allocation, not only its pod (a sidecar that copies the GPU container's ID is not that
container). A link whose name the kubelet cut at 255 characters (pod names of more than about
170) names no container ID: such a container's tags are refused.

`ContainerLogIndex.read()` lists the directory again only when it changed (one stat a call
otherwise) and never raises: an unreadable or missing directory gives None, and the caller then
checks tags per pod only.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

DEFAULT_CONTAINER_LOG_DIR = Path("/var/log/containers")
_SETTLE_S = 1.0
_LINK = re.compile(
    r"(?P<pod>[a-z0-9][a-z0-9.-]*)_(?P<ns>[a-z0-9][a-z0-9-]*)_(?P<container>[a-z0-9][a-z0-9-]*)"
    r"-(?P<id>[0-9a-f]{64})\.log"
)
_TARGET = re.compile(
    r".*/(?P<ns>[a-z0-9][a-z0-9-]*)_(?P<pod>[a-z0-9][a-z0-9.-]*)_(?P<uid>[0-9a-f-]{32,36})"
    r"/(?P<container>[a-z0-9][a-z0-9-]*)/[0-9]+\.log"
)

ContainerNames = Mapping[str, tuple[str, str]]  # container ID -> (pod UID, container name)


def parse_links(links: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Container ID -> (pod UID, container name) from (link name -> link target) pairs; a pair
    whose name and target disagree (pod, namespace or container) is left out."""
    found: dict[str, tuple[str, str]] = {}
    for name, target in links.items():
        link = _LINK.fullmatch(name)
        to = _TARGET.fullmatch(target)
        if link is None or to is None:
            continue
        if (link["pod"], link["ns"], link["container"]) != (to["pod"], to["ns"], to["container"]):
            continue
        found[link["id"]] = (to["uid"], link["container"])
    return found


class ContainerLogIndex:
    """The kubelet's container log links in `directory`, indexed by container ID."""

    def __init__(self, directory: Path = DEFAULT_CONTAINER_LOG_DIR) -> None:
        self.directory = directory
        self._key: tuple[int, int, int] | None = None
        self._latest: ContainerNames | None = None
        self.reads = 0

    def read(self) -> ContainerNames | None:
        """Container ID -> (pod UID, container name); None when the directory cannot be read."""
        try:
            st = os.stat(self.directory)
        except OSError:
            self._key, self._latest = None, None
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        if key == self._key:
            return self._latest
        links: dict[str, str] = {}
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.is_symlink():
                        try:
                            links[entry.name] = os.readlink(entry.path)
                        except OSError:
                            continue
        except OSError:
            self._key, self._latest = None, None
            return None
        self.reads += 1
        # A link made within the directory's timestamp granularity of this read might not
        # change its times again: a directory changed in the last second is listed again.
        recent = time.time() - st.st_mtime_ns / 1e9 < _SETTLE_S
        self._key = None if recent else key
        self._latest = parse_links(links)
        return self._latest
