"""What the hook's applier and the reconciler share: the GPU backend, the record, one lock over
both, the unified hierarchy's mount, and the action log with its counts.

Every backend call runs off the event loop, bounded by `call_timeout_s`; every action on a limit
is one log line (INFO when done, WARNING when refused or failed: pod, container, cgroup, GPU,
figures, reason) and one count in `counts` by action: `set`, `cleared`, `kept`, `repaired`,
`refused`, `failed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.backend import PartitionBackend
from deviceplugin.memlimits.record import LimitRecord
from deviceplugin.partitions import GpuLimit
from deviceplugin.usage.cgroups import PodContainer

log = logging.getLogger("deviceplugin.memlimits")

T = TypeVar("T")
DEFAULT_CALL_TIMEOUT_S = 5.0
ACTIONS = ("set", "cleared", "kept", "repaired", "refused", "failed")


class CallTimeoutError(MemoryLimitError):
    """A backend call that did not return in time: the driver may or may not have done it."""


@dataclass
class LimitBook:
    """The shared state of the memory-limit parts. `cgroup_mount` is the unified hierarchy as
    this process sees it (the one the backend was given)."""

    backend: PartitionBackend
    record: LimitRecord
    cgroup_mount: Path = Path("/sys/fs/cgroup")
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    wall_clock: Callable[[], float] = time.time
    counts: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(ACTIONS, 0)))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set when a leaf is recorded, so that the reconciler watches it at once.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def call(self, what: str, function: Callable[..., T], *args: object) -> T:
        """`function(*args)` on a worker thread; MemoryLimitError when it takes longer than the
        call timeout (the thread is left to finish)."""
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(function, *args), timeout=self.call_timeout_s
            )
        except TimeoutError:
            raise CallTimeoutError(
                f"{what} did not return within {self.call_timeout_s:g}s"
            ) from None

    def save(self) -> None:
        self.record.save()
        self.changed.set()

    def container_action(
        self,
        action: str,
        container: PodContainer,
        gpu: str | None = None,
        limit: GpuLimit | None = None,
        **more: object,
    ) -> None:
        """`action` on a container's limit: its pod, container, cgroup, GPU and figures."""
        figures: dict[str, object] = {}
        if gpu is not None:
            figures["gpu"] = gpu
        if limit is not None:
            figures.update(soft_bytes=limit.soft_bytes, hard_bytes=limit.hard_bytes)
        self.action(
            action,
            f"memory limit {action}",
            pod_uid=container.pod_uid,
            container_id=container.container_id[:12],
            cgroup=container.cgroup,
            **figures,
            **more,
        )

    def action(self, action: str, message: str, **fields: object) -> None:
        """Count `action` and log it with its fields (key=value)."""
        self.counts[action] += 1
        level = logging.WARNING if action in ("refused", "failed") else logging.INFO
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(level, "%s %s", message, text)
