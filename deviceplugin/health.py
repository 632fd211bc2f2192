"""The daemon's health in one place: the poll's, the frontend's (registration, pod-resources)
and the optional parts' (MPS) state put together for /healthz, /status and the self-metrics, and
/healthz's verdict on it."""

from __future__ import annotations

import time

from deviceplugin.config import Config
from deviceplugin.frontend import FrontendHealth
from deviceplugin.model import DaemonHealth, MpsStatus, NodeSnapshot
from deviceplugin.poller import Poller, idle_interval_s

# /healthz fails when no poll has succeeded for this many intervals (and this many idle intervals,
# and at least this long), or when the plugin has not been registered with the kubelet for this
# long.
HEALTHZ_STALE_POLLS = 20
HEALTHZ_STALE_IDLE_POLLS = 5
HEALTHZ_MIN_STALE_S = 10.0
HEALTHZ_UNREGISTERED_S = 60.0


def daemon_health(poller: Poller, frontend: FrontendHealth, mps: MpsStatus | None) -> DaemonHealth:
    """The daemon's state now (read on the poll worker and on HTTP threads)."""
    since = frontend.unregistered_since_s
    return DaemonHealth(
        registered=frontend.registered,
        unregistered_since_s=since,
        unregistered_since_wall_s=time.time() - (time.monotonic() - since) if since > 0 else 0.0,
        registrations_total=frontend.registrations_total,
        registration_failures_total=frontend.registration_failures_total,
        last_poll_success_s=poller.last_success_wall_s,
        poll_failures_consecutive=poller.failures,
        poll_interval_s=poller.interval_s,
        polling_idle=poller.idle,
        pod_resources_ok=frontend.pod_resources_ok,
        mps=mps,
    )


def healthz(
    config: Config, snapshot: NodeSnapshot | None, frontend_problem: str
) -> tuple[bool, str]:
    """/healthz: (ok, reason). The frontend's own reasons first: they say what to do."""
    from deviceplugin.usage.metrics import healthz as verdict  # noqa: PLC0415 (with the metrics)

    if frontend_problem:
        return False, frontend_problem
    interval = config.enforcement.poll_interval_s
    return verdict(
        snapshot,
        now_mono_s=time.monotonic(),
        now_wall_s=time.time(),
        poll_stale_after_s=max(
            HEALTHZ_STALE_POLLS * interval,
            HEALTHZ_STALE_IDLE_POLLS * idle_interval_s(config),
            HEALTHZ_MIN_STALE_S,
        ),
        unregistered_after_s=HEALTHZ_UNREGISTERED_S,
    )
