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
from deviceplugin.enforcement_mode import ENV as ENFORCE_ENV
from deviceplugin.enforcement_mode import FLAG as ENFORCE_FLAG
from deviceplugin.errors import BackendError, ConfigError, StartupError
from deviceplugin.kubelet.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET

if TYPE_CHECKING:
    from deviceplugin.nodeconfig import NodeConfig

log = logging.getLogger("deviceplugin")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
# 128 + SIGPIPE, what a shell reports for a command that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_METRICS_ADDRESS = ":9410"
DEFAULT_STATE_DIR = "/var/lib/vgpu"


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _one_of(options: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of `options`, in any case. argparse applies it to a default read
    from the environment too, so a bad VGPU_LOG_LEVEL is reported like a bad flag."""

    def parse(value: str) -> str:
        if value.lower() not in options:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(options)}")
        return value.lower()

    parse.__name__ = "value"
    return parse


def build_parser() -> argparse.ArgumentParser:
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
    serve.add_argument(
        "--config",
        metavar="PATH",
        default=_env("VGPU_CONFIG", ""),
        help="config file, YAML or JSON (default: the built-in defaults; env VGPU_CONFIG); "
        "reloaded without a restart on SIGHUP and when its content changes",
    )
    serve.add_argument(
        "--backend",
        metavar="nvml|fake:PATH",
        default=_env("VGPU_BACKEND", "nvml"),
        help="nvml for the node's GPUs, or fake:PATH for fake GPUs from a JSON state file "
        "(default: nvml; env VGPU_BACKEND)",
    )
    serve.add_argument(
        "--device-plugin-dir",
        metavar="DIR",
        default=_env("VGPU_DEVICE_PLUGIN_DIR", DEFAULT_DEVICE_PLUGIN_DIR),
        help="the kubelet's device-plugin directory "
        f"(default: {DEFAULT_DEVICE_PLUGIN_DIR}; env VGPU_DEVICE_PLUGIN_DIR)",
    )
    serve.add_argument(
        "--pod-resources-socket",
        metavar="PATH",
        default=_env("VGPU_POD_RESOURCES_SOCKET", DEFAULT_POD_RESOURCES_SOCKET),
        help="the kubelet's pod-resources socket "
        f"(default: {DEFAULT_POD_RESOURCES_SOCKET}; env VGPU_POD_RESOURCES_SOCKET)",
    )
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        default=_env("VGPU_METRICS_ADDRESS", DEFAULT_METRICS_ADDRESS),
        help="where /metrics, /status and /healthz are served; an empty host means every "
        f"address (default: {DEFAULT_METRICS_ADDRESS}; env VGPU_METRICS_ADDRESS)",
    )
    serve.add_argument(
        "--probe-address",
        metavar="HOST:PORT",
        default=_env("VGPU_PROBE_ADDRESS", ""),
        help="also serve /healthz alone, plain HTTP, for the kubelet's probes, on a listener "
        "that no client of the metrics address can crowd out (the DaemonSet: :9411) "
        "(default: none; env VGPU_PROBE_ADDRESS)",
    )
    serve.add_argument(
        "--metrics-tls-cert",
        metavar="PATH",
        default=_env("VGPU_METRICS_TLS_CERT", ""),
        help="serve the metrics endpoint over HTTPS with this PEM certificate (chain); needs "
        "--metrics-tls-key (default: plain HTTP; env VGPU_METRICS_TLS_CERT)",
    )
    serve.add_argument(
        "--metrics-tls-key",
        metavar="PATH",
        default=_env("VGPU_METRICS_TLS_KEY", ""),
        help="the PEM private key of --metrics-tls-cert (default: none; env VGPU_METRICS_TLS_KEY)",
    )
    serve.add_argument(
        "--metrics-client-ca",
        metavar="PATH",
        default=_env("VGPU_METRICS_CLIENT_CA", ""),
        help="answer /metrics and /status only to clients whose certificate this PEM CA signed "
        "(/healthz answers every client); needs --metrics-tls-cert (default: any client; "
        "env VGPU_METRICS_CLIENT_CA)",
    )
    serve.add_argument(
        "--metrics-client-names",
        metavar="NAME,...",
        default=_env("VGPU_METRICS_CLIENT_NAMES", ""),
        help="with --metrics-client-ca, answer only client certificates that name one of these "
        "(a DNS or URI subject alternative name, or the common name), e.g. prometheus "
        "(default: any certificate the CA signed; env VGPU_METRICS_CLIENT_NAMES)",
    )
    serve.add_argument(
        "--state-dir",
        metavar="DIR",
        default=_env("VGPU_STATE_DIR", DEFAULT_STATE_DIR),
        help="directory for what must survive a daemon restart, such as the processes held "
        f"stopped (default: {DEFAULT_STATE_DIR}; env VGPU_STATE_DIR)",
    )
    serve.add_argument(
        "--node-features-dir",
        metavar="DIR",
        default=_env("VGPU_NODE_FEATURES_DIR", ""),
        help="node feature discovery's features.d directory: the only place node labels "
        "(nodeLabels.file) are written (default: none, no node labels; env "
        "VGPU_NODE_FEATURES_DIR)",
    )
    serve.add_argument(
        "--node-name",
        metavar="NAME",
        default=_env("NODE_NAME", ""),
        help="this node's name, the node label of every metric (default: empty; env NODE_NAME)",
    )
    serve.add_argument(
        "--config-dir",
        metavar="DIR",
        default=_env("VGPU_CONFIG_DIR", ""),
        help="per-node configs: a directory of named config files (a ConfigMap volume), one "
        "chosen by the node's label --config-label, read through the Kubernetes API (RBAC: get "
        "on nodes); a change of the label switches configs live; instead of --config "
        "(default: none; env VGPU_CONFIG_DIR)",
    )
    serve.add_argument(
        "--config-label",
        metavar="LABEL",
        default=_env("VGPU_CONFIG_LABEL", "nvidia.com/device-plugin.config"),
        help="the node label that names the node's config in --config-dir "
        "(default: nvidia.com/device-plugin.config; env VGPU_CONFIG_LABEL)",
    )
    serve.add_argument(
        "--default-config",
        metavar="NAME",
        default=_env("VGPU_DEFAULT_CONFIG", ""),
        help="the config of --config-dir for a node without the label "
        "(default: the fallback strategies choose; env VGPU_DEFAULT_CONFIG)",
    )
    serve.add_argument(
        "--fallback-strategies",
        metavar="LIST",
        default=_env("VGPU_FALLBACK_STRATEGIES", "named,single"),
        help="without the label or a default config: named (the config named default), single "
        "(the only config), empty (the built-in defaults), tried in order "
        "(default: named,single; env VGPU_FALLBACK_STRATEGIES)",
    )
    serve.add_argument(
        "--kubeconfig",
        metavar="PATH",
        default=_env("VGPU_KUBECONFIG", ""),
        help="for --config-dir and --kubelet-api dra outside a pod: a kubeconfig file for the "
        "API server (default: the pod's service account; env VGPU_KUBECONFIG)",
    )
    serve.add_argument(
        "--node-features-file",
        metavar="NAME",
        default=_env("VGPU_NODE_FEATURES_FILE", ""),
        help="the node feature file's name in --node-features-dir, where the config names none: "
        "the node labels of any config, NVIDIA's too (default: none; "
        "env VGPU_NODE_FEATURES_FILE)",
    )
    serve.add_argument(
        "--fail-on-init-error",
        metavar="true|false",
        type=_one_of(("true", "false")),
        default=_env("VGPU_FAIL_ON_INIT_ERROR", "true"),
        help="false: when the GPU backend cannot start (no GPU or driver on the node), log it "
        "and wait until stopped instead of exiting (default: true; env VGPU_FAIL_ON_INIT_ERROR)",
    )
    serve.add_argument(
        "--device-id-strategy",
        metavar="uuid|index",
        type=_one_of(("uuid", "index")),
        default=os.environ.get("VGPU_DEVICE_ID_STRATEGY") or None,
        help="what the container runtime is told a GPU is called: uuid, or index (0, 0:1 for a "
        "MIG device), as NVIDIA's --device-id-strategy; wins over the config file's "
        "deviceIDStrategy (default: the config file's, uuid; env VGPU_DEVICE_ID_STRATEGY)",
    )
    _add_enforce_nvidia_config_flag(serve)
    serve.add_argument(
        "--trust-host-processes",
        action="store_true",
        default=_env("VGPU_TRUST_HOST_PROCESSES", "") in ("1", "true"),
        help="let processes outside every pod cgroup keep the allocation they claim; only with "
        "--backend fake:PATH, for demos and tests (default: off; env VGPU_TRUST_HOST_PROCESSES)",
    )
    serve.add_argument(
        "--kubelet-cgroup-driver",
        choices=("auto", "cgroupfs", "systemd"),
        default=_env("VGPU_KUBELET_CGROUP_DRIVER", "auto"),
        help="the kubelet's cgroup driver: where a pod's containers are (default: auto, read from "
        "this daemon's own pod container; env VGPU_KUBELET_CGROUP_DRIVER)",
    )
    serve.add_argument(
        "--kubelet-cgroup-root",
        metavar="PATH",
        default=_env("VGPU_KUBELET_CGROUP_ROOT", ""),
        help="the kubelet's --cgroup-root (default: read with the driver, else /; env "
        "VGPU_KUBELET_CGROUP_ROOT)",
    )
    _add_dra_flags(serve)
    _add_log_flags(serve)

    check = sub.add_parser(
        "check-config", help="validate a config file and print the slicing plan (exit 2 on error)"
    )
    check.add_argument("path", help="config file to check")
    check.add_argument(
        "--backend",
        metavar="nvml|fake:PATH",
        default=os.environ.get("VGPU_BACKEND", ""),
        help="plan for the GPUs of this backend; exit 3 if it cannot start while the config "
        "is valid (default: the demo's GPUs; env VGPU_BACKEND)",
    )
    _add_enforce_nvidia_config_flag(check)

    sub.add_parser(
        "config-schema",
        help="print the JSON Schema of the config file (for editors and check-jsonschema)",
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
    status.add_argument(
        "--ca-file",
        default="",
        help="HTTPS: the PEM CA that signed the daemon's certificate (default: the daemon's own "
        "certificate, VGPU_METRICS_TLS_CERT, where set, as in its pod; else the system's CAs); "
        "an https:// address, VGPU_METRICS_TLS_CERT or any of these flags turns HTTPS on",
    )
    status.add_argument(
        "--client-cert",
        default="",
        help="HTTPS: the PEM certificate to present to a daemon that requires one "
        "(--metrics-client-ca); needs --client-key",
    )
    status.add_argument("--client-key", default="", help="the PEM key of --client-cert")
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _add_enforce_nvidia_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        ENFORCE_FLAG,
        metavar="true|false",
        type=_one_of(("true", "false")),
        default=_env(ENFORCE_ENV, "false"),
        help="true: enforce an NVIDIA-format config (kill, throttle) as a vgpu-format one is; "
        "false: such a config runs in monitor mode, deciding, logging and counting what it "
        "would do and signalling nothing; a vgpu-format config is enforced as it says either "
        f"way (default: false; env {ENFORCE_ENV})",
    )


KUBELET_APIS = ("device-plugin", "dra")
GPU_CDI = ("nvidia", "device-nodes")


def _add_dra_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubelet-api",
        metavar="|".join(KUBELET_APIS),
        type=_one_of(KUBELET_APIS),
        default=_env("VGPU_KUBELET_API", "device-plugin"),
        help="how pods get GPUs: device-plugin (slices of an extended resource) or dra (a DRA "
        "driver: claims ask for memory and compute; docs/dra.md) "
        "(default: device-plugin; env VGPU_KUBELET_API)",
    )
    parser.add_argument(
        "--kubelet-root-dir",
        metavar="DIR",
        default=_env("VGPU_KUBELET_ROOT_DIR", "/var/lib/kubelet"),
        help="dra: the kubelet's root directory, holding plugins_registry/ and plugins/ "
        "(default: /var/lib/kubelet; env VGPU_KUBELET_ROOT_DIR)",
    )
    parser.add_argument(
        "--cdi-dir",
        metavar="DIR",
        default=_env("VGPU_CDI_DIR", "/var/run/cdi"),
        help="dra: where the CDI spec of each prepared claim is written "
        "(default: /var/run/cdi; env VGPU_CDI_DIR)",
    )
    parser.add_argument(
        "--dra-gpu-cdi",
        metavar="|".join(GPU_CDI),
        type=_one_of(GPU_CDI),
        default=_env("VGPU_DRA_GPU_CDI", "nvidia"),
        help="dra: the GPU itself through NVIDIA's CDI device nvidia.com/gpu=<uuid>, or through "
        "device nodes in vgpu's own CDI spec (default: nvidia; env VGPU_DRA_GPU_CDI)",
    )


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


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        metavar="|".join(LOG_FORMATS),
        type=_one_of(LOG_FORMATS),
        default=_env("VGPU_LOG_FORMAT", "text"),
        help="text: key=value lines; json: one JSON object a line (default: text; "
        "env VGPU_LOG_FORMAT)",
    )
    parser.add_argument(
        "--log-level",
        metavar="|".join(LOG_LEVELS),
        type=_one_of(LOG_LEVELS),
        default=_env("VGPU_LOG_LEVEL", "info"),
        help="the least severe lines written; every enforcement action is a warning "
        "(default: info; env VGPU_LOG_LEVEL)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from deviceplugin.app import DaemonSettings, serve  # noqa: PLC0415 (keeps check-config light)
    from deviceplugin.reload import config_hash, read_config  # noqa: PLC0415

    logs.configure(args.log_format, getattr(logging, args.log_level.upper()))
    os.umask(0o077)  # every socket and file the daemon creates is owner-only
    if args.node_features_file:
        from deviceplugin.config.vgpu import feature_file_name_problem  # noqa: PLC0415

        problem = feature_file_name_problem(args.node_features_file)
        if problem:
            log.error("config error source=--node-features-file problem=%s", problem)
            return EXIT_USAGE
    try:
        # Paths are made absolute here, once: gRPC and the kubelet need absolute ones.
        backend = args.backend
        if backend.startswith("fake:") and backend != "fake:":
            backend = f"fake:{Path(backend.removeprefix('fake:')).absolute()}"
        config_path = Path(args.config).absolute() if args.config else None
        node_config = _node_config(args)
        if node_config is not None:
            config_path = asyncio.run(node_config.initial())
        loaded = read_config(config_path) if config_path else None
        settings = DaemonSettings(
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
        )
    except ConfigError as e:
        for problem in e.problems:
            log.error("config error source=%s problem=%s", e.source, problem)
        return EXIT_USAGE
    except StartupError as e:
        log.error("cannot start: %s", e)
        return EXIT_USAGE
    from deviceplugin.usage.cgroups import KubeletTree, kubelet_layout  # noqa: PLC0415

    try:
        KubeletTree(kubelet_layout(settings.kubelet_cgroup_driver, settings.kubelet_cgroup_root))
    except ValueError as e:
        log.error(
            "bad --kubelet-cgroup-root problem=%s; give the kubelet's --cgroup-root (an absolute "
            "path; a slice such as /kubelet.slice with the systemd driver)",
            e,
        )
        return EXIT_USAGE
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
            return EXIT_USAGE
    try:
        dra = _dra_settings(args)
    except ValueError as e:
        log.error("config error source=--kubelet-api problem=%s", e)
        return EXIT_USAGE
    if dra is not None:
        settings = replace(settings, dra=dra)
    tls_problem = _tls_problem(args)
    if tls_problem:
        log.error("config error source=--metrics-tls-cert problem=%s", tls_problem)
        return EXIT_USAGE
    if args.metrics_tls_cert:
        from deviceplugin.usage.httpserver import TlsFiles  # noqa: PLC0415

        settings = replace(
            settings,
            metrics_tls=TlsFiles(
                Path(args.metrics_tls_cert).absolute(),
                Path(args.metrics_tls_key).absolute(),
                Path(args.metrics_client_ca).absolute() if args.metrics_client_ca else None,
                _client_names(args.metrics_client_names),
            ),
        )
    hangup = asyncio.Event()
    return run_until_signalled(
        lambda stop: serve(settings, stop, hangup),
        on_hangup=hangup.set,
        wait_on_start_error=args.fail_on_init_error == "false",
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
