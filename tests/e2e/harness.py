"""A real one-node Kubernetes v1.36.2 cluster for end-to-end tests, and vgpu on its node.

The binaries come from tarballs checked and unpacked once into a cache (``tests/e2e/bundles.py``):
the Kubernetes bundle (``VGPU_E2E_K8S_BUNDLE``) and, beside it, containerd 2.x with CDI
(``containerd-*.tgz``, or ``VGPU_E2E_CONTAINERD``). ``Cluster.start()`` then runs, all in one
new network and mount namespace (``unshare --net --mount --fork``, only loopback up, plus
``10.200.0.1/32`` on ``lo`` as the node IP):

- etcd, kube-apiserver, kube-scheduler, kube-controller-manager (127.0.0.1 only, throwaway
  certificates made with openssl, one kubeconfig per identity);
- the kubelet, in that private mount namespace: a tmpfs over ``/var/lib`` and ``/run``, scratch
  directories bound over ``/var/lib/kubelet``, ``/var/log``, ``/var/lib/containerd``,
  ``/run/containerd``, ``/run/cdi`` and ``/run/nri``, the kernel settings it writes shown to it
  as small files bound over their ``/proc/sys`` entries, started from an empty working
  directory; its pod cgroups under a test-owned root (``/vgpu-e2e-<id>/kubepods/...`` on every
  hierarchy);
- the runtime: containerd 2.x + runc where they are there (real containers from local busybox
  images, ``hostNetwork`` pods; CDI on, reading the node's /var/run/cdi; ``ContainerdOptions``
  for NRI and the CDI directories; ``tests/e2e/runtime.py``), else Kubernetes' fake CRI (pods
  Running, no process; every CreateContainer logged). ``runtime="fakecri"`` asks for the fake
  one.

vgpu runs inside the same namespaces the way a hostPID DaemonSet pod sees the host
(``Cluster.start_daemon``): the kubelet's real ``device-plugins/`` and ``pod-resources/``
sockets and checkpoint, the pods' real cgroups and processes, a fake GPU state file (and, for
its UUIDs, a stand-in NVIDIA CDI spec), and no ``--trust-host-processes``.

Stable API (tests and benchmarks build on it)::

    with Cluster.start(bundle, runtime="auto", kubelet_config=None,
                       containerd=ContainerdOptions(nri=False)) as c:  # or `cluster`
        c.runtime                      # "containerd" or "fakecri"
        containerd_missing(bundle)     # why real containers cannot run here, or None
        c.api.get/post/patch/delete    # the API server (admin), JSON; ApiError on HTTP >= 300
        c.kubectl("get", "nodes")      # the project's kubectl, when fetched (else skip)
        c.node(); c.allocatable(RES); c.capacity(RES)
        c.wait_allocatable(RES, 8)     # polls the Node until it says so
        c.create_pod(pod_manifest("p", {RES: 2}))
        c.wait_running("p"); c.assert_stays_pending("p", seconds=3)
        c.delete_pod("p")              # waits until the API server forgot it
        c.container_env("p", "main")   # what the container has: /proc/<pid>/environ
                                       # (containerd) or the fake runtime's CreateContainer line
        c.container_pids("p", "main")  # host PIDs in the container's cgroup (containerd)
        c.container_init_pid("p", "main")   # its first process's host PID (containerd)
        c.container_cgroup("p", "main")     # its cgroup path, as /proc/PID/cgroup says
        c.container_id("p", "main")
        c.container_cdi_devices("p", "main")  # the CDI devices the kubelet asked for
        c.checkpoint_devices("p", "main", RES)  # what the kubelet's checkpoint gave it
        c.fakecri_log(); c.create_container_requests()   # the fake runtime's log, parsed
        c.wait_no_extended_resources() # after a plugin stopped: nothing nvidia.com/* offered
        c.stop_kubelet(signal.SIGKILL); c.start_kubelet(); c.restart_kubelet()
        c.paths.checkpoint, c.paths.device_plugin_dir, c.paths.pod_resources_socket,
        c.paths.plugins_registry, c.paths.plugins_dir, c.paths.cdi_dir  # host paths
        c.paths.nri_socket             # with ContainerdOptions(nri=True)
        c.containerd_binaries          # bin_dir, ctr, cdicheck ...
        c.in_namespaces(argv)          # a process inside the node's namespaces (Popen)
        c.http_get(port, "/status")    # HTTP inside the namespace

        d = c.start_daemon(config=YAML, gpus=FakeState(...), args=[...])
        d.wait_registered(); d.status(); d.metrics(); d.log(); d.pid
        c.write_gpus(FakeState(...)); d.write_config(YAML)   # the daemon re-reads both
        c.write_cdi_spec(STANDIN_SPEC, standin_nvidia_spec(gpus, CdiEdits(hooks=[...])))
        d.stop(); d.kill()             # SIGTERM and wait / SIGKILL

Every process the cluster started is stopped by PID when it closes, also on failure: first
what it knows, then every process left in its network namespace or its cgroup root; then the
cgroup root is removed and the scratch directory deleted.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from deviceplugin.gpu.fake import FakeState, write_state_file
from tests.e2e import images
from tests.e2e.bundles import (
    BUNDLE_ENV,
    CACHE_ENV,
    Bundle,
    ClusterError,
    Containerd,
    cache_root,
    containerd_source,
    resolve_bundle,
    resolve_containerd,
)
from tests.e2e.netns import ApiClient, ApiError, http_get
from tests.e2e.runtime import (
    STANDIN_SPEC,
    CdiEdits,
    ContainerdOptions,
    config_toml,
    containerd_missing,
    standin_nvidia_spec,
    write_cdi_spec,
)

# What tests import from here, defined in the modules the harness builds on.
__all__ = [
    "BUNDLE_ENV",
    "CACHE_ENV",
    "STANDIN_SPEC",
    "Bundle",
    "CdiEdits",
    "ClusterError",
    "ContainerdOptions",
    "cache_root",
    "containerd_missing",
    "resolve_bundle",
    "standin_nvidia_spec",
]

REPO = Path(__file__).resolve().parents[2]
RESOURCE = "nvidia.com/vgpu"
NODE = "e2e-node"
NODE_IP = "10.200.0.1"
NAMESPACE = "default"
API_PORT = 6443
ETCD_PORT = 2379
KUBELET_HEALTHZ_PORT = 10248
DAEMON_PORT = 9410
SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# In every pod made by pod_manifest: the container's main process stops on SIGTERM at once.
SLEEP = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]

Runtime = Literal["auto", "containerd", "fakecri"]
T = TypeVar("T")


def containerd_available(bundle: Bundle | None = None) -> bool:
    """Whether real containers can run: see `containerd_missing` for why not."""
    return containerd_missing(bundle) is None


# ---------------------------------------------------------------------------------------------
# Certificates


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], check=False, cwd=cwd, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)}: {result.stderr.strip()}")


_PKI_MADE: list[Path] = []


def make_certificates(pki: Path) -> None:
    """Throwaway certificates in `pki`, made once per process (openssl takes a second or two on
    a small machine) and copied for every later cluster."""
    if _PKI_MADE and _PKI_MADE[0].is_dir():
        shutil.copytree(_PKI_MADE[0], pki, dirs_exist_ok=True)
        return
    _make_certificates(pki)
    template = Path(tempfile.mkdtemp(prefix="vge2e-pki-", dir="/tmp"))
    shutil.copytree(pki, template, dirs_exist_ok=True)
    _PKI_MADE.append(template)
    atexit.register(shutil.rmtree, template, True)


def _make_certificates(pki: Path) -> None:
    """A CA; the API server's serving certificate; client certificates; the service-account
    key pair. EC P-256 keys: quick to make."""
    pki.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=vgpu-e2e-ca", cwd=pki)  # fmt: skip
    sans = (
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,IP:" + NODE_IP + ",DNS:localhost,"
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local"
    )
    identities = {
        "apiserver": ("/CN=kube-apiserver", sans),
        "admin": ("/O=system:masters/CN=vgpu-e2e-admin", None),
        "scheduler": ("/CN=system:kube-scheduler", None),
        "controller-manager": ("/CN=system:kube-controller-manager", None),
        "kubelet": (f"/O=system:nodes/CN=system:node:{NODE}", None),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client", None),
    }
    for name, (subject, ext) in identities.items():
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                 cwd=pki)  # fmt: skip
        extfile = pki / f"{name}.ext"
        extfile.write_text(
            (ext + "\n" if ext else "")
            + "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
            + "extendedKeyUsage="
            + ("serverAuth" if name == "apiserver" else "clientAuth")
            + "\n"
        )
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", extfile.name,
                 cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig(pki: Path, identity: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {
                        "server": f"https://127.0.0.1:{API_PORT}",
                        "certificate-authority": str(pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": identity,
                    "user": {
                        "client-certificate": str(pki / f"{identity}.crt"),
                        "client-key": str(pki / f"{identity}.key"),
                    },
                }
            ],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": identity}}],
            "current-context": "e2e",
        }
    )


# ---------------------------------------------------------------------------------------------
# Pods


def container(
    name: str = "main",
    limits: Mapping[str, int] | None = None,
    *,
    command: Sequence[str] = SLEEP,
    image: str = images.BUSYBOX,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "image": image, "command": list(command)}
    if limits:
        spec["resources"] = {"limits": {k: str(v) for k, v in limits.items()}}
    return spec


def pod_manifest(
    name: str,
    limits: Mapping[str, int] | None = None,
    *,
    containers: Sequence[Mapping[str, Any]] | None = None,
    init_containers: Sequence[Mapping[str, Any]] = (),
    restart_policy: str = "Always",
) -> dict[str, Any]:
    """A hostNetwork pod on the node: one container `main` with `limits` unless `containers`
    are given. The cluster sets the image pull policy for its runtime."""
    spec: dict[str, Any] = {
        "nodeName": None,
        "hostNetwork": True,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "restartPolicy": restart_policy,
        "containers": [dict(c) for c in containers] if containers else [container("main", limits)],
    }
    del spec["nodeName"]  # the real scheduler places the pod
    if init_containers:
        spec["initContainers"] = [dict(c) for c in init_containers]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


_FAKECRI_LINE = re.compile(
    r"CreateContainer pod=(?P<pod>\S+) container=(?P<container>\S+) "
    r"cdiDevices=\[(?P<cdi>[^\]]*)\] devices=\[(?P<devices>.*?)\] envs=\[(?P<envs>.*)\]\s*$"
)


# containerd (at debug) once per container it creates with CDI devices.
_CONTAINERD_CDI_LINE = re.compile(
    r"Container (?P<id>[0-9a-f]{64}): CDI devices from CRI Config\.CDIDevices: \[(?P<ids>[^\]]*)\]"
)


@dataclass(frozen=True)
class CreateContainer:
    """One CreateContainer request the fake runtime logged."""

    pod: str  # namespace/name
    container: str
    cdi_devices: tuple[str, ...]
    devices: str
    envs: dict[str, str]


def parse_fakecri_log(text: str) -> list[CreateContainer]:
    found = []
    for line in text.splitlines():
        match = _FAKECRI_LINE.search(line)
        if match is None:
            continue
        envs: dict[str, str] = {}
        for item in match.group("envs").split():
            key, sep, value = item.partition("=")
            if sep:
                envs[key] = value
        found.append(
            CreateContainer(
                pod=match.group("pod"),
                container=match.group("container"),
                cdi_devices=tuple(match.group("cdi").split()),
                devices=match.group("devices"),
                envs=envs,
            )
        )
    return found


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def wait_until(
    check: Callable[[], T | None],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll `check` until it returns something other than None/False; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result is not None and result is not False:
                return result
        except (OSError, ApiError, ValueError, KeyError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: not within {timeout_s}s" + (f" (last: {last})" if last else "")
            )
        time.sleep(interval_s)


# Prefixed to every command the cluster starts: SIGKILL when the test process dies, however it
# dies (its finalizers cannot run then). Kept across the execs that follow.
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


# ---------------------------------------------------------------------------------------------
# The cluster


@dataclass(frozen=True)
class Paths:
    """Host paths of the node's directories (bound at /var/lib/kubelet etc. inside)."""

    root: Path

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        return self.kubelet_dir / "device-plugins"

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / "kubelet.sock"

    @property
    def checkpoint(self) -> Path:
        return self.device_plugin_dir / "kubelet_internal_checkpoint"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def plugins_registry(self) -> Path:
        return self.kubelet_dir / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_dir / "plugins"

    @property
    def cdi_dir(self) -> Path:
        """Bound at /run/cdi (= /var/run/cdi) inside the node."""
        return self.root / "cdi"

    @property
    def nri_socket(self) -> Path:
        """containerd's NRI socket (with ContainerdOptions(nri=True)); /var/run/nri/nri.sock
        inside the node."""
        return self.root / "nri" / "nri.sock"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def containerd_state(self) -> Path:
        return self.root / "run-containerd"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def empty(self) -> Path:
        return self.root / "empty"

    @property
    def gpus(self) -> Path:
        return self.root / "gpus.json"


# Inside the node's mount namespace, the kubelet's directories are at their usual places.
IN_NODE_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
IN_NODE_POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"


class Cluster:
    """One node; see the module docstring. Use `Cluster.start(...)` as a context manager."""

    def __init__(
        self,
        bundle: Bundle,
        runtime: Runtime = "auto",
        kubelet_config: Mapping[str, Any] | None = None,
        containerd: ContainerdOptions | None = None,
    ) -> None:
        missing = containerd_missing(bundle)
        if runtime == "auto":
            runtime = "fakecri" if missing else "containerd"
        if runtime == "containerd" and missing:
            raise ClusterError(f"runtime=containerd: {missing}")
        self.runtime: Literal["containerd", "fakecri"] = runtime
        self.bundle = bundle
        self.containerd_options = containerd or ContainerdOptions()
        self.kubelet_overrides = dict(kubelet_config or {})
        self.id = uuid.uuid4().hex[:8]
        self.paths = Paths(Path(tempfile.mkdtemp(prefix="vge2e-", dir="/tmp")))
        self.cgroup_root = f"/vgpu-e2e-{self.id}"
        self.components: dict[str, Component] = {}
        self.daemons: list[Daemon] = []
        self.anchor: subprocess.Popen[bytes] | None = None
        self.anchor_pid = 0
        self._netns_ino: int | None = None
        self._api: ApiClient | None = None
        self.timings: dict[str, float] = {}

    # -- life cycle ---------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def start(
        cls,
        bundle: Bundle,
        runtime: Runtime = "auto",
        kubelet_config: Mapping[str, Any] | None = None,
        containerd: ContainerdOptions | None = None,
    ) -> Iterator[Cluster]:
        """Bring the cluster up (`kubelet_config`: KubeletConfiguration fields to override;
        `containerd`: how the runtime runs), yield it, close it whatever happens."""
        cluster = cls(bundle, runtime, kubelet_config, containerd)
        try:
            cluster._bring_up()
            yield cluster
        finally:
            cluster.close()

    @property
    def netns(self) -> Path:
        return Path(f"/proc/{self.anchor_pid}/ns/net")

    @property
    def api(self) -> ApiClient:
        assert self._api is not None, "cluster not started"
        return self._api

    def _bring_up(self) -> None:
        t0 = time.monotonic()
        root = self.paths.root
        for sub in ("kubelet", "log", "containerd", "run-containerd", "cdi", "empty", "etcd",
                    "sysctl", "cni", "cni-bin", "vgpu-state", "nri", "nri-plugins",
                    "nri-conf.d"):  # fmt: skip
            (root / sub).mkdir(parents=True, exist_ok=True)
        make_certificates(self.paths.pki)
        self.timings["certificates"] = time.monotonic() - t0
        if self.runtime == "containerd":  # the fake runtime makes no cgroups
            self._make_cgroup_root()
        self._start_anchor()
        pki = self.paths.pki
        self._api = ApiClient(
            self.netns, API_PORT, ca=pki / "ca.crt", cert=pki / "admin.crt", key=pki / "admin.key"
        )
        self._start_control_plane()
        if self.runtime == "containerd":
            self._start_containerd()
        else:
            self._start_fakecri()
        self._write_kubelet_config()
        self.start_kubelet(wait=False)
        wait_until(self._apiserver_ready, timeout_s=60, interval_s=0.2, what="apiserver /readyz")
        self.timings["apiserver ready"] = time.monotonic() - t0
        self._start_controllers()
        self._ensure_service_account()
        if self.runtime == "containerd":
            self._import_images()
        self.wait_node_ready(timeout_s=60)
        self.timings["node ready"] = time.monotonic() - t0

    def _check_alive(self) -> None:
        if self.anchor is not None and self.anchor.poll() is not None:
            raise ClusterError("the namespace holder exited")
        for comp in self.components.values():
            if comp.proc is not None and comp.proc.poll() is not None and comp.name != "kubelet":
                raise ClusterError(
                    f"{comp.name} exited with {comp.proc.returncode}; its log:\n{comp.tail()}"
                )

    def _apiserver_ready(self) -> bool:
        self._check_alive()
        status, _ = self.api.raw("GET", "/readyz")
        return status == 200

    def _make_cgroup_root(self) -> None:
        for hierarchy in self._cgroup_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":
                for key in ("cpuset.cpus", "cpuset.mems"):
                    (path / key).write_text((hierarchy / key).read_text())

    @staticmethod
    def _cgroup_hierarchies() -> list[Path]:
        base = Path("/sys/fs/cgroup")
        if (base / "cgroup.controllers").exists():  # cgroup v2 only
            return [base]
        found = []
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if parts[2] in ("cgroup", "cgroup2") and parts[1].startswith(str(base) + "/"):
                    found.append(Path(parts[1]))
        return found

    def _start_anchor(self) -> None:
        root = self.paths.root
        lines = [
            "set -e",
            "ip link set lo up",
            f"ip addr add {NODE_IP}/32 dev lo",
            "mount --make-rprivate /",
            "mount -t tmpfs -o mode=755 tmpfs /var/lib",
            "mkdir -p /var/lib/kubelet /var/lib/containerd",
            f"mount --bind {root}/kubelet /var/lib/kubelet",
            f"mount --bind {root}/containerd /var/lib/containerd",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "mkdir -p /run/containerd /run/cdi /run/nri",
            f"mount --bind {root}/run-containerd /run/containerd",
            f"mount --bind {root}/cdi /run/cdi",
            f"mount --bind {root}/nri /run/nri",
            f"mount --bind {root}/log /var/log",
        ]
        for key, value in SYSCTLS.items():
            f = root / "sysctl" / key.replace("/", ".")
            f.write_text(value + "\n")
            lines.append(f"mount --bind {f} /proc/sys/{key}")
        lines += [f"echo $$ > {root}/anchor.pid", "exec sleep infinity"]
        self.anchor = subprocess.Popen(
            [
                *DIE_WITH_PARENT,
                "unshare",
                "--net",
                "--mount",
                "--fork",
                "--kill-child=KILL",
                "--",
                "/bin/sh",
                "-c",
                "\n".join(lines),
            ],
            cwd=self.paths.empty,
            stdout=subprocess.DEVNULL,
            stderr=(root / "log" / "anchor.log").open("wb"),
            start_new_session=True,
        )
        pid_file = root / "anchor.pid"

        def ready() -> int | None:
            if self.anchor is not None and self.anchor.poll() is not None:
                raise ClusterError(
                    "could not set up the node's namespaces: "
                    + (root / "log" / "anchor.log").read_text()
                )
            text = pid_file.read_text().strip() if pid_file.exists() else ""
            return int(text) if text else None

        self.anchor_pid = wait_until(ready, timeout_s=10, interval_s=0.02, what="namespaces")
        self._netns_ino = _netns_inode(self.anchor_pid)

    def in_namespaces(
        self,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside the node's network and mount namespaces (same PID namespace as
        the host: it sees every pod's processes), from an empty working directory."""
        workdir = cwd or self.paths.empty
        full = [*DIE_WITH_PARENT, "nsenter", f"--target={self.anchor_pid}", "--net", "--mount",
                f"--wd={workdir}", "--", *argv]  # fmt: skip
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        try:
            return subprocess.Popen(
                full,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
                env=dict(env) if env is not None else _base_env(),
            )
        finally:
            if log is not None and not isinstance(out, int):
                out.close()

    def run_in_namespaces(
        self,
        argv: Sequence[str],
        timeout_s: float = 60,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        """Run `argv` inside the node's namespaces (from an empty working directory unless
        `cwd`); its output; ClusterError when it fails."""
        full = [*DIE_WITH_PARENT, "nsenter", f"--target={self.anchor_pid}", "--net", "--mount",
                f"--wd={cwd or self.paths.empty}", "--", *argv]  # fmt: skip
        result = subprocess.run(
            full, check=False, capture_output=True, text=True, timeout=timeout_s,
            env=dict(env) if env is not None else _base_env(),
        )  # fmt: skip
        if result.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr}")
        return result.stdout

    def _start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Component:
        comp = Component(name, argv, self.paths.log_dir / f"{name}.log")
        comp.proc = self.in_namespaces(argv, log=comp.log, env=env)
        self.components[name] = comp
        return comp

    def _start_control_plane(self) -> None:
        pki = self.paths.pki
        for identity in ("admin", "scheduler", "controller-manager", "kubelet"):
            (pki / f"{identity}.kubeconfig").write_text(kubeconfig(pki, identity))
        km = str(self.bundle.kube_multi)
        self._start(
            "etcd",
            [str(self.bundle.tinyetcd), "--data-dir", str(self.paths.root / "etcd"),
             "--listen-client", f"http://127.0.0.1:{ETCD_PORT}",
             "--listen-peer", "http://127.0.0.1:2380"],
        )  # fmt: skip
        self._start(
            "kube-apiserver",
            [km, "kube-apiserver",
             f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
             "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
             f"--secure-port={API_PORT}",
             f"--tls-cert-file={pki}/apiserver.crt", f"--tls-private-key-file={pki}/apiserver.key",
             f"--client-ca-file={pki}/ca.crt",
             f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
             f"--kubelet-client-key={pki}/apiserver-kubelet-client.key",
             f"--service-account-key-file={pki}/sa.pub",
             f"--service-account-signing-key-file={pki}/sa.key",
             "--service-account-issuer=https://kubernetes.default.svc",
             "--service-cluster-ip-range=10.0.0.0/24",
             "--authorization-mode=Node,RBAC", "--allow-privileged=true",
             "--kubelet-preferred-address-types=InternalIP",
             "--enable-priority-and-fairness=false", "--profiling=false"],
        )  # fmt: skip

    def _start_controllers(self) -> None:
        """The scheduler and controller-manager, once the API server has its RBAC roles (they
        exit when they start before)."""
        pki = self.paths.pki
        km = str(self.bundle.kube_multi)
        common = [
            f"--kubeconfig={pki}/{{id}}.kubeconfig",
            f"--authentication-kubeconfig={pki}/{{id}}.kubeconfig",
            f"--authorization-kubeconfig={pki}/{{id}}.kubeconfig",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
        ]
        self._start(
            "kube-scheduler",
            [km, "kube-scheduler", *(a.format(id="scheduler") for a in common)],
        )
        self._start(
            "kube-controller-manager",
            [km, "kube-controller-manager",
             *(a.format(id="controller-manager") for a in common),
             f"--service-account-private-key-file={pki}/sa.key",
             f"--root-ca-file={pki}/ca.crt", "--use-service-account-credentials=true"],
        )  # fmt: skip

    @property
    def runtime_endpoint(self) -> str:
        if self.runtime == "containerd":
            return "unix:///run/containerd/containerd.sock"
        return f"unix://{self.paths.root}/fakecri.sock"

    def _start_fakecri(self) -> None:
        self._start(
            "fakecri",
            [str(self.bundle.kube_multi), "fakecri", "--endpoint", self.runtime_endpoint],
        )

    @property
    def containerd_binaries(self) -> Containerd:
        """containerd's binaries (`ctr`, `cdicheck`, ...): from the tarball beside the bundle."""
        source = containerd_source(self.bundle.home)
        if source is None:
            raise ClusterError(containerd_missing(self.bundle) or "no containerd")
        return resolve_containerd(source)

    def _start_containerd(self) -> None:
        root = self.paths.root
        (root / "cni" / "10-loopback.conflist").write_text(
            json.dumps({"cniVersion": "0.4.0", "name": "lo", "plugins": [{"type": "loopback"}]})
        )
        binaries = self.containerd_binaries
        (root / "containerd.toml").write_text(config_toml(root, binaries, self.containerd_options))
        # Its shim and ctr first on PATH, whatever else is installed.
        env = {**_base_env(), "PATH": f"{binaries.bin_dir}:{_base_env()['PATH']}"}
        self._start(
            "containerd", [str(binaries.containerd), "--config", str(root / "containerd.toml")], env
        )
        # The kubelet checks its runtime once at start and exits when the socket is not there
        # yet (a loaded machine starts containerd slower than the control plane).
        sock = self.paths.containerd_state / "containerd.sock"
        wait_until(sock.exists, timeout_s=30, interval_s=0.05, what="containerd socket")

    def _import_images(self) -> None:
        tarball = images.build_images(cache_root())
        self.run_in_namespaces(
            [str(self.containerd_binaries.ctr), "--address", "/run/containerd/containerd.sock",
             "-n", "k8s.io", "images", "import", "--all-platforms", str(tarball)],
        )  # fmt: skip

    def _write_kubelet_config(self) -> None:
        real = self.runtime == "containerd"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": KUBELET_HEALTHZ_PORT,
            "authentication": {
                "x509": {"clientCAFile": str(self.paths.pki / "ca.crt")},
                "webhook": {"enabled": False},
                "anonymous": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": real,
            "cgroupRoot": self.cgroup_root if real else "",
            "enforceNodeAllocatable": ["pods"] if real else [],
            "failCgroupV1": False,
            "failSwapOn": False,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "podLogsDir": "/var/log/pods",
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100,
            "localStorageCapacityIsolation": False,
            "resolvConf": "",
            "nodeStatusUpdateFrequency": "1s",
            "nodeStatusReportFrequency": "1s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "60s",
            "registerNode": True,
        }
        config.update(self.kubelet_overrides)
        (self.paths.root / "kubelet.json").write_text(json.dumps(config))

    # -- the kubelet --------------------------------------------------------------------------

    def start_kubelet(self, *, wait: bool = True) -> Component:
        """Start the kubelet (again); with `wait`, until its device-plugin socket is there and
        /healthz answers."""
        old = self.components.get("kubelet")
        assert old is None or not old.alive(), "the kubelet is running"
        comp = self._start(
            "kubelet",
            [str(self.bundle.kube_multi), "kubelet",
             f"--config={self.paths.root}/kubelet.json",
             f"--kubeconfig={self.paths.pki}/kubelet.kubeconfig",
             f"--hostname-override={NODE}", "--root-dir=/var/lib/kubelet",
             f"--node-ip={NODE_IP}"],
        )  # fmt: skip
        if wait:
            self.wait_kubelet_healthy()
        return comp

    def wait_kubelet_healthy(self, timeout_s: float = 30) -> None:
        def healthy() -> bool:
            comp = self.components["kubelet"]
            if not comp.alive():
                raise ClusterError(f"the kubelet exited; its log:\n{comp.tail()}")
            status, _ = http_get(self.netns, KUBELET_HEALTHZ_PORT, "/healthz", timeout=2)
            return status == 200 and self.paths.kubelet_socket.exists()

        wait_until(healthy, timeout_s=timeout_s, interval_s=0.05, what="kubelet /healthz")

    def stop_kubelet(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        """Signal the kubelet and wait for it to exit (SIGKILL after `timeout_s`)."""
        comp = self.components["kubelet"]
        assert comp.proc is not None
        if comp.alive():
            comp.proc.send_signal(sig)
            try:
                comp.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                comp.proc.kill()
                comp.proc.wait(5)

    def restart_kubelet(self, sig: int = signal.SIGTERM, *, wait: bool = True) -> None:
        self.stop_kubelet(sig)
        self.start_kubelet(wait=wait)

    # -- the API ------------------------------------------------------------------------------

    def kubectl(self, *args: str, timeout_s: float = 60) -> str:
        """The project's kubectl (tools/fetch_k8s_tools.py; cached), run inside the node's
        namespaces as admin. Skips the test when it has not been fetched."""
        import pytest

        from tools import fetch_k8s_tools

        binary = fetch_k8s_tools.cached("kubectl")
        if binary is None:
            pytest.skip("kubectl is not fetched: python tools/fetch_k8s_tools.py")
        return self.run_in_namespaces(
            [str(binary), f"--kubeconfig={self.paths.pki}/admin.kubeconfig", *args], timeout_s
        )

    def _ensure_service_account(self) -> None:
        def create() -> bool:
            try:
                self.api.post(
                    f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
                )
            except ApiError as exc:
                if exc.status != 409:
                    raise
            return True

        wait_until(create, timeout_s=30, interval_s=0.2, what="default ServiceAccount")

    def node(self) -> dict[str, Any]:
        result: dict[str, Any] = self.api.get(f"/api/v1/nodes/{NODE}")
        return result

    def wait_node_ready(self, timeout_s: float = 60) -> None:
        def ready() -> bool:
            self._check_alive()
            kubelet = self.components["kubelet"]
            if not kubelet.alive():
                raise ClusterError(f"the kubelet exited; its log:\n{kubelet.tail()}")
            try:
                node = self.node()
            except ApiError as exc:
                if exc.status == 404:
                    return False
                raise
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in node.get("status", {}).get("conditions", [])
            )

        wait_until(ready, timeout_s=timeout_s, interval_s=0.2, what="node Ready")

    def capacity(self, resource: str = RESOURCE) -> int | None:
        value = self.node().get("status", {}).get("capacity", {}).get(resource)
        return None if value is None else int(value)

    def allocatable(self, resource: str = RESOURCE) -> int | None:
        value = self.node().get("status", {}).get("allocatable", {}).get(resource)
        return None if value is None else int(value)

    def wait_allocatable(
        self, resource: str, count: int, *, timeout_s: float = 30, capacity: int | None = None
    ) -> None:
        """Until the Node's allocatable (and capacity, when given) of `resource` is `count`."""

        def check() -> bool:
            status = self.node().get("status", {})
            alloc = status.get("allocatable", {}).get(resource)
            cap = status.get("capacity", {}).get(resource)
            return (
                alloc is not None
                and int(alloc) == count
                and (capacity is None or (cap is not None and int(cap) == capacity))
            )

        try:
            wait_until(check, timeout_s=timeout_s, interval_s=0.1, what="allocatable")
        except TimeoutError:
            status = self.node().get("status", {})
            raise AssertionError(
                f"{resource}: wanted allocatable {count} (capacity {capacity}), node says "
                f"allocatable {status.get('allocatable', {}).get(resource)}, capacity "
                f"{status.get('capacity', {}).get(resource)}"
            ) from None

    def wait_no_extended_resources(
        self, prefix: str = "nvidia.com/", timeout_s: float = 30
    ) -> None:
        """Until the Node offers none of the resources named `prefix...` (after a device plugin
        stopped, the kubelet keeps its capacity a while with nothing allocatable)."""

        def none_left() -> bool:
            allocatable = self.node().get("status", {}).get("allocatable", {})
            return all(int(v) == 0 for k, v in allocatable.items() if k.startswith(prefix))

        wait_until(none_left, timeout_s=timeout_s, what=f"no {prefix}* allocatable")

    # -- pods ---------------------------------------------------------------------------------

    def create_pod(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        manifest = json.loads(json.dumps(manifest))
        policy = "Never" if self.runtime == "containerd" else "IfNotPresent"
        spec = manifest["spec"]
        for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            c.setdefault("imagePullPolicy", policy)
        result: dict[str, Any] = self.api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", manifest)
        return result

    def pod(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        return result

    def pods(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        return result

    def wait_running(self, name: str, timeout_s: float = 60) -> dict[str, Any]:
        """Until every container of the pod is running and ready; its last state. Fails at
        once when the pod failed or a container is stuck waiting with an error."""

        def running() -> dict[str, Any] | None:
            pod = self.pod(name)
            status = pod.get("status", {})
            if status.get("phase") == "Failed":
                raise AssertionError(f"pod {name} failed: {json.dumps(status)}")
            statuses = status.get("containerStatuses", [])
            for s in statuses:
                waiting = s.get("state", {}).get("waiting")
                if waiting and waiting.get("reason") in (
                    "CreateContainerError", "CreateContainerConfigError", "ErrImageNeverPull",
                    "RunContainerError", "CrashLoopBackOff",
                ):  # fmt: skip
                    raise AssertionError(f"pod {name}: {s['name']}: {waiting}")
            if (
                status.get("phase") == "Running"
                and statuses
                and all(s.get("state", {}).get("running") for s in statuses)
            ):
                return pod
            return None

        try:
            return wait_until(running, timeout_s=timeout_s, interval_s=0.1, what=f"pod {name}")
        except TimeoutError:
            raise AssertionError(
                f"pod {name} not Running in {timeout_s}s: "
                f"{json.dumps(self.pod(name).get('status'))}"
                f"\nevents: {self.events(name)}"
            ) from None

    def events(self, pod: str) -> list[str]:
        items = self.api.get(
            f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector=involvedObject.name={pod}"
        )["items"]
        return [f"{e.get('reason')}: {e.get('message')}" for e in items]

    def assert_stays_pending(self, name: str, seconds: float = 3.0) -> dict[str, Any]:
        """The pod is accepted (exists), stays Pending and unscheduled for `seconds`; its
        status, whose PodScheduled condition says why."""
        deadline = time.monotonic() + seconds
        while True:
            pod = self.pod(name)
            status = pod.get("status", {})
            assert status.get("phase") == "Pending", f"pod {name}: {json.dumps(status)}"
            assert not pod["spec"].get("nodeName"), f"pod {name} was scheduled: {status}"
            if time.monotonic() > deadline:
                return pod
            time.sleep(0.2)

    def delete_pod(self, name: str, *, wait: bool = True, timeout_s: float = 60) -> None:
        """Delete at once (grace 0); with `wait`, until the API server has no such pod."""
        try:
            self.api.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
        if wait:
            self.wait_pod_gone(name, timeout_s)

    def wait_pod_gone(self, name: str, timeout_s: float = 60) -> None:
        def gone() -> bool:
            try:
                self.pod(name)
            except ApiError as exc:
                if exc.status == 404:
                    return True
                raise
            return False

        wait_until(gone, timeout_s=timeout_s, interval_s=0.1, what=f"pod {name} gone")

    def delete_all_pods(self) -> None:
        for pod in self.pods():
            self.delete_pod(pod["metadata"]["name"], wait=False)
        for pod in self.pods():
            self.wait_pod_gone(pod["metadata"]["name"])

    # -- containers ---------------------------------------------------------------------------

    def container_id(self, pod: str, name: str) -> str:
        status = self.pod(pod).get("status", {})
        for s in [*status.get("containerStatuses", []), *status.get("initContainerStatuses", [])]:
            if s["name"] == name and s.get("containerID"):
                return str(s["containerID"]).split("://", 1)[1]
        raise KeyError(f"pod {pod} has no started container {name}")

    def container_init_pid(self, pod: str, name: str) -> int:
        """The host PID of the container's first process (containerd)."""
        assert self.runtime == "containerd", "no processes with the fake runtime"
        cid = self.container_id(pod, name)
        path = self.paths.containerd_state / "io.containerd.runtime.v2.task" / "k8s.io" / cid
        return int((path / "init.pid").read_text())

    def container_cgroup(self, pod: str, name: str) -> str:
        """The container's own cgroup (containerd): its first process's, as /proc/PID/cgroup
        says it (the memory controller's, or cgroup v2's), e.g.
        `/vgpu-e2e-<id>/kubepods/besteffort/pod<uid>/<container id>`."""
        return _memory_cgroup_of(self.container_init_pid(pod, name))

    def container_pids(self, pod: str, name: str) -> list[int]:
        """Every host PID in the container's cgroup (containerd)."""
        cgroup = self.container_cgroup(pod, name)
        procs = Path("/sys/fs/cgroup/memory") / cgroup.lstrip("/") / "cgroup.procs"
        if not procs.exists():
            procs = Path("/sys/fs/cgroup/unified") / cgroup.lstrip("/") / "cgroup.procs"
        return sorted(int(p) for p in procs.read_text().split())

    def container_env(self, pod: str, name: str) -> dict[str, str]:
        """The container's environment as it has it: its first process's /proc/PID/environ
        (containerd), or the last CreateContainer the fake runtime logged for it."""
        if self.runtime == "containerd":
            pid = self.container_init_pid(pod, name)
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            env: dict[str, str] = {}
            for item in raw.split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    env[key] = value
            return env
        return self._last_create_container(pod, name).envs

    def container_cdi_devices(self, pod: str, name: str) -> tuple[str, ...]:
        """The CDI devices the kubelet asked the runtime to give the container, the last time
        it was created: containerd's debug line for the container's ID, or the fake runtime's
        CreateContainer line."""
        if self.runtime == "containerd":
            assert self.containerd_options.debug, "containerd logs CDI devices only at debug"
            cid = self.container_id(pod, name)
            log = (self.paths.log_dir / "containerd.log").read_text(errors="replace")
            found = [m.group("ids") for m in _CONTAINERD_CDI_LINE.finditer(log)
                     if m.group("id") == cid]  # fmt: skip
            return tuple(found[-1].split()) if found else ()
        return self._last_create_container(pod, name).cdi_devices

    def _last_create_container(self, pod: str, name: str) -> CreateContainer:
        """The fake runtime's last CreateContainer for the pod's container `name`."""
        found = [
            c for c in parse_fakecri_log(self.fakecri_log())
            if c.pod == f"{NAMESPACE}/{pod}" and c.container == name
        ]  # fmt: skip
        if not found:
            raise KeyError(f"the fake runtime logged no CreateContainer for {pod}/{name}")
        return found[-1]

    def checkpoint_devices(
        self, pod: str, container_name: str, resource: str = RESOURCE
    ) -> list[str]:
        """The device IDs the kubelet's own checkpoint says it gave the container (sorted)."""
        uid = self.pod(pod)["metadata"]["uid"]
        data = json.loads(self.paths.checkpoint.read_text())["Data"]
        found: set[str] = set()
        for entry in data.get("PodDeviceEntries") or []:
            if (
                entry["PodUID"] == uid
                and entry["ContainerName"] == container_name
                and entry["ResourceName"] == resource
            ):
                ids = entry["DeviceIDs"]
                for group in ids.values() if isinstance(ids, dict) else [ids]:
                    found.update(group)
        return sorted(found)

    def fakecri_log(self) -> str:
        return (self.paths.log_dir / "fakecri.log").read_text(errors="replace")

    def create_container_requests(self) -> list[CreateContainer]:
        return parse_fakecri_log(self.fakecri_log())

    def http_get(self, port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
        return http_get(self.netns, port, path, timeout=timeout)

    # -- vgpu ---------------------------------------------------------------------------------

    def write_gpus(self, state: FakeState) -> None:
        """The fake GPUs' state file, and the stand-in NVIDIA CDI spec for their UUIDs."""
        write_state_file(self.paths.gpus, state)
        self.write_cdi_spec(STANDIN_SPEC, standin_nvidia_spec(state))

    def write_cdi_spec(self, name: str, spec: Mapping[str, Any]) -> Path:
        """Write a CDI spec file into the node's CDI directory (/var/run/cdi inside), in one
        rename; e.g. `standin_nvidia_spec(gpus, CdiEdits(hooks=[...]))` as STANDIN_SPEC."""
        return write_cdi_spec(self.paths.cdi_dir, name, spec)

    def start_daemon(
        self,
        *,
        config: str | None = None,
        gpus: FakeState | None = None,
        args: Sequence[str] = (),
        port: int = DAEMON_PORT,
        env: Mapping[str, str] | None = None,
    ) -> Daemon:
        """Run `vgpu-device-plugin serve` inside the node's namespaces as a hostPID DaemonSet
        pod would: the kubelet's real sockets, the fake GPUs of `gpus` (or the state file as
        it is), the YAML `config` (written to a file the daemon watches), `args` appended."""
        if gpus is not None:
            self.write_gpus(gpus)
        config_path = self.paths.root / "vgpu-config.yaml"
        if config is not None:
            config_path.write_text(config)
        n = len(self.daemons)
        log = self.paths.log_dir / f"vgpu-{n}.log"
        argv = [
            sys.executable, "-m", "deviceplugin", "serve",
            "--backend", f"fake:{self.paths.gpus}",
            "--device-plugin-dir", IN_NODE_DEVICE_PLUGIN_DIR,
            "--pod-resources-socket", IN_NODE_POD_RESOURCES,
            "--state-dir", str(self.paths.root / "vgpu-state"),
            "--metrics-address", f"127.0.0.1:{port}",
            "--node-name", NODE,
            # Where this kubelet puts pod containers, as a DaemonSet is told it: a pod's cgroup
            # is its container's only where the kubelet puts it.
            *(
                ["--kubelet-cgroup-driver", "cgroupfs", "--kubelet-cgroup-root", self.cgroup_root]
                if self.runtime == "containerd"
                else []
            ),
            *(["--config", str(config_path)] if config is not None else []),
            *args,
        ]  # fmt: skip
        # The daemon of this checkout, whatever is installed.
        daemon_env = {
            **_base_env(),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO),
            **(env or {}),
        }
        proc = self.in_namespaces(argv, log=log, env=daemon_env)
        daemon = Daemon(self, proc, log, port, config_path)
        self.daemons.append(daemon)
        return daemon

    # -- teardown -----------------------------------------------------------------------------

    def _pids_in_cluster(self) -> set[int]:
        """Every process in the node's network namespace or under its cgroup root."""
        found: set[int] = set()
        if self._netns_ino is not None:
            for pid in _all_pids():
                if pid != os.getpid() and _netns_inode(pid) == self._netns_ino:
                    found.add(pid)
        for hierarchy in self._cgroup_hierarchies():
            base = hierarchy / self.cgroup_root.lstrip("/")
            if not base.is_dir():
                continue
            for procs in base.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    found.update(int(p) for p in procs.read_text().split())
        return found

    def close(self) -> None:
        """Stop every process by PID, remove the cgroup root and the scratch directory."""
        if self._api is not None:
            self._api.close()
        for daemon in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                daemon.proc.kill()
        for comp in self.components.values():
            if comp.proc is not None and comp.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    comp.proc.kill()
        for _ in range(50):
            left = self._pids_in_cluster()
            if self.anchor is not None and self.anchor.poll() is None:
                left.add(self.anchor_pid)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for proc in [d.proc for d in self.daemons] + [
            c.proc for c in self.components.values() if c.proc is not None
        ]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self.anchor is not None:
            with contextlib.suppress(ProcessLookupError):
                self.anchor.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.anchor.wait(5)
        self._remove_cgroups()
        if os.environ.get("VGPU_E2E_KEEP"):
            print(f"e2e: kept {self.paths.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.paths.root, ignore_errors=True)

    def _remove_cgroups(self) -> None:
        for hierarchy in self._cgroup_hierarchies():
            base = hierarchy / self.cgroup_root.lstrip("/")
            if not base.is_dir():
                continue
            dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for attempt in range(20):
                remaining = [d for d in [*dirs, base] if d.exists()]
                for d in remaining:
                    with contextlib.suppress(OSError):
                        d.rmdir()
                if not base.exists():
                    break
                time.sleep(0.05 * (attempt + 1))


def _memory_cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":
            return path
    raise KeyError(f"pid {pid}: no memory cgroup")


def _base_env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }


# ---------------------------------------------------------------------------------------------
# vgpu on the node


@dataclass
class Daemon:
    """One `serve` process inside the node."""

    cluster: Cluster
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    config_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def write_config(self, text: str) -> None:
        """Rewrite the config file in place; the daemon reloads it."""
        self.config_path.write_text(text)

    def _get(self, path: str) -> bytes:
        if not self.alive():
            raise AssertionError(f"vgpu exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        status, body = self.cluster.http_get(self.port, path)
        if status != 200:
            raise AssertionError(f"GET {path}: HTTP {status}: {body[:300]!r}")
        return body

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self._get("/status"))
        return result

    def metrics(self) -> str:
        return self._get("/metrics").decode()

    def wait_http(self, timeout_s: float = 30) -> None:
        wait_until(lambda: self._get("/healthz") is not None, timeout_s=timeout_s,
                   interval_s=0.05, what="vgpu /healthz")  # fmt: skip

    def wait_registered(
        self, resource: str = RESOURCE, count: int | None = None, timeout_s: float = 30
    ) -> None:
        """Until the Node shows `count` allocatable `resource` (any positive count when None)."""
        if count is not None:
            self.cluster.wait_allocatable(resource, count, timeout_s=timeout_s)
            return

        def check() -> bool:
            if not self.alive():
                raise AssertionError(f"vgpu exited:\n{self.log()[-3000:]}")
            value = self.cluster.allocatable(resource)
            return value is not None and value > 0

        wait_until(check, timeout_s=timeout_s, what=f"{resource} allocatable")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15) -> int:
        """SIGTERM, wait; its exit code (SIGKILL after `timeout_s`, then an AssertionError)."""
        if self.alive():
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(
                    f"vgpu did not stop on SIGTERM:\n{self.log()[-3000:]}"
                ) from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(5)
