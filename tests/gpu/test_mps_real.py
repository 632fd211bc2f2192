"""MPS on real hardware: the supervisor starts a private MPS control daemon, sets one slice's
limits on a GPU, and CUDA clients connect to it and find those limits enforced by the GPU.

What it confirms, that the stand-in cannot: that `nvidia-cuda-mps-control -d` with our pipe and
log directories starts, that it takes `set_default_device_pinned_mem_limit <uuid> <n>M` and
`set_default_active_thread_percentage <n>` and reads them back, that a client through the pipe
directory is held to the pinned-memory limit (an allocation over it fails with
CUDA_ERROR_OUT_OF_MEMORY), that a client cannot raise its limit through
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT but can lower it, and that `quit` ends the control daemon.

The clients use the CUDA driver API through ctypes (libcuda.so.1, which the driver installs), so
nothing but the driver is needed. Each test uses its own pipe directory, so it does not touch an
MPS daemon that may already run on the machine. Skipped without an NVIDIA GPU and driver
(tests/gpu/conftest.py) and without nvidia-cuda-mps-control. The figures each client saw are
written to $VGPU_GPU_REPORT_DIR (when set) as JSON, for the record.

MPS v3, where the driver has it (R615 and later; skipped otherwise): a control daemon run with
`-p 3 -m` and a namespace capped at one slice's threads, whose pipe directory a client uses, is
seen capped as a smaller SM count through libcuda; a client exporting a higher cap is still
capped; the namespace's caps cannot be set once a client is attached; and a client with GPU work
in flight, drained through the control daemon and then killed, leaves its neighbour working and
the canary passing. The figures go to `mps-v3.json`. All of this file runs as one command in
well under 5 minutes:
`VGPU_GPU_REPORT_DIR=<dir> timeout 280 python -m pytest tests/gpu/test_mps_real.py -n 0`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.allocation import DeviceLimits, mps_defaults
from deviceplugin.config import HealthConfig, MpsConfig, SliceRule, SlicingConfig
from deviceplugin.gpu.mps import (
    V3,
    MpsControlDaemon,
    MpsNamespaceError,
    MpsOptions,
    default_canary,
    detect_protocol,
)
from deviceplugin.gpu.nvml import NvmlBackend
from deviceplugin.model import GpuPlan
from deviceplugin.slicing import build_inventory
from tests.gpu.mps_clients import BUSY, STEADY, CudaClient

pytestmark = pytest.mark.gpu

MiB = 1024**2
REPLICAS = 4
CUDA_ERROR_OUT_OF_MEMORY = 2

# A CUDA client: creates a context on the one visible GPU, reports what the driver says, then
# tries each allocation (MiB) in argv and reports the CUDA result of each.
CLIENT = r"""
import ctypes, json, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        print(json.dumps({"error": f"{what} failed with CUDA error {code}"})); sys.exit(1)
check(cuda.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
sms = ctypes.c_int()
check(cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev), "cuDeviceGetAttribute")
results = {}
for mib in sys.argv[1:]:
    ptr = ctypes.c_uint64()
    code = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(mib) << 20))
    results[mib] = code
    if code == 0:
        cuda.cuMemFree_v2(ptr)
cuda.cuCtxDestroy_v2(ctx)
print(json.dumps({"free_bytes": free.value, "total_bytes": total.value,
                  "multiprocessor_count": sms.value, "alloc": results}))
"""


@pytest.fixture(scope="module")
def control_command() -> str:
    found = shutil.which("nvidia-cuda-mps-control")
    if found is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    return found


@pytest.fixture(scope="module")
def plan() -> GpuPlan:
    backend = NvmlBackend(HealthConfig(enabled=False))
    try:
        reading = backend.poll()
    finally:
        backend.close()
    inventory = build_inventory(reading, SlicingConfig(default=SliceRule(replicas=REPLICAS)))
    sliced = [p for p in inventory.plans if p.sliced]
    if not sliced:
        pytest.skip("no GPU here can be sliced (all in MIG mode?)")
    return sliced[0]


@pytest.fixture
def mps(control_command: str, plan: GpuPlan) -> Iterator[MpsControlDaemon]:
    root = Path(tempfile.mkdtemp(prefix="vgmps", dir="/tmp"))
    config = MpsConfig(enabled=True, root=str(root), control_command=control_command)
    # Only the test's GPU is visible to the control daemon and its servers.
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": plan.gpu.uuid}
    daemon = MpsControlDaemon(config, shm_path=Path("/dev/shm"), environ=environ)
    try:
        daemon.start(mps_defaults((plan,)))
        yield daemon
    finally:
        daemon.stop()
        report(root.name + "-control.log", (root / "log" / "control.log"))
        shutil.rmtree(root, ignore_errors=True)


def report(name: str, source: Path | dict[str, Any]) -> None:
    directory = os.environ.get("VGPU_GPU_REPORT_DIR")
    if not directory:
        return
    target = Path(directory) / name
    if isinstance(source, Path):
        if source.exists():
            shutil.copyfile(source, target)
    else:
        target.write_text(json.dumps(source, indent=2) + "\n")


def client(
    mps: MpsControlDaemon, plan: GpuPlan, *allocations_mib: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a CUDA client of `mps` on the plan's GPU; what it saw."""
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CUDA_VISIBLE_DEVICES": plan.gpu.uuid,
        "CUDA_MPS_PIPE_DIRECTORY": str(mps.pipe_directory),
        **(env or {}),
    }
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, *map(str, allocations_mib)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def slice_mib(plan: GpuPlan) -> int:
    return plan.memory_per_slice_bytes // MiB


def test_the_control_daemon_takes_one_slices_defaults(mps: MpsControlDaemon, plan: GpuPlan) -> None:
    assert mps.status.up
    assert mps.pid() is not None
    memory = mps.send(f"get_default_device_pinned_mem_limit {plan.gpu.uuid}")
    threads = mps.send("get_default_active_thread_percentage")
    report(
        "mps-defaults.json", {"memory": memory, "threads": threads, "slice_mib": slice_mib(plan)}
    )
    # The control daemon may print the limit in G or M; either way it is one slice's.
    shown = memory.strip().upper()
    if shown.endswith("G"):
        assert int(float(shown[:-1])) == slice_mib(plan) // 1024
    else:
        assert int(float(shown.rstrip("M"))) == slice_mib(plan)
    assert float(threads) == 100 // REPLICAS


def test_a_client_is_held_to_one_slice_of_memory(mps: MpsControlDaemon, plan: GpuPlan) -> None:
    limit = slice_mib(plan)
    seen = client(mps, plan, 1024, limit + 512)
    report("mps-client.json", {**seen, "slice_mib": limit, "gpu": plan.gpu.name})
    assert seen["alloc"]["1024"] == 0
    assert seen["alloc"][str(limit + 512)] == CUDA_ERROR_OUT_OF_MEMORY
    servers = mps.send("get_server_list").split()
    assert servers, "the client ran, so an MPS server should have been started"


def test_a_client_cannot_raise_its_limit_but_can_lower_it(
    mps: MpsControlDaemon, plan: GpuPlan
) -> None:
    limit = slice_mib(plan)
    raised = client(
        mps, plan, limit + 512, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={2 * limit}M"}
    )
    lowered = client(
        mps, plan, limit // 2 + 512, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit // 2}M"}
    )
    report("mps-client-env.json", {"raised": raised, "lowered": lowered, "slice_mib": limit})
    assert raised["alloc"][str(limit + 512)] == CUDA_ERROR_OUT_OF_MEMORY
    assert lowered["alloc"][str(limit // 2 + 512)] == CUDA_ERROR_OUT_OF_MEMORY


def test_defaults_read_back_match_and_a_raised_one_is_set_again(
    mps: MpsControlDaemon, plan: GpuPlan
) -> None:
    """The real control daemon's answers to the reads (several on one stdin) are understood: no
    drift right after the start, and a raised default is seen and set again."""
    defaults = mps_defaults((plan,))
    mps.supervise_once(defaults)
    assert mps.status.drift_total == ()
    mps.send("set_default_active_thread_percentage 100")
    mps.send(f"set_default_device_pinned_mem_limit {plan.gpu.uuid} {2 * slice_mib(plan)}M")
    mps.supervise_once(defaults)
    assert dict(mps.status.drift_total) == {"active_thread_percentage": 1, "pinned_mem_limit": 1}
    assert float(mps.send("get_default_active_thread_percentage")) == 100 // REPLICAS
    report("mps-pipe-directory.json", {"files": sorted(os.listdir(mps.pipe_directory))})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root")
def test_a_client_works_with_the_pipe_directory_read_only(
    mps: MpsControlDaemon, plan: GpuPlan
) -> None:
    """Pods get the pipe directory read-only: a client in a mount namespace where it is a
    read-only bind mount still connects and is held to its slice."""
    pipe = str(mps.pipe_directory)
    limit = slice_mib(plan)
    done = subprocess.run(
        [
            "unshare", "-m", "sh", "-c",
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift '
            '&& exec "$@"',
            "sh", pipe, sys.executable, "-c", CLIENT, "1024", str(limit + 512),
        ],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_VISIBLE_DEVICES": plan.gpu.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": pipe,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    report("mps-client-read-only-pipe.json", seen)
    assert seen["alloc"]["1024"] == 0
    assert seen["alloc"][str(limit + 512)] == CUDA_ERROR_OUT_OF_MEMORY


def test_quit_ends_the_control_daemon(control_command: str, plan: GpuPlan) -> None:
    root = Path(tempfile.mkdtemp(prefix="vgmps", dir="/tmp"))
    try:
        config = MpsConfig(enabled=True, root=str(root), control_command=control_command)
        daemon = MpsControlDaemon(config)
        daemon.start(mps_defaults((plan,)))
        pid = daemon.pid()
        assert pid is not None
        daemon.stop()
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
        assert daemon.pid() is None
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_the_daemon_runs_mps_and_a_container_env_reaches_it(
    control_command: str, plan: GpuPlan, short_tmp: Path
) -> None:
    """The whole daemon on the real GPUs with MPS on: a pod's Allocate env, used by a client,
    reaches the daemon's MPS control daemon and holds the client to its slice."""
    import asyncio
    import dataclasses

    from deviceplugin.app import Daemon, DaemonSettings
    from deviceplugin.config import Config
    from deviceplugin.gpu.backend import open_backend
    from deviceplugin.sim.kubelet import KubeletSimulator

    plugin_dir = short_tmp / "dp"
    podres = short_tmp / "pr" / "kubelet.sock"
    plugin_dir.mkdir()
    podres.parent.mkdir()
    mps_config = MpsConfig(
        enabled=True, root=str(short_tmp / "mps"), control_command=control_command
    )
    config = Config(slicing=SlicingConfig(default=SliceRule(replicas=REPLICAS)), mps=mps_config)
    settings = DaemonSettings(
        config=config,
        backend="nvml",
        device_plugin_dir=plugin_dir,
        pod_resources_socket=podres,
        state_dir=short_tmp / "state",
        metrics_address="",
        node_name="gpu-test",
    )
    sim = KubeletSimulator(plugin_dir, podres)
    await sim.start()
    backend = open_backend("nvml", config)
    daemon = Daemon(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await sim.wait_for(lambda: sim.is_registered(config.resource_name), timeout_s=60)
        pod = await sim.admit_pod("p", [("c", 1)], resource_name=config.resource_name)
        grant = pod.containers[0]
        uuid = grant.envs["NVIDIA_VISIBLE_DEVICES"]
        env = {k: v for k, v in grant.envs.items() if k.startswith(("CUDA_MPS_", "VGPU_"))}
        limit = int(grant.envs["VGPU_MEMORY_LIMIT_MIB_0"])
        assert daemon.mps is not None
        gpu_plan = dataclasses.replace(plan, gpu=dataclasses.replace(plan.gpu, uuid=uuid))
        seen = await asyncio.to_thread(client, daemon.mps, gpu_plan, 1024, limit + 512, env=env)
        report("mps-daemon-client.json", {**seen, "env": env, "limit_mib": limit})
        assert seen["alloc"]["1024"] == 0
        assert seen["alloc"][str(limit + 512)] == CUDA_ERROR_OUT_OF_MEMORY
        assert daemon.health().mps is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        backend.close()
        await sim.stop()
    assert daemon.mps.pid() is None  # quit on the way out


# --- MPS v3 ----------------------------------------------------------------------------------


@pytest.fixture
def mps_v3(control_command: str, plan: GpuPlan) -> Iterator[MpsControlDaemon]:
    root = Path(tempfile.mkdtemp(prefix="vgm3", dir="/tmp"))
    config = MpsConfig(enabled=True, root=str(root), control_command=control_command)
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": plan.gpu.uuid}
    options = MpsOptions(protocol=V3, canary=default_canary(), canary_interval_s=0)
    daemon = MpsControlDaemon(config, options=options, shm_path=Path("/dev/shm"), environ=environ)
    detected = detect_protocol(daemon.runner, None)
    if detected.protocol != V3:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no MPS v3 here: {detected.reason}")
    try:
        daemon.start(mps_defaults((plan,)))
        yield daemon
    finally:
        daemon.stop()
        report(root.name + "-v3-control.log", (root / "log" / "control.log"))
        shutil.rmtree(root, ignore_errors=True)


def one_slice(plan: GpuPlan) -> DeviceLimits:
    memory = plan.memory_per_slice_bytes
    return DeviceLimits(plan.gpu.uuid, memory, memory, 100 // REPLICAS, plan.gpu.memory_total_bytes)


def steady(pipe: str, plan: GpuPlan, **env: str) -> CudaClient:
    return CudaClient(
        STEADY, {"CUDA_VISIBLE_DEVICES": plan.gpu.uuid, "CUDA_MPS_PIPE_DIRECTORY": pipe, **env}
    )


def test_v3_a_namespace_caps_its_clients_sms_and_holds_once_attached(
    mps_v3: MpsControlDaemon, plan: GpuPlan
) -> None:
    whole = steady("/nonexistent-pipe-directory", plan)  # no MPS: the whole GPU
    ns = mps_v3.provision("gpu-test-a", [one_slice(plan)])
    capped = steady(ns.pipe_directory, plan)
    raised = steady(ns.pipe_directory, plan, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100")
    clients = [whole, capped, raised]
    try:
        seen = {"whole": whole.line(), "capped": capped.line(), "raised": raised.line()}
        try:
            mps_v3.provision("gpu-test-a", [replace(one_slice(plan), share_percent=100)])
            refused = ""
        except MpsNamespaceError as e:
            refused = str(e)
        report("mps-v3.json", {**seen, "namespace": ns.pipe_directory, "set_refused": refused})
        full = seen["whole"]["multiprocessor_count"]
        assert 0 < seen["capped"]["multiprocessor_count"] <= full * (100 // REPLICAS) // 100 + 1
        assert seen["raised"]["multiprocessor_count"] == seen["capped"]["multiprocessor_count"]
        assert refused, "namespace set after a client attached should be refused"
    finally:
        for client in clients:
            client.kill()


def test_v3_a_drained_client_killed_with_work_in_flight_leaves_its_neighbour_working(
    mps_v3: MpsControlDaemon, plan: GpuPlan
) -> None:
    victim_ns = mps_v3.provision("gpu-test-victim", [one_slice(plan)])
    neighbour_ns = mps_v3.provision("gpu-test-neighbour", [one_slice(plan)])
    env = {"CUDA_VISIBLE_DEVICES": plan.gpu.uuid}
    neighbour = steady(neighbour_ns.pipe_directory, plan)
    victim = CudaClient(BUSY, {**env, "CUDA_MPS_PIPE_DIRECTORY": victim_ns.pipe_directory})
    try:
        ready = {"neighbour": neighbour.line(), "victim": victim.line()}
        assert ready["victim"] == {"busy": True}, ready

        def kill() -> int:
            victim.kill()
            return victim.process.returncode

        mps_v3.stop_client(victim.pid, kill)
        after = neighbour.ask("work")
        mps_v3.supervise_once(mps_defaults((plan,)))  # the canary: no wedge
        status = mps_v3.status
        report(
            "mps-v3-drain.json",
            {**ready, "neighbour_after": after, "drains": status.drains_total,
             "wedges": status.wedges_total, "canary_error": status.canary_error},
        )  # fmt: skip
        assert status.drains_total == 1
        assert after == {"work": 0}
        assert status.wedges_total == 0
    finally:
        victim.kill()
        neighbour.kill()
