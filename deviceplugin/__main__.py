"""Command line: argument parsing only. Each subcommand resolves its settings here, at the edge.

Exit codes: 0 success; 1 the daemon failed at run time; 2 bad configuration or usage
(including a backend that cannot start, such as a missing state file or GPU driver).
"""

from __future__ import annotations

import os

# gRPC's C core reads this once, when grpc is first imported: keep its INFO chatter (a kubelet
# closing a connection logs "Got goaway") out of the daemon's log unless the operator asks.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from deviceplugin import __version__, logs
from deviceplugin.config import Config, load_config
from deviceplugin.errors import BackendError, ConfigError, StartupError
from deviceplugin.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET

log = logging.getLogger("deviceplugin")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu-device-plugin",
        description="Slice GPUs into memory and compute shares for Kubernetes, and enforce them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon (one per GPU node)")
    serve.add_argument(
        "--config",
        default=_env("VGPU_CONFIG", ""),
        help="config file (YAML or JSON) [VGPU_CONFIG]; default: built-in defaults",
    )
    serve.add_argument(
        "--backend",
        default=_env("VGPU_BACKEND", "nvml"),
        help="nvml, or fake:PATH for fake GPUs from a JSON state file [VGPU_BACKEND]",
    )
    serve.add_argument(
        "--device-plugin-dir",
        default=_env("VGPU_DEVICE_PLUGIN_DIR", DEFAULT_DEVICE_PLUGIN_DIR),
        help="the kubelet's device-plugin directory [VGPU_DEVICE_PLUGIN_DIR]",
    )
    serve.add_argument(
        "--pod-resources-socket",
        default=_env("VGPU_POD_RESOURCES_SOCKET", DEFAULT_POD_RESOURCES_SOCKET),
        help="the kubelet's pod-resources socket [VGPU_POD_RESOURCES_SOCKET]",
    )
    serve.add_argument(
        "--metrics-address",
        default=_env("VGPU_METRICS_ADDRESS", ":9410"),
        help="host:port of the metrics endpoint [VGPU_METRICS_ADDRESS]",
    )
    serve.add_argument(
        "--state-dir",
        default=_env("VGPU_STATE_DIR", "/var/lib/vgpu"),
        help="directory for what must survive a daemon restart [VGPU_STATE_DIR]",
    )
    serve.add_argument(
        "--node-name", default=_env("NODE_NAME", ""), help="this node's name [NODE_NAME]"
    )
    serve.add_argument(
        "--trust-host-processes",
        action="store_true",
        default=_env("VGPU_TRUST_HOST_PROCESSES", "") in ("1", "true"),
        help="let processes outside every pod cgroup keep the allocation they claim; only with "
        "--backend fake:PATH, for demos and tests [VGPU_TRUST_HOST_PROCESSES]",
    )
    _add_log_flags(serve)

    check = sub.add_parser(
        "check-config", help="validate a config file and print the slicing plan (exit 2 on error)"
    )
    check.add_argument("path", help="config file to check")
    check.add_argument(
        "--backend",
        default=os.environ.get("VGPU_BACKEND", ""),
        help="plan for the GPUs of this backend (nvml or fake:PATH); default: the demo's GPUs",
    )

    demo = sub.add_parser(
        "demo", help="the whole system on fake GPUs with a built-in kubelet, on any machine"
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: run until Ctrl-C)",
    )
    demo.add_argument(
        "--verbose", action="store_true", help="also show the daemon's and kubelet's log lines"
    )

    status = sub.add_parser(
        "status", help="a terminal view of a running daemon, like nvidia-smi for slices"
    )
    status.add_argument(
        "--address",
        default=_env("VGPU_METRICS_ADDRESS", ":9410"),
        help="host:port of the daemon's metrics endpoint [VGPU_METRICS_ADDRESS]; "
        "an empty host means 127.0.0.1",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument("--json", action="store_true", help="print the raw /status JSON")
    return parser


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], default="info"
    )


def _load(path: str) -> Config:
    return load_config(Path(path)) if path else Config()


def cmd_serve(args: argparse.Namespace) -> int:
    from deviceplugin.app import DaemonSettings, serve  # noqa: PLC0415 (keeps check-config light)

    logs.configure(args.log_format, getattr(logging, args.log_level.upper()))
    os.umask(0o077)  # every socket and file the daemon creates is owner-only
    try:
        # Paths are made absolute here, once: gRPC and the kubelet need absolute ones.
        backend = args.backend
        if backend.startswith("fake:") and backend != "fake:":
            backend = f"fake:{Path(backend.removeprefix('fake:')).absolute()}"
        settings = DaemonSettings(
            config=_load(args.config),
            backend=backend,
            device_plugin_dir=Path(args.device_plugin_dir).absolute(),
            pod_resources_socket=Path(args.pod_resources_socket).absolute(),
            metrics_address=args.metrics_address,
            state_dir=Path(args.state_dir).absolute(),
            node_name=args.node_name,
            trust_host_processes=args.trust_host_processes,
        )
    except ConfigError as e:
        for problem in e.problems:
            log.error("config error source=%s problem=%s", e.source, problem)
        return EXIT_USAGE
    if settings.metrics_address:
        from deviceplugin.httpserver import parse_address  # noqa: PLC0415

        try:
            parse_address(settings.metrics_address)
        except ValueError as e:
            log.error("config error source=--metrics-address problem=%s", e)
            return EXIT_USAGE
    return run_until_signalled(lambda stop: serve(settings, stop))


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop)` on a new event loop; SIGTERM and SIGINT set `stop`."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Every way an operator asks a process to go ends in the same clean stop, which resumes
        # what the enforcer holds stopped; SIGKILL is left to the next start.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        except (BackendError, StartupError) as e:
            log.error("cannot start: %s", e)
            return EXIT_USAGE
        except ExceptionGroup as group:
            for failure in group.exceptions:
                log.error("stopped on error: %s", failure, exc_info=failure)
            return EXIT_RUNTIME
        return EXIT_OK

    return asyncio.run(runner())


def cmd_check_config(args: argparse.Namespace) -> int:
    from deviceplugin.check import check_config  # noqa: PLC0415

    return check_config(Path(args.path), args.backend, sys.stdout, sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from deviceplugin.demo import run_demo  # noqa: PLC0415

    # The demo's own view is on stdout; the daemon's log lines only with --verbose (errors always).
    logs.configure("text", logging.INFO if args.verbose else logging.ERROR)
    return run_demo(duration_s=args.duration, out=sys.stdout)


def cmd_status(args: argparse.Namespace) -> int:
    from deviceplugin.statuscli import run_status  # noqa: PLC0415

    return run_status(args.address, args.watch, as_json=args.json, out=sys.stdout, err=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "serve": cmd_serve,
        "check-config": cmd_check_config,
        "demo": cmd_demo,
        "status": cmd_status,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
