"""Which MPS clients run as root.

Under multiuser MPS (v3's `-m`) the control daemon is root's, and a client running as root (user
ID 0 in the host's user namespace: containers without a user namespace of their own) can reach
it through the socket in its own namespace's directory and raise its namespace's caps, or delete
a neighbour's namespace. Nothing the daemon sees at Allocate tells a root pod from another (the
kubelet hands it device IDs, not the pod spec), so the clients are checked as they run: each one
whose effective user ID is 0 is flagged (`MpsStatus.root_clients`) and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


def effective_uid(pid: int, proc_root: str = "/proc") -> int | None:
    """The effective user ID of process `pid` (its `/proc/<pid>/status` Uid line, the second
    figure); None when it cannot be read (gone, or not a process this daemon can see)."""
    try:
        with open(f"{proc_root}/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RootClients:
    """The MPS clients running as root at the last look, each logged once."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self.pids: tuple[int, ...] = ()

    def look(self, clients: Iterable[int]) -> tuple[int, ...]:
        """Check `clients` (every MPS client's PID); the root ones, sorted."""
        found = tuple(
            sorted(pid for pid in set(clients) if effective_uid(pid, self._proc_root) == 0)
        )
        for pid in sorted(set(found) - set(self.pids)):
            log.warning(
                "an MPS client runs as root: it can raise its own MPS caps or delete another "
                "container's MPS namespace through the control daemon; run MPS pods as non-root "
                "(runAsNonRoot) pid=%d",
                pid,
            )
        self.pids = found
        return found
