"""The daemon's metrics, made on first use: `serve` imports prometheus_client only once the
kubelet has the first device list (or when a scrape comes first, on an HTTP thread); until then
the poll and Allocate durations observed wait here, and are observed when the metrics are made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from deviceplugin import __version__
from deviceplugin.model import NodeSnapshot

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from deviceplugin.reload import ReloadMetrics
    from deviceplugin.usage.metrics import DaemonMetrics


class LazyMetrics:
    """The daemon's metrics and the reload's, made once by whichever thread needs them first."""

    def __init__(
        self,
        node_name: str,
        config_hash: str,
        snapshot: Callable[[], NodeSnapshot | None],
        *,
        register: Callable[[CollectorRegistry], None] = lambda registry: None,
    ) -> None:
        self._node = node_name
        self._config_hash = config_hash
        self._snapshot = snapshot
        # Adds the frontend's own metrics to the registry.
        self._register = register
        self._metrics: DaemonMetrics | None = None
        self._reload: ReloadMetrics | None = None
        self._lock = threading.Lock()
        self._early_polls: list[float] = []
        self._early_allocates: list[float] = []

    def make(self) -> DaemonMetrics:
        """The metrics, made now if they are not yet, with the durations observed before."""
        from deviceplugin.reload import ReloadMetrics  # noqa: PLC0415 (see the module's docstring)
        from deviceplugin.usage.metrics import DaemonMetrics  # noqa: PLC0415

        with self._lock:
            if self._metrics is not None:
                return self._metrics
            metrics = DaemonMetrics(self._node, self._snapshot, version=__version__)
            self._reload = ReloadMetrics(metrics.registry, self._node, self._config_hash)
            self._register(metrics.registry)
            for seconds in self._early_polls:
                metrics.observe_poll(seconds)
            for seconds in self._early_allocates:
                metrics.observe_allocate(seconds)
            self._early_polls.clear()
            self._early_allocates.clear()
            self._metrics = metrics
            return metrics

    @property
    def registry(self) -> CollectorRegistry:
        return self.make().registry

    @property
    def reload(self) -> ReloadMetrics:
        self.make()
        assert self._reload is not None
        return self._reload

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """For the HTTP servers, which start before the metrics are made."""
        return self.make().render(accept)

    def observe_poll(self, seconds: float) -> None:
        metrics = self._metrics or self._or_keep(self._early_polls, seconds)
        if metrics is not None:
            metrics.observe_poll(seconds)

    def observe_allocate(self, seconds: float) -> None:
        metrics = self._metrics or self._or_keep(self._early_allocates, seconds)
        if metrics is not None:
            metrics.observe_allocate(seconds)

    def _or_keep(self, early: list[float], seconds: float) -> DaemonMetrics | None:
        """The metrics if made (by another thread, a scrape, meanwhile); else `seconds` is kept
        in `early` for them, and None."""
        with self._lock:
            if self._metrics is None:
                early.append(seconds)
            return self._metrics
