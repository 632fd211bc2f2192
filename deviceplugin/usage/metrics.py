"""Prometheus metrics (docs/design.md §5, a contract): the daemon's own registry, read on
every scrape.

A scrape does no work of its own: `SnapshotCollector` (`collector`) turns the latest
`NodeSnapshot` (an immutable value swapped in by reference after every poll) into fresh metric
families. Nothing
carries over between scrapes, so a container that leaves the snapshot leaves the next scrape.
The only state kept here is the two histograms that the daemon observes as it works.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.collector import NODE_LABELS, SnapshotCollector

# The classic text format, what a client that asks for nothing in particular gets.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text"

# Allocate and a poll take milliseconds; the top buckets catch a stalled driver call.
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DaemonMetrics:
    """The daemon's metrics: a private registry with the snapshot collector and two histograms.

    `observe_allocate` and `observe_poll` are safe to call from any thread."""

    def __init__(
        self,
        node_name: str,
        get_snapshot: Callable[[], NodeSnapshot | None],
        *,
        version: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_name = node_name
        self.registry = CollectorRegistry()
        allocate = Histogram(
            "vgpu_allocate_duration_seconds",
            "Time the plugin took to answer an Allocate call, in seconds.",
            labelnames=NODE_LABELS,
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        poll = Histogram(
            "vgpu_poll_duration_seconds",
            "Time one poll of the GPUs took, from the backend call to the new snapshot, "
            "in seconds.",
            labelnames=NODE_LABELS,
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        # Children made now, so that both histograms are exposed (at zero) from the start.
        self._allocate = allocate.labels(node=node_name)
        self._poll = poll.labels(node=node_name)
        self.collector = SnapshotCollector(node_name, get_snapshot, version=version, clock=clock)
        self.registry.register(self.collector)

    def observe_allocate(self, seconds: float) -> None:
        self._allocate.observe(seconds)

    def observe_poll(self, seconds: float) -> None:
        self._poll.observe(seconds)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition for GET /metrics with this Accept header: (payload, content type).

        prometheus-client's own encoders, chosen by its own negotiation: OpenMetrics when the
        scraper asks for it (Prometheus does by default), else the classic text format. Only
        OpenMetrics carries the histograms' creation times, as the `_created` line that its
        format defines; the text format would turn them into series of their own, so they are
        left out of it."""
        encoder, content_type = choose_encoder(accept)
        if content_type.startswith(OPENMETRICS_TYPE):
            return encoder(self.registry), content_type
        return encoder(_WithoutCreated(self.registry)), content_type


class _WithoutCreated(Collector):
    """A registry's families less their `_created` samples (prometheus-client adds them to
    counters and histograms unless told otherwise process-wide)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if len(samples) == len(family.samples):
                yield family
                continue
            trimmed = Metric(family.name, family.documentation, family.type, family.unit)
            trimmed.samples = samples
            yield trimmed


def healthz(
    snapshot: NodeSnapshot | None,
    *,
    now_mono_s: float,
    now_wall_s: float,
    poll_stale_after_s: float,
    unregistered_after_s: float,
    mps_down_after_s: float = 30.0,
) -> tuple[bool, str]:
    """Liveness for GET /healthz: (ok, reason).

    Not ok before the first snapshot, when the last successful poll is older than
    `poll_stale_after_s` (wall clock), or when the plugin has been unregistered from the kubelet
    for longer than `unregistered_after_s` (monotonic clock), or when MPS is on and its control
    daemon has been down for longer than `mps_down_after_s` (monotonic clock)."""
    if snapshot is None:
        return False, "no poll yet"
    health = snapshot.health
    if health.last_poll_success_s <= 0:
        return False, "no successful poll yet"
    poll_age_s = now_wall_s - health.last_poll_success_s
    if poll_age_s > poll_stale_after_s:
        return False, (
            f"last successful poll {poll_age_s:.1f}s ago (limit {poll_stale_after_s:g}s)"
        )
    if health.mps is not None and not health.mps.up and health.mps.down_since_s > 0:
        down_s = now_mono_s - health.mps.down_since_s
        if down_s > mps_down_after_s:
            return False, (
                f"MPS control daemon down for {down_s:.1f}s (limit {mps_down_after_s:g}s): "
                f"{health.mps.error or 'not running'}"
            )
    if not health.registered and health.unregistered_since_s > 0:
        unregistered_s = now_mono_s - health.unregistered_since_s
        if unregistered_s > unregistered_after_s:
            return False, (
                f"not registered with the kubelet for {unregistered_s:.1f}s "
                f"(limit {unregistered_after_s:g}s)"
            )
    return True, "ok"
