"""The daemon's start-up, in order, and what it starts late.

`Daemon.run` (the root) reads top to bottom: the start lines; the state directory (and, unless
`listing_first`, the enforcer); what the frontend takes back from before a restart; the first
poll, which must succeed (nothing can be served before); the optional parts; the HTTP servers;
what the kubelet holds now, before the first device list goes out; then the task group: the poll
loop, the frontend, the optional parts, and the config reload.

With `listing_first` (`serve`, a new process) the metrics, the config reload and the enforcer
are imported and started once the kubelet has the first device list (or a registration failed,
or after FIRST_LIST_WAIT_S): a new process reaches the kubelet ~0.15 s sooner. Polls before are
not enforced; a scrape before makes the metrics at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from deviceplugin.config import Config
from deviceplugin.enforcement_mode import in_monitor_mode, mode_line
from deviceplugin.errors import StartupError
from deviceplugin.frontend import KubeletFrontend
from deviceplugin.lazymetrics import LazyMetrics
from deviceplugin.model import NodeSnapshot
from deviceplugin.parts.enforcement import Enforcement
from deviceplugin.poller import Poller
from deviceplugin.settings import DaemonSettings
from deviceplugin.usage.httpserver import HttpServer
from deviceplugin.usage.procs import pid_namespace_warning

if TYPE_CHECKING:
    from deviceplugin.live import LiveConfig
    from deviceplugin.reload import ReloadMetrics

log = logging.getLogger(__name__)

# The late parts start once the kubelet has the first device list, checked this often, or after
# this long at the latest (a kubelet slow to open its stream).
FIRST_LIST_CHECK_S = 0.005
FIRST_LIST_WAIT_S = 1.0


def log_start(
    frontend: KubeletFrontend, backend_name: str, config: Config, enforce_nvidia_config: bool
) -> None:
    """The start line, the config's warnings, monitor mode, and a PID namespace of the host's."""
    frontend.announce(backend_name)
    for warning in config.warnings:
        log.warning("config: %s", warning)
    mode = mode_line(config, enforce_nvidia_config)
    if mode:
        monitor = in_monitor_mode(config, enforce_nvidia_config)
        log.log(logging.WARNING if monitor else logging.INFO, "%s", mode)
    pid_namespace = pid_namespace_warning()
    if pid_namespace:
        log.warning("%s", pid_namespace)


async def first_poll(poller: Poller, backend_name: str) -> None:
    """The first poll; StartupError naming the backend when it does not answer in time."""
    try:
        await poller.poll_once()
    except TimeoutError as e:
        raise StartupError(
            f"the GPU backend {backend_name} did not answer its first poll within "
            f"{poller.timeout_s:g} s; see the log lines above for the GPU at fault"
        ) from e


def start_http(
    http: HttpServer | None, probes: HttpServer | None, settings: DaemonSettings
) -> None:
    if http is not None:
        try:
            http.start()
        except OSError as e:
            raise StartupError(f"{e.strerror}; set --metrics-address to a free host:port") from e
        log.info("serving metrics and status address=%s", settings.metrics_address)
    if probes is not None:
        try:
            probes.start()
        except OSError as e:
            raise StartupError(f"{e.strerror}; set --probe-address to a free host:port") from e


async def until_listed(frontend: KubeletFrontend, stop: asyncio.Event) -> None:
    """Until the kubelet has had the node's inventory once (see `FrontendHealth.listed`),
    `stop`, or FIRST_LIST_WAIT_S."""
    deadline = time.monotonic() + FIRST_LIST_WAIT_S
    while not stop.is_set() and time.monotonic() < deadline:
        if frontend.health(time.monotonic()).listed:
            return
        await asyncio.sleep(FIRST_LIST_CHECK_S)


async def after_listing(
    frontend: KubeletFrontend,
    stop: asyncio.Event,
    *,
    metrics: LazyMetrics,
    enforcement: Enforcement,
    start_reload: Callable[[], None],
) -> None:
    """listing_first: once the kubelet has the first device list, import (on a thread, so that
    the event loop keeps answering the kubelet) and start the metrics, the config reload and
    the enforcer. The enforcer starts even when stopping: it resumes what a daemon killed
    outright left stopped, which is owed."""
    await until_listed(frontend, stop)
    await asyncio.to_thread(import_late_parts)
    metrics.make()
    if not stop.is_set():
        start_reload()
    await enforcement.start()


def http_servers(
    settings: DaemonSettings,
    metrics: LazyMetrics,
    snapshot: Callable[[], NodeSnapshot | None],
    healthz: Callable[[], tuple[bool, str]],
) -> tuple[HttpServer | None, HttpServer | None]:
    """The metrics and status server, and the probes' own (each where an address is given)."""
    http = probes = None
    if settings.metrics_address:
        http = HttpServer(
            settings.metrics_address, metrics, snapshot, healthz, tls=settings.metrics_tls
        )
    if settings.probe_address:
        probes = HttpServer(settings.probe_address, metrics, snapshot, healthz, probes_only=True)
    return http, probes


def import_late_parts() -> None:
    """What listing_first starts after the first device list: imported here, off the loop."""
    import deviceplugin.enforcer  # noqa: PLC0415
    import deviceplugin.reload  # noqa: PLC0415
    import deviceplugin.usage.metrics  # noqa: F401, PLC0415


def start_reload(
    tasks: asyncio.TaskGroup,
    stop: asyncio.Event,
    hangup: asyncio.Event | None,
    *,
    live: LiveConfig,
    settings: DaemonSettings,
    metrics: Callable[[], ReloadMetrics],
) -> None:
    """The config file's watch (and SIGHUP), and per-node configs' watch of the Node."""
    from deviceplugin.reload import (  # noqa: PLC0415 (see the module's docstring)
        ConfigReloader,
        report_hangups_without_a_config,
    )

    node_config = settings.node_config
    if settings.config_path is not None or node_config is not None:
        reloader = ConfigReloader(
            live,
            settings.config_path,
            metrics(),
            settings.config_hash,
            watch_dir=node_config.rules.directory if node_config else None,
        )
        tasks.create_task(reloader.run(stop, hangup or asyncio.Event()), name="config-reload")
        if node_config is not None:
            tasks.create_task(
                node_config.run(stop, reloader.switch, reloader.refuse), name="node-config"
            )
    elif hangup is not None:
        tasks.create_task(report_hangups_without_a_config(stop, hangup), name="config-reload")
