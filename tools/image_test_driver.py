"""The host's side of tools/image_test.sh: a kubelet for a daemon that runs in a container.

    .venv/bin/python tools/image_test_driver.py --root DIR --start 'podman run ...' \
        --stop 'podman stop ...'

Under DIR it writes the fake GPUs' state file (`fake/gpus.json`) and serves the kubelet simulator on
`device-plugins/kubelet.sock` and `pod-resources/kubelet.sock`, the directories the container
mounts as the DaemonSet mounts the node's. Then, in order:

1. runs the start command (the container starts and the daemon in it registers, as a DaemonSet
   pod does on a node whose kubelet is up);
2. waits for the registration and the full device list;
3. admits a one-container pod and a two-container pod, and checks what Allocate gave each
   container against the contract (docs/design.md §3);
4. with --exec, checks that the container's security context lets the daemon do what enforcement
   needs on the node: read /proc/<pid>/environ (where VGPU_ALLOCATION_ID is found) of a host
   process running as another user and of one running as root with every capability, and
   SIGSTOP/SIGCONT both (docs/design.md §4);
5. with --exec, checks GET /healthz (200, as the DaemonSet's probes expect) and GET /metrics on
   the metrics port, from inside the container; `--metrics optional` only reports when nothing
   listens there;
6. runs the stop command while the kubelet is still up, as a rolling update does, and checks that
   the daemon removed its socket.

Exit 0 when every check passed, 1 with a line naming the first that failed.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported

import argparse
import asyncio
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path

from deviceplugin.gpu.fake import FakeGpu, FakeState, write_state_file
from deviceplugin.model import allocation_id
from deviceplugin.plugin.lifecycle import endpoint_name
from deviceplugin.sim.kubelet import ContainerGrant, KubeletSimulator

log = logging.getLogger("image_test")

GiB = 1024**3
MiB = 1024**2
RESOURCE = "nvidia.com/vgpu"
REPLICAS = 4  # the default config's slicing.replicas, which the container runs with
NODE_NAME = "image-test-node"  # NODE_NAME in the container
PODS = ("single", "multi")
GPUS = (
    FakeGpu(
        uuid="GPU-1a2b3c4d-0000-4000-8000-000000000000",
        index=0,
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GiB,
        minor=0,
        numa_node=0,
    ),
    FakeGpu(
        uuid="GPU-1a2b3c4d-0000-4000-8000-000000000001",
        index=1,
        name="NVIDIA L4",
        memory_total_bytes=24 * GiB,
        minor=1,
        numa_node=0,
    ),
)


# Run inside the container: what attribution and enforcement do to another container's process.
PROBE = """
import os, signal, sys, time

def state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]

def wait_state(pid, wanted):
    deadline = time.monotonic() + 5
    while (state(pid) == "T") != wanted:
        if time.monotonic() > deadline:
            sys.exit(f"pid {pid}: stopped={not wanted} after 5s")
        time.sleep(0.01)

marker, pids = sys.argv[1].encode(), [int(p) for p in sys.argv[2:]]
for pid in pids:
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().split(b"\\0")
    if b"VGPU_ALLOCATION_ID=" + marker not in environ:
        sys.exit(f"pid {pid}: no VGPU_ALLOCATION_ID={sys.argv[1]} in its environ")
    os.kill(pid, signal.SIGSTOP)
    wait_state(pid, True)
    os.kill(pid, signal.SIGCONT)
    wait_state(pid, False)
    print(f"pid {pid}: environ read, stopped and resumed")
"""
PROBE_MARKER = "0123456789abcdef"

# Run inside the container: the DaemonSet's liveness/readiness probe, and a scrape that must come
# to hold every line given (the pods admitted, named through the pod-resources API).
HTTP_PROBE = """
import sys, time, urllib.error, urllib.request

def get(path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:9410{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

deadline = time.monotonic() + float(sys.argv[1])
wanted = sys.argv[2:]
while True:
    try:
        status, body = get("/healthz")
    except OSError as e:
        if time.monotonic() > deadline:
            print(f"nothing answers on :9410: {e}")
            sys.exit(3)
        time.sleep(0.2)
        continue
    if status == 200 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(f"/healthz {status} {body.strip()[:200]}")
if status != 200:
    sys.exit(1)
while True:
    status, body = get("/metrics")
    missing = [w for w in wanted if w not in body]
    if status == 200 and not missing:
        break
    if time.monotonic() > deadline:
        print(f"/metrics {status}: no {missing}")
        sys.exit(1)
    time.sleep(0.2)
print(f"/metrics {status}, {len(body.splitlines())} lines, with {wanted}")
"""
NOTHING_LISTENS = 3
NOBODY = 65534


class CheckError(Exception):
    """One check of the image test did not hold."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise CheckError(what)
    log.info("ok: %s", what)


def run_command(command: str, timeout_s: float) -> None:
    log.info("running: %s", command)
    result = subprocess.run(shlex.split(command), timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise CheckError(f"command exited {result.returncode}: {command}")


def check_grant(grant: ContainerGrant, count: int) -> None:
    """The Allocate answer for one container holding `count` slices, against docs/design.md §3."""
    who = f"container {grant.name}"
    check(len(grant.device_ids) == count, f"{who} got {count} slice(s)")
    by_uuid = {gpu.uuid: gpu for gpu in GPUS}
    held: dict[str, int] = {}
    for device_id in grant.device_ids:
        gpu_uuid, _, _ = device_id.partition("::")
        check(gpu_uuid in by_uuid, f"{who}: slice {device_id} names a GPU of the state file")
        held[gpu_uuid] = held.get(gpu_uuid, 0) + 1
    visible = sorted(held, key=lambda u: by_uuid[u].index)
    env = grant.envs
    check(
        env.get("NVIDIA_VISIBLE_DEVICES") == ",".join(visible),
        f"{who}: NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES')}",
    )
    check(
        env.get("VGPU_ALLOCATION_ID") == allocation_id(grant.device_ids),
        f"{who}: VGPU_ALLOCATION_ID={env.get('VGPU_ALLOCATION_ID')}",
    )
    for i, gpu_uuid in enumerate(visible):
        slices = held[gpu_uuid]
        memory_mib = slices * (by_uuid[gpu_uuid].memory_total_bytes // REPLICAS) // MiB
        share_percent = slices * 100 // REPLICAS
        check(
            env.get(f"VGPU_MEMORY_LIMIT_MIB_{i}") == str(memory_mib),
            f"{who}: VGPU_MEMORY_LIMIT_MIB_{i}={memory_mib}",
        )
        check(
            env.get(f"VGPU_COMPUTE_SHARE_PERCENT_{i}") == str(share_percent),
            f"{who}: VGPU_COMPUTE_SHARE_PERCENT_{i}={share_percent}",
        )


def check_capabilities(exec_prefix: str, timeout_s: float) -> None:
    """From inside the container, read the environ of and stop/resume two host processes: one
    running as another user, one as root with every capability."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VGPU_ALLOCATION_ID": PROBE_MARKER}
    targets = [
        # setpriv rather than Popen(user=...): that forks without exec in a process with gRPC
        # threads, and gRPC's fork handlers can crash the child.
        subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "600"],
            env=env,
        ),
        subprocess.Popen(["sleep", "600"], env=env),
    ]
    try:
        command = [*shlex.split(exec_prefix), "python3", "-c", PROBE, PROBE_MARKER]
        command += [str(t.pid) for t in targets]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        for line in (result.stdout + result.stderr).splitlines():
            log.info("probe: %s", line)
        check(
            result.returncode == 0,
            "from the container: read /proc/<pid>/environ of, and SIGSTOP/SIGCONT, a host process "
            f"of uid {NOBODY} and one of root with every capability",
        )
    finally:
        for target in targets:
            target.kill()
            target.wait()


def check_http(exec_prefix: str, required: bool, timeout_s: float) -> None:
    """From inside the container: /healthz answers 200, and /metrics names the admitted pods'
    containers (so the daemon reached the kubelet's pod-resources API too)."""
    wanted = [
        "vgpu_build_info{",
        f'vgpu_pod_resources_up{{node="{NODE_NAME}"}} 1.0',
        *(f'pod="{pod}"' for pod in PODS),
    ]
    command = [*shlex.split(exec_prefix), "python3", "-c", HTTP_PROBE, str(min(timeout_s, 20))]
    command += wanted
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s + 10, check=False
    )
    for line in (result.stdout + result.stderr).splitlines():
        log.info("http: %s", line)
    if result.returncode == NOTHING_LISTENS and not required:
        log.warning("SKIPPED: nothing serves the metrics port in this build (--metrics optional)")
        return
    check(
        result.returncode == 0,
        "GET /healthz answers 200; GET /metrics names the admitted pods (from pod-resources)",
    )


async def drive(
    root: Path,
    *,
    start: str,
    stop: str,
    exec_prefix: str | None,
    metrics_required: bool,
    timeout_s: float,
) -> None:
    plugin_dir = root / "device-plugins"
    (root / "fake").mkdir(exist_ok=True)
    write_state_file(root / "fake" / "gpus.json", FakeState(gpus=GPUS))
    kubelet = KubeletSimulator(plugin_dir, root / "pod-resources" / "kubelet.sock")
    await kubelet.start()
    try:
        started = time.monotonic()
        await asyncio.to_thread(run_command, start, timeout_s)
        await kubelet.wait_for(
            lambda: (
                kubelet.is_registered(RESOURCE)
                and len(kubelet.healthy_ids(RESOURCE)) == REPLICAS * len(GPUS)
            ),
            timeout_s=timeout_s,
            what=f"the daemon in the container to register {RESOURCE} with all its slices",
        )
        check(
            True,
            f"registered {RESOURCE} from the container with {REPLICAS * len(GPUS)} healthy "
            f"slices, {time.monotonic() - started:.1f}s after the start command",
        )
        accepted = [r for r in kubelet.registrations if r.accepted]
        check(
            accepted[-1].endpoint == endpoint_name(RESOURCE),
            f"endpoint {accepted[-1].endpoint}",
        )

        pod = await kubelet.admit_pod(PODS[0], [("main", 1)])
        check_grant(pod.containers[0], 1)
        pod = await kubelet.admit_pod(PODS[1], [("small", 1), ("large", 2)])
        check_grant(pod.containers[0], 1)
        check_grant(pod.containers[1], 2)
        check(len(kubelet.allocated_ids(RESOURCE)) == 4, "4 slices allocated in all")
        if exec_prefix:
            await asyncio.to_thread(check_capabilities, exec_prefix, timeout_s)
            await asyncio.to_thread(check_http, exec_prefix, metrics_required, timeout_s)

        await asyncio.to_thread(run_command, stop, timeout_s)
        socket = plugin_dir / endpoint_name(RESOURCE)
        check(not socket.exists(), f"the daemon removed {socket.name} when it stopped")
    finally:
        await kubelet.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, required=True, help="the node's directories")
    parser.add_argument("--start", required=True, help="command that starts the container")
    parser.add_argument("--stop", required=True, help="command that stops it and waits")
    parser.add_argument(
        "--exec", dest="exec_prefix", help="command prefix that runs a command in the container"
    )
    parser.add_argument(
        "--metrics",
        choices=["required", "optional"],
        default="required",
        help="optional: pass when nothing listens on the metrics port (a build without it)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver: %(message)s")
    logging.getLogger("deviceplugin").setLevel(logging.WARNING)
    try:
        asyncio.run(
            drive(
                args.root,
                start=args.start,
                stop=args.stop,
                exec_prefix=args.exec_prefix,
                metrics_required=args.metrics == "required",
                timeout_s=args.timeout,
            )
        )
    except (CheckError, TimeoutError, subprocess.TimeoutExpired) as e:
        log.error("FAILED: %s", e)
        return 1
    log.info("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
