"""Every flag of the command line, declared once: its name, environment variable, default and
help. The parser, `--help` and the docs' flag tables (tools/gen_docs_tables.py) are made from
these tables; nothing else states a flag's variable or default.

A flag's value is the flag when given, else its environment variable when set and not empty,
else its default. `serve` then lets a flag given either way win over the config file where the
two overlap (`--device-id-strategy`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.enforcement_mode import ENV as ENFORCE_ENV
from deviceplugin.enforcement_mode import FLAG as ENFORCE_FLAG
from deviceplugin.kubelet.proto import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from deviceplugin.memlimits.cdihook import DEFAULT_HOOK_PATH, DEFAULT_SOCKET

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
KUBELET_APIS = ("device-plugin", "dra")
GPU_CDI = ("nvidia", "device-nodes")
CGROUP_DRIVERS = ("auto", "cgroupfs", "systemd")
BOOLEAN = ("true", "false")
ON_OFF = ("on", "off")
# What turns a switch on from its environment variable.
SWITCH_ON = ("1", "true")


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag. `help` says what it does; `--help` and the docs add its default and variable.

    `default` is the value, "" for none; `default_words` says what the default means where the
    value alone does not (after the value, or alone when there is none). `choices`: one of
    these, in any case, also from the variable. `switch`: given or not (its variable turns it on
    with 1 or true). `number`: a number of seconds; with `const`, the flag may be given alone and
    then means `const`. A name without leading dashes is a positional argument."""

    name: str
    help: str
    env: str = ""
    default: str = ""
    default_words: str = ""
    metavar: str = ""
    choices: tuple[str, ...] = ()
    switch: bool = False
    number: bool = False
    const: str = ""

    def shown_default(self) -> str:
        """The default as `--help` and the docs say it; "" when there is nothing to say."""
        if self.default and self.default_words:
            return f"{self.default}, {self.default_words}"
        return self.default or self.default_words

    def usage(self) -> str:
        """The flag as its usage writes it: `--backend nvml|fake:PATH`."""
        metavar = self.metavar or "|".join(self.choices)
        return f"{self.name} {metavar}" if metavar and not self.switch else self.name

    def full_help(self) -> str:
        """`help` with the default, the variable and what the flag alone means."""
        notes = []
        if self.shown_default():
            notes.append(f"default: {self.shown_default()}")
        if self.const:
            notes.append(f"{self.name} alone: {self.const}")
        if self.env:
            notes.append(f"env {self.env}")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help


ENFORCE_NVIDIA_CONFIG = Flag(
    ENFORCE_FLAG,
    "true: enforce an NVIDIA-format config (kill, throttle) as a vgpu-format one is; false: such "
    "a config runs in monitor mode, deciding, logging and counting what it would do and "
    "signalling nothing; a vgpu-format config is enforced as it says either way",
    env=ENFORCE_ENV,
    default="false",
    metavar="true|false",
    choices=BOOLEAN,
)

SERVE_FLAGS = (
    Flag(
        "--config",
        "config file, YAML or JSON; reloaded without a restart on SIGHUP and when its content "
        "changes",
        env="VGPU_CONFIG",
        default_words="the built-in defaults",
        metavar="PATH",
    ),
    Flag(
        "--backend",
        "nvml for the node's GPUs, or fake:PATH for fake GPUs from a JSON state file",
        env="VGPU_BACKEND",
        default="nvml",
        metavar="nvml|fake:PATH",
    ),
    Flag(
        "--device-plugin-dir",
        "the kubelet's device-plugin directory",
        env="VGPU_DEVICE_PLUGIN_DIR",
        default=DEFAULT_DEVICE_PLUGIN_DIR,
        metavar="DIR",
    ),
    Flag(
        "--pod-resources-socket",
        "the kubelet's pod-resources socket",
        env="VGPU_POD_RESOURCES_SOCKET",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metavar="PATH",
    ),
    Flag(
        "--metrics-address",
        "where /metrics, /status and /healthz are served; an empty host means every address",
        env="VGPU_METRICS_ADDRESS",
        default=":9410",
        metavar="HOST:PORT",
    ),
    Flag(
        "--probe-address",
        "also serve /healthz alone, plain HTTP, for the kubelet's probes, on a listener that no "
        "client of the metrics address can crowd out (the DaemonSet: :9411)",
        env="VGPU_PROBE_ADDRESS",
        default_words="none",
        metavar="HOST:PORT",
    ),
    Flag(
        "--metrics-tls-cert",
        "serve the metrics endpoint over HTTPS with this PEM certificate (chain); needs "
        "--metrics-tls-key",
        env="VGPU_METRICS_TLS_CERT",
        default_words="plain HTTP",
        metavar="PATH",
    ),
    Flag(
        "--metrics-tls-key",
        "the PEM private key of --metrics-tls-cert",
        env="VGPU_METRICS_TLS_KEY",
        default_words="none",
        metavar="PATH",
    ),
    Flag(
        "--metrics-client-ca",
        "answer /metrics and /status only to clients whose certificate this PEM CA signed "
        "(/healthz answers every client); needs --metrics-tls-cert",
        env="VGPU_METRICS_CLIENT_CA",
        default_words="any client",
        metavar="PATH",
    ),
    Flag(
        "--metrics-client-names",
        "with --metrics-client-ca, answer only client certificates that name one of these (a "
        "DNS or URI subject alternative name, or the common name), e.g. prometheus",
        env="VGPU_METRICS_CLIENT_NAMES",
        default_words="any certificate the CA signed",
        metavar="NAME,...",
    ),
    Flag(
        "--state-dir",
        "directory for what must survive a daemon restart, such as the processes held stopped "
        "and what each allocation was granted",
        env="VGPU_STATE_DIR",
        default="/var/lib/vgpu",
        metavar="DIR",
    ),
    Flag(
        "--node-features-dir",
        "node feature discovery's features.d directory: the only place node labels "
        "(nodeLabels.file) are written",
        env="VGPU_NODE_FEATURES_DIR",
        default_words="none, no node labels",
        metavar="DIR",
    ),
    Flag(
        "--node-name",
        "this node's name: the node label of every metric, and with --kubelet-api dra, where it "
        "is required, the pool the driver publishes",
        env="NODE_NAME",
        default_words="empty",
        metavar="NAME",
    ),
    Flag(
        "--config-dir",
        "per-node configs: a directory of named config files (a ConfigMap volume), one chosen by "
        "the node's label --config-label, read through the Kubernetes API (RBAC: get on nodes); "
        "a change of the label switches configs live; instead of --config",
        env="VGPU_CONFIG_DIR",
        default_words="none",
        metavar="DIR",
    ),
    Flag(
        "--config-label",
        "the node label that names the node's config in --config-dir",
        env="VGPU_CONFIG_LABEL",
        default="nvidia.com/device-plugin.config",
        metavar="LABEL",
    ),
    Flag(
        "--default-config",
        "the config of --config-dir for a node without the label",
        env="VGPU_DEFAULT_CONFIG",
        default_words="the fallback strategies choose",
        metavar="NAME",
    ),
    Flag(
        "--fallback-strategies",
        "without the label or a default config: named (the config named default), single (the "
        "only config), empty (the built-in defaults), tried in order, as NVIDIA's config-manager",
        env="VGPU_FALLBACK_STRATEGIES",
        default="named,single",
        metavar="LIST",
    ),
    Flag(
        "--kubeconfig",
        "for --config-dir and --kubelet-api dra outside a pod: a kubeconfig file for the API "
        "server",
        env="VGPU_KUBECONFIG",
        default_words="the pod's service account",
        metavar="PATH",
    ),
    Flag(
        "--node-features-file",
        "the node feature file's name in --node-features-dir, where the config names none: the "
        "node labels of any config, NVIDIA's too",
        env="VGPU_NODE_FEATURES_FILE",
        default_words="none",
        metavar="NAME",
    ),
    Flag(
        "--fail-on-init-error",
        "false: when the GPU backend cannot start (no GPU or driver on the node), log it and wait "
        "until stopped instead of exiting",
        env="VGPU_FAIL_ON_INIT_ERROR",
        default="true",
        metavar="true|false",
        choices=BOOLEAN,
    ),
    Flag(
        "--device-id-strategy",
        "what the container runtime is told a GPU is called: uuid, or index (0, 0:1 for a MIG "
        "device), as NVIDIA's --device-id-strategy; given, it wins over the config file's "
        "deviceIDStrategy, at start and on every reload",
        env="VGPU_DEVICE_ID_STRATEGY",
        default_words="the config file's, uuid",
        choices=("uuid", "index"),
    ),
    ENFORCE_NVIDIA_CONFIG,
    Flag(
        "--trust-host-processes",
        "let processes outside every pod cgroup keep the allocation they claim; only with "
        "--backend fake:PATH, for demos and tests",
        env="VGPU_TRUST_HOST_PROCESSES",
        default_words="off",
        switch=True,
    ),
    Flag(
        "--kubelet-cgroup-driver",
        "the kubelet's cgroup driver: where a pod's containers are",
        env="VGPU_KUBELET_CGROUP_DRIVER",
        default="auto",
        default_words="read from this daemon's own pod container",
        choices=CGROUP_DRIVERS,
    ),
    Flag(
        "--kubelet-cgroup-root",
        "the kubelet's --cgroup-root",
        env="VGPU_KUBELET_CGROUP_ROOT",
        default_words="read with the driver, else /",
        metavar="PATH",
    ),
    Flag(
        "--kubelet-api",
        "how pods get GPUs: device-plugin (slices of an extended resource) or dra (a DRA driver: "
        "claims ask for memory and compute; docs/dra.md)",
        env="VGPU_KUBELET_API",
        default="device-plugin",
        choices=KUBELET_APIS,
    ),
    Flag(
        "--kubelet-root-dir",
        "dra: the kubelet's root directory, holding plugins_registry/ and plugins/",
        env="VGPU_KUBELET_ROOT_DIR",
        default="/var/lib/kubelet",
        metavar="DIR",
    ),
    Flag(
        "--cdi-dir",
        "where CDI specs are written: each prepared claim's (dra), and each allocation's that "
        "carries the memory-limit hook (device plugins)",
        env="VGPU_CDI_DIR",
        default="/var/run/cdi",
        metavar="DIR",
    ),
    Flag(
        "--memory-limits",
        "on: where a GPU's driver partitions memory (R615, docs/design.md §15), each container's "
        "limit is set on its own cgroup by the runtime hook before its first instruction; off: "
        "every GPU's memory is polled",
        env="VGPU_MEMORY_LIMITS",
        default="on",
        choices=ON_OFF,
    ),
    Flag(
        "--memory-limit-socket",
        "the unix socket the runtime hook asks the daemon on (root only)",
        env="VGPU_MEMORY_LIMIT_SOCKET",
        default=str(DEFAULT_SOCKET),
        metavar="PATH",
    ),
    Flag(
        "--memory-limit-hook",
        "the runtime hook's path on the host, as the CDI specs name it (the DaemonSet copies it "
        "there from the image)",
        env="VGPU_MEMORY_LIMIT_HOOK",
        default=DEFAULT_HOOK_PATH,
        metavar="PATH",
    ),
    Flag(
        "--cgroup-mount",
        "the unified (v2) cgroup hierarchy as this daemon sees it (/sys/fs/cgroup/unified on a "
        "hybrid host)",
        env="VGPU_CGROUP_MOUNT",
        default="/sys/fs/cgroup",
        metavar="DIR",
    ),
    Flag(
        "--memory-limit-probe-root",
        "nvml: the cgroup (a path from the hierarchy's root, e.g. /vgpu) under which the daemon "
        "makes a throw-away cgroup per GPU to confirm its driver's memory partitions",
        env="VGPU_MEMORY_LIMIT_PROBE_ROOT",
        default_words="none: every GPU's memory is polled",
        metavar="CGROUP",
    ),
    Flag(
        "--dra-gpu-cdi",
        "dra: the GPU itself through NVIDIA's CDI device nvidia.com/gpu=<uuid>, or through device "
        "nodes in vgpu's own CDI spec",
        env="VGPU_DRA_GPU_CDI",
        default="nvidia",
        choices=GPU_CDI,
    ),
    Flag(
        "--log-format",
        "text: key=value lines; json: one JSON object a line",
        env="VGPU_LOG_FORMAT",
        default="text",
        choices=LOG_FORMATS,
    ),
    Flag(
        "--log-level",
        "the least severe lines written; every enforcement action is a warning",
        env="VGPU_LOG_LEVEL",
        default="info",
        choices=LOG_LEVELS,
    ),
)

CHECK_CONFIG_FLAGS = (
    Flag("path", "config file to check"),
    Flag(
        "--backend",
        "plan for the GPUs of this backend; exit 3 if it cannot start while the config is valid",
        env="VGPU_BACKEND",
        default_words="the demo's GPUs",
        metavar="nvml|fake:PATH",
    ),
    ENFORCE_NVIDIA_CONFIG,
)

DEMO_FLAGS = (
    Flag(
        "--duration",
        "stop after this many seconds",
        default_words="run until Ctrl-C",
        metavar="SECONDS",
        number=True,
    ),
    Flag("--verbose", "also show the daemon's and kubelet's log lines", switch=True),
)

STATUS_FLAGS = (
    Flag(
        "--address",
        "host:port of the daemon's metrics endpoint; an empty host means 127.0.0.1",
        env="VGPU_METRICS_ADDRESS",
        default=":9410",
    ),
    Flag(
        "--watch",
        "refresh every SECONDS until Ctrl-C",
        default_words="show once",
        metavar="SECONDS",
        number=True,
        const="2",
    ),
    Flag("--json", "print the raw /status JSON", switch=True),
    Flag(
        "--ca-file",
        "HTTPS: the PEM CA that signed the daemon's certificate; an https:// address, "
        "VGPU_METRICS_TLS_CERT or any of these flags turns HTTPS on",
        default_words="the daemon's own certificate, VGPU_METRICS_TLS_CERT, where set, as in its "
        "pod; else the system's CAs",
    ),
    Flag(
        "--client-cert",
        "HTTPS: the PEM certificate to present to a daemon that requires one "
        "(--metrics-client-ca); needs --client-key",
    ),
    Flag("--client-key", "the PEM key of --client-cert"),
)


def one_of(options: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of `options`, in any case. argparse applies it to a default read
    from the environment too, so a bad VGPU_LOG_LEVEL is reported like a bad flag."""

    def parse(value: str) -> str:
        if value.lower() not in options:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(options)}")
        return value.lower()

    parse.__name__ = "value"
    return parse


def add_flags(
    parser: argparse.ArgumentParser,
    flags: Iterable[Flag],
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Add `flags` to `parser`, each defaulting to its environment variable, else its default."""
    for flag in flags:
        # argparse formats help with %: a literal one is written %%.
        text = flag.full_help().replace("%", "%%")
        from_env = environ.get(flag.env, "") if flag.env else ""
        if not flag.name.startswith("-"):
            parser.add_argument(flag.name, help=text)
        elif flag.switch:
            parser.add_argument(
                flag.name, action="store_true", default=from_env in SWITCH_ON, help=text
            )
        elif flag.number and flag.const:
            parser.add_argument(
                flag.name,
                type=float,
                nargs="?",
                const=float(flag.const),
                default=None,
                metavar=flag.metavar,
                help=text,
            )
        elif flag.number:
            parser.add_argument(
                flag.name, type=float, default=None, metavar=flag.metavar, help=text
            )
        elif flag.choices:
            parser.add_argument(
                flag.name,
                type=one_of(flag.choices),
                # None, not "": argparse would check an empty default against the choices.
                default=from_env or flag.default or None,
                metavar=flag.metavar or "|".join(flag.choices),
                help=text,
            )
        else:
            parser.add_argument(
                flag.name, default=from_env or flag.default, metavar=flag.metavar or None, help=text
            )
