"""The demo's node and workloads: its config, the pods it schedules, and the GPU work each
container does, as real processes carrying their Allocate env and listed in the fake GPU state
file."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from deviceplugin.config import (
    Config,
    EnforcementConfig,
    GpuMatch,
    MigConfig,
    MigStrategy,
    SliceOverride,
    SliceRule,
    SlicingConfig,
)
from deviceplugin.gpu.examples import DEMO_GPUS, GiB, MiB
from deviceplugin.gpu.fake import (
    FakeGpu,
    FakeProcess,
    FakeState,
    write_state_file,
)
from deviceplugin.sim.kubelet import PodGrant
from deviceplugin.sim.records import ContainerGrant
from deviceplugin.slicing import format_bytes

MIG_SMALL = "nvidia.com/mig-1g.10gb"

# Slices follow memory on the big GPU and count on the small one: per-GPU rules are one of the
# things a single node-wide replica count cannot express. MIG devices are advertised per profile
# (the mixed strategy); each 1g.10gb instance is time-sliced in two.
DEMO_CONFIG = Config(
    slicing=SlicingConfig(
        default=SliceRule(replicas=4),
        overrides=(
            SliceOverride(GpuMatch(model="*A100*"), SliceRule(memory_per_slice_bytes=10 * GiB)),
            SliceOverride(GpuMatch(profile="1g.10gb"), SliceRule(replicas=2)),
        ),
    ),
    enforcement=EnforcementConfig(poll_interval_s=0.2),
    mig=MigConfig(strategy=MigStrategy.MIXED),
)

DEMO_PODS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("llm-finetune", (("trainer", 4),)),
    ("inference", (("server", 2), ("metrics-sidecar", 1))),
    ("notebook", (("jupyter", 1),)),
    ("jax-train", (("jax", 1),)),
)
# Pods asking for a MIG slice, as they would with NVIDIA's plugin: nvidia.com/mig-1g.10gb: 1.
DEMO_MIG_PODS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("embeddings", (("encoder", 1),)),
)

# The GPU work each container does: (memory in use, SM demand in percent). The sidecar holds a
# slice but never touches the GPU; it still has its series, from the moment it was allocated.
DEMO_WORKLOADS: dict[tuple[str, str], tuple[int, float]] = {
    ("llm-finetune", "trainer"): (30 * GiB, 100.0),
    ("inference", "server"): (12 * GiB, 100.0),  # the noisy neighbour: 25% share, wants it all
    ("notebook", "jupyter"): (6 * GiB, 20.0),
}
# JAX-style containers: they reserve a fraction of the GPU's memory at start, as JAX does. The
# fraction comes from XLA_PYTHON_CLIENT_MEM_FRACTION, which Allocate sets from the slice; without
# it JAX takes 75% of the GPU, far over a slice, and the enforcer would kill it. (SM demand in %.)
SIZED_BY_HINTS: dict[tuple[str, str], float] = {("jax-train", "jax"): 20.0}
JAX_DEFAULT_FRACTION = 0.75
ENV_XLA_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def jax_preallocation(envs: Mapping[str, str], gpu_memory_bytes: int) -> int:
    """What a JAX process reserves at start on a GPU of `gpu_memory_bytes`, given its env."""
    fraction = float(envs.get(ENV_XLA_MEM_FRACTION, JAX_DEFAULT_FRACTION))
    return int(fraction * gpu_memory_bytes)


# Work on the MIG slice: its memory is measured and enforced, its utilisation is not (NVML has
# none per MIG device).
DEMO_MIG_WORKLOADS: dict[tuple[str, str], tuple[int, float]] = {
    ("embeddings", "encoder"): (3 * GiB, 60.0),
}


# A second into the live view the notebook grows past its 10Gi: killed after the grace period.
GROW_AFTER_S = 1.0
GROWN = (("default", "notebook", "jupyter"), 14 * GiB)
# The pod whose container the GPU's driver holds to its limit (docs/design.md §15), where the demo
# can make it a real cgroup (deviceplugin/sim/demo_limits.py): admitted last, it lands on the L4,
# whose driver then partitions memory as R615's does with the dmem store. Its process starts
# with (memory, SM demand in %); a second into the live view it asks for more than its limit.
DRIVER_LIMITED_POD: tuple[str, tuple[tuple[str, int], ...]] = ("capped", (("trainer", 1),))
DRIVER_LIMITED_WORK = (4 * GiB, 20.0)
DRIVER_LIMITED_ASKS = 9 * GiB


def demo_gpus(partitioned: bool) -> tuple[FakeGpu, ...]:
    """The demo's GPUs; with `partitioned` the L4's driver partitions memory (dmem)."""
    if not partitioned:
        return DEMO_GPUS
    l4 = dataclasses.replace(DEMO_GPUS[1], driver_version="615.71", memory_partitions="dmem")
    return (DEMO_GPUS[0], l4, *DEMO_GPUS[2:])


# A process on the node that no pod asked slices for: counted as unattributed, never touched.
HOST_PROCESS = (2 * GiB, 30.0)

# A workload: a process that sleeps, set to be SIGKILLed by the kernel when the demo dies (even
# while it is stopped). It asks for that itself and then becomes `sleep` (the same pid and env):
# a `preexec_fn` would run Python between fork and exec in the threaded demo, where a child can
# abort on a lock another thread held at the fork.
_WORKLOAD = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the demo died before the request took hold
os.execvp("sleep", ["sleep", "86400"])
"""


class DemoWorkloads:
    """Real processes standing in for the containers' GPU processes: each carries its
    container's Allocate env, as a container's processes do, and is listed in the state file
    for as long as it lives, as the driver lists a GPU process."""

    def __init__(self, state_file: Path, gpus: tuple[FakeGpu, ...] = DEMO_GPUS) -> None:
        self._state_file = state_file
        self._gpus = gpus
        # pid -> (process, GPU UUID, what it does, whose it is)
        self._work: dict[int, tuple[subprocess.Popen[bytes], str, FakeProcess, str]] = {}

    def start(self, pods: Sequence[PodGrant]) -> list[str]:
        """Start every container's work; a line for each that sized itself from its hints."""
        said: list[str] = []
        for pod in pods:
            for c in pod.containers:
                if not c.device_ids:
                    continue
                uuid = c.device_ids[0].rsplit("::", 1)[0]
                owner = f"{pod.namespace}/{pod.name}/{c.name}"
                work = DEMO_WORKLOADS.get((pod.name, c.name)) or DEMO_MIG_WORKLOADS.get(
                    (pod.name, c.name)
                )
                demand = SIZED_BY_HINTS.get((pod.name, c.name))
                if demand is not None:
                    gpu = next(g for g in DEMO_GPUS if g.uuid == uuid)
                    memory = jax_preallocation(c.envs, gpu.memory_total_bytes)
                    work = (memory, demand)
                    limit = int(c.envs.get("VGPU_MEMORY_LIMIT_MIB_0", "0")) * MiB
                    unhinted = jax_preallocation({}, gpu.memory_total_bytes)
                    said += [
                        f"{owner} is JAX-style: at start it reserves {ENV_XLA_MEM_FRACTION}="
                        f"{c.envs.get(ENV_XLA_MEM_FRACTION, '(unset)')}",
                        f"  of the {gpu.name}'s {format_bytes(gpu.memory_total_bytes)} "
                        f"({format_bytes(memory)}), within its {format_bytes(limit)} limit; "
                        "without the hint JAX would",
                        f"  take {JAX_DEFAULT_FRACTION:.0%} ({format_bytes(unhinted)}) and be "
                        "killed after the grace period",
                    ]
                if work is not None and not any(w[3] == owner for w in self._work.values()):
                    self._add(uuid, dict(c.envs), *work, owner=owner)
        self._add(DEMO_GPUS[1].uuid, {}, *HOST_PROCESS, owner="host")
        self.write()
        return said

    def _add(
        self, gpu_uuid: str, envs: dict[str, str], memory: int, demand: float, *, owner: str
    ) -> int:
        """Start `owner`'s process (listed in the state file from the next `write`); its pid."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **envs}
        # Dies with the demo, even when the demo is SIGKILLed (and even while stopped).
        proc = subprocess.Popen([sys.executable, "-c", _WORKLOAD, str(os.getpid())], env=env)
        self._work[proc.pid] = (proc, gpu_uuid, FakeProcess(proc.pid, memory, demand), owner)
        return proc.pid

    def start_one(self, pod: PodGrant, container: ContainerGrant, work: tuple[int, float]) -> int:
        """Start one container's process, not yet listed (it asks for no GPU memory until the
        next `write`, as `start` does); its pid."""
        uuid = container.device_ids[0].rsplit("::", 1)[0]
        owner = f"{pod.namespace}/{pod.name}/{container.name}"
        return self._add(uuid, dict(container.envs), *work, owner=owner)

    def grow(self, owner: str, memory: int) -> int | None:
        """Make `owner`'s process use `memory`; returns its pid, or None when `owner` has no
        running process (it exited already)."""
        for pid, (proc, uuid, work, who) in self._work.items():
            if who == owner:
                self._work[pid] = (
                    proc,
                    uuid,
                    dataclasses.replace(work, used_memory_bytes=memory),
                    who,
                )
                self.write()
                return pid
        return None

    def reap(self) -> list[tuple[int, str, int]]:
        """Forget processes that have exited (the driver stops listing them); (pid, owner,
        return code: -9 when killed)."""
        gone = [
            (pid, w[3], code) for pid, w in self._work.items() if (code := w[0].poll()) is not None
        ]
        for pid, _, _ in gone:
            del self._work[pid]
        if gone:
            self.write()
        return gone

    def write(self) -> None:
        per_gpu: dict[str, list[FakeProcess]] = {}
        for _, uuid, work, _ in self._work.values():
            per_gpu.setdefault(uuid, []).append(work)
        gpus = tuple(
            dataclasses.replace(
                g,
                processes=tuple(per_gpu.get(g.uuid, ())),
                mig_devices=tuple(
                    dataclasses.replace(d, processes=tuple(per_gpu.get(d.uuid, ())))
                    for d in g.mig_devices
                ),
            )
            for g in self._gpus
        )
        write_state_file(self._state_file, FakeState(gpus=gpus))

    def stop(self) -> None:
        for proc, *_ in self._work.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._work.clear()
