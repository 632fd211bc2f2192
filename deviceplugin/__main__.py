"""Command line: argument parsing only. Each subcommand resolves its settings here, at the edge.

Exit codes: 0 success; 1 the daemon failed at run time; 2 bad configuration or usage
(including a backend that cannot start, such as a missing state file or GPU driver); 3 from
`check-config --backend`: the config is valid but the backend cannot start.
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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin import __version__, logs
from deviceplugin.config import Config, DeviceIdStrategy
from deviceplugin.dra.settings import DraSettings, GpuCdi
from deviceplugin.errors import BackendError, ConfigError, StartupError
from deviceplugin.flags import (
    CHECK_CONFIG_FLAGS,
    DEMO_FLAGS,
    SERVE_FLAGS,
    STATUS_FLAGS,
    add_flags,
)

if TYPE_CHECKING:
    from deviceplugin.app import DaemonSettings
    from deviceplugin.nodeconfig import NodeConfig
    from deviceplugin.usage.httpserver import TlsFiles

log = logging.getLogger("deviceplugin")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
# 128 + SIGPIPE, what a shell reports for a command that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    """The command line, from the flag tables of deviceplugin.flags."""
    parser = argparse.ArgumentParser(
        prog="vgpu-device-plugin",
        description="Slice GPUs into memory and compute shares for Kubernetes, and enforce them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the daemon (one per GPU node)",
        description="Run the daemon. Each flag can also be set by the environment variable "
        "named in its help; a flag wins over the environment.",
    )
    add_flags(serve, SERVE_FLAGS)
    check = sub.add_parser(
        "check-config", help="validate a config file and print the slicing plan (exit 2 on error)"
    )
    add_flags(check, CHECK_CONFIG_FLAGS)
    sub.add_parser(
        "config-schema",
        help="print the JSON Schema of the config file (for editors and check-jsonschema)",
    )
    demo = sub.add_parser(
        "demo", help="the whole system on fake GPUs with a built-in kubelet, on any machine"
    )
    add_flags(demo, DEMO_FLAGS)
    status = sub.add_parser(
        "status", help="a terminal view of a running daemon, like nvidia-smi for slices"
    )
    add_flags(status, STATUS_FLAGS)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _dra_settings(args: argparse.Namespace) -> DraSettings | None:
    """The DRA driver's settings in `--kubelet-api dra` mode, else None; ValueError naming
    the flag at fault."""
    if args.kubelet_api != "dra":
        return None
    if not args.node_name:
        raise ValueError(
            "--kubelet-api dra needs --node-name (or NODE_NAME): the pool it publishes"
        )
    return DraSettings(
        node_name=args.node_name,
        kubelet_root_dir=Path(args.kubelet_root_dir).absolute(),
        cdi_dir=Path(args.cdi_dir).absolute(),
        kubeconfig=Path(args.kubeconfig).absolute() if args.kubeconfig else None,
        gpu_cdi=GpuCdi(args.dra_gpu_cdi),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from deviceplugin.app import serve  # noqa: PLC0415 (keeps check-config light)

    logs.configure(args.log_format, getattr(logging, args.log_level.upper()))
    os.umask(0o077)  # every socket and file the daemon creates is owner-only
    settings = _serve_settings(args)
    if settings is None:
        return EXIT_USAGE
    hangup = asyncio.Event()
    return run_until_signalled(
        lambda stop: serve(settings, stop, hangup),
        on_hangup=hangup.set,
        wait_on_start_error=args.fail_on_init_error == "false",
    )


def _serve_settings(args: argparse.Namespace) -> DaemonSettings | None:
    """The daemon's settings from its flags and config; None, the problem logged, when a flag or
    the config is bad."""
    if args.node_features_file:
        from deviceplugin.config.vgpu import feature_file_name_problem  # noqa: PLC0415

        problem = feature_file_name_problem(args.node_features_file)
        if problem:
            log.error("config error source=--node-features-file problem=%s", problem)
            return None
    try:
        settings = _daemon_settings(args)
    except ConfigError as e:
        for problem in e.problems:
            log.error("config error source=%s problem=%s", e.source, problem)
        return None
    except StartupError as e:
        log.error("cannot start: %s", e)
        return None
    from deviceplugin.usage.cgroups import KubeletTree, kubelet_layout  # noqa: PLC0415

    try:
        KubeletTree(kubelet_layout(settings.kubelet_cgroup_driver, settings.kubelet_cgroup_root))
    except ValueError as e:
        log.error(
            "bad --kubelet-cgroup-root problem=%s; give the kubelet's --cgroup-root (an absolute "
            "path; a slice such as /kubelet.slice with the systemd driver)",
            e,
        )
        return None
    from deviceplugin.usage.httpserver import parse_address  # noqa: PLC0415

    for flag, address in (
        ("--metrics-address", settings.metrics_address),
        ("--probe-address", settings.probe_address),
    ):
        try:
            if address:
                parse_address(address)
        except ValueError as e:
            log.error("config error source=%s problem=%s", flag, e)
            return None
    try:
        dra = _dra_settings(args)
    except ValueError as e:
        log.error("config error source=--kubelet-api problem=%s", e)
        return None
    tls_problem = _tls_problem(args)
    if tls_problem:
        log.error("config error source=--metrics-tls-cert problem=%s", tls_problem)
        return None
    return replace(settings, dra=dra, metrics_tls=_tls_files(args))


def _daemon_settings(args: argparse.Namespace) -> DaemonSettings:
    """The settings the config and the path flags give, the paths made absolute here, once
    (gRPC and the kubelet need absolute ones). Raises ConfigError, StartupError."""
    from deviceplugin.app import DaemonSettings  # noqa: PLC0415
    from deviceplugin.reload import config_hash, read_config  # noqa: PLC0415
    from deviceplugin.settings import MemoryLimitSettings  # noqa: PLC0415

    backend = args.backend
    if backend.startswith("fake:") and backend != "fake:":
        backend = f"fake:{Path(backend.removeprefix('fake:')).absolute()}"
    config_path = Path(args.config).absolute() if args.config else None
    node_config = _node_config(args)
    if node_config is not None:
        config_path = asyncio.run(node_config.initial())
    loaded = read_config(config_path) if config_path else None
    probe_root = args.memory_limit_probe_root or ""
    if probe_root and (
        not probe_root.startswith("/")
        or {".", ".."} & set(probe_root.split("/"))
        or "\0" in probe_root
    ):
        raise StartupError(
            f"--memory-limit-probe-root {probe_root!r} is not a cgroup path from the hierarchy's "
            "root: give an absolute path without . or .. components (e.g. / or /vgpu)"
        )
    return DaemonSettings(
        config=loaded.config if loaded else Config(),
        config_path=config_path,
        config_hash=loaded.hash if loaded else config_hash(b""),
        backend=backend,
        device_plugin_dir=Path(args.device_plugin_dir).absolute(),
        pod_resources_socket=Path(args.pod_resources_socket).absolute(),
        metrics_address=args.metrics_address,
        probe_address=args.probe_address,
        state_dir=Path(args.state_dir).absolute(),
        node_features_dir=Path(args.node_features_dir).absolute()
        if args.node_features_dir
        else None,
        node_name=args.node_name,
        trust_host_processes=args.trust_host_processes,
        node_config=node_config,
        node_features_file=args.node_features_file,
        kubelet_cgroup_driver=args.kubelet_cgroup_driver,
        kubelet_cgroup_root=args.kubelet_cgroup_root,
        device_id_strategy=(
            DeviceIdStrategy(args.device_id_strategy) if args.device_id_strategy else None
        ),
        enforce_nvidia_config=args.enforce_nvidia_config == "true",
        memory_limits=(
            MemoryLimitSettings(
                socket=Path(args.memory_limit_socket).absolute(),
                hook_path=args.memory_limit_hook,
                cdi_dir=Path(args.cdi_dir).absolute(),
            )
            if args.memory_limits == "on"
            else None
        ),
        cgroup_mount=Path(args.cgroup_mount).absolute(),
        memory_limit_probe_root=probe_root,
    )


def _node_config(args: argparse.Namespace) -> NodeConfig | None:
    """Per-node configs from --config-dir, or None. Raises ConfigError on bad flags."""
    if not args.config_dir:
        return None
    # Only here: it brings the Kubernetes API client, which nothing else in `serve` needs.
    from deviceplugin.nodeconfig import NodeConfig, NodeConfigRules, parse_fallback  # noqa: PLC0415

    if args.config:
        raise ConfigError(
            [
                "--config and --config-dir exclude each other: give one config file, or a "
                "directory of named configs chosen per node"
            ],
            "--config-dir",
        )
    try:
        fallback = parse_fallback(args.fallback_strategies)
    except ValueError as e:
        raise ConfigError([str(e)], "--fallback-strategies") from e
    rules = NodeConfigRules(
        Path(args.config_dir).absolute(), args.config_label, args.default_config, fallback
    )
    return NodeConfig(rules, args.node_name, kubeconfig=args.kubeconfig)


def _tls_problem(args: argparse.Namespace) -> str:
    """What is wrong with the TLS flags taken together, or ""."""
    if bool(args.metrics_tls_cert) != bool(args.metrics_tls_key):
        return "--metrics-tls-cert and --metrics-tls-key go together: give both or neither"
    if args.metrics_client_ca and not args.metrics_tls_cert:
        return "--metrics-client-ca needs --metrics-tls-cert and --metrics-tls-key (HTTPS)"
    if args.metrics_client_names and not args.metrics_client_ca:
        return "--metrics-client-names needs --metrics-client-ca (client certificates to name)"
    if args.metrics_client_names and not _client_names(args.metrics_client_names):
        return f"--metrics-client-names {args.metrics_client_names!r} names no client"
    return ""


def _client_names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The metrics endpoint's HTTPS files, or None for plain HTTP."""
    if not args.metrics_tls_cert:
        return None
    from deviceplugin.usage.httpserver import TlsFiles  # noqa: PLC0415

    return TlsFiles(
        Path(args.metrics_tls_cert).absolute(),
        Path(args.metrics_tls_key).absolute(),
        Path(args.metrics_client_ca).absolute() if args.metrics_client_ca else None,
        _client_names(args.metrics_client_names),
    )


def run_until_signalled(
    main: Callable[[asyncio.Event], Awaitable[None]],
    on_hangup: Callable[[], None] | None = None,
    *,
    wait_on_start_error: bool = False,
) -> int:
    """Run `main(stop)` on a new event loop; SIGTERM, SIGINT and SIGQUIT set `stop`, and so does
    SIGHUP unless `on_hangup` is given (`serve` reloads its config on SIGHUP). With
    `wait_on_start_error` (NVIDIA's failOnInitError: false), a daemon that cannot start waits for
    `stop` instead of exiting, so that a node without a GPU does not restart it forever."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Every way an operator asks a process to go ends in the same clean stop, which resumes
        # what the enforcer holds stopped; SIGKILL is left to the next start.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, on_hangup or stop.set)
        try:
            await main(stop)
        except (BackendError, StartupError) as e:
            log.error("cannot start: %s", e)
            if wait_on_start_error:
                log.warning("--fail-on-init-error false: waiting until stopped instead of exiting")
                await stop.wait()
                return EXIT_OK
            return EXIT_USAGE
        except ExceptionGroup as group:
            for failure in group.exceptions:
                log.error("stopped on error: %s", failure, exc_info=failure)
            return EXIT_RUNTIME
        return EXIT_OK

    return asyncio.run(runner())


def cmd_check_config(args: argparse.Namespace) -> int:
    from deviceplugin.check import check_config  # noqa: PLC0415

    return check_config(
        Path(args.path),
        args.backend,
        sys.stdout,
        sys.stderr,
        enforce_nvidia_config=args.enforce_nvidia_config == "true",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from deviceplugin.sim.demo import run_demo  # noqa: PLC0415

    # The demo's own view is on stdout; the daemon's log lines only with --verbose (errors always).
    logs.configure("text", logging.INFO if args.verbose else logging.ERROR)
    return run_demo(duration_s=args.duration, out=sys.stdout)


def cmd_config_schema(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from deviceplugin.config.schema import config_schema  # noqa: PLC0415

    print(json.dumps(config_schema(), indent=2, ensure_ascii=False))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from deviceplugin.usage.statuscli import StatusTls, run_status  # noqa: PLC0415

    # In the daemon's pod VGPU_METRICS_TLS_CERT says it serves HTTPS, with that certificate.
    daemon_cert = os.environ.get("VGPU_METRICS_TLS_CERT", "")
    tls = None
    if daemon_cert or args.ca_file or args.client_cert or args.client_key:
        tls = StatusTls(args.ca_file, daemon_cert, args.client_cert, args.client_key)
    return run_status(
        args.address, args.watch, as_json=args.json, out=sys.stdout, err=sys.stderr, tls=tls
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; a flag the command does not know gets that command's usage, not the
    top level's (`serve --bakend x` shows serve's flags)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command: argparse.ArgumentParser = args.command_parser
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {
        "serve": cmd_serve,
        "check-config": cmd_check_config,
        "config-schema": cmd_config_schema,
        "demo": cmd_demo,
        "status": cmd_status,
    }
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        # The reader went away (`check-config FILE | head -1`, Ctrl-C on `demo | cat`): end
        # quietly, as a command killed by SIGPIPE would, without a traceback. Later writes to the
        # closed pipe (the interpreter flushes stdout at exit) go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
