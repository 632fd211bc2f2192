"""The canary: an MPS client started through a pipe directory that creates a CUDA context and
exits, bounded in time. It tells a wedged GPU from a healthy one: on a GPU where a client was
killed with work in flight, every client that connects afterwards hangs in CUDA init while the
control daemon answers as if all were well.

A canary that does not finish within its bound has hung: the GPU is wedged (the supervisor
restarts MPS). One that exits non-zero has failed for another reason (no libcuda where the
daemon runs, a refused client): that is reported, never taken for a wedge, so that a canary that
cannot work does not restart MPS again and again.

The default canary is `python -c CUDA_CANARY` (libcuda.so.1 through ctypes); tests give the fake
control command's own (`fake_mps_control.py canary`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.allocation import MpsDefaults
from deviceplugin.gpu.mps.runner import MpsCommandError, MpsTimeoutError, run_bounded

# cuInit, cuDeviceGet(0), cuCtxCreate, cuCtxDestroy; exit 0, or 2 naming the failing call.
CUDA_CANARY = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        print(f"{what} failed with CUDA error {code}", file=sys.stderr)
        sys.exit(2)
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
context = ctypes.c_void_p()
check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate")
check(cuda.cuCtxDestroy_v2(context), "cuCtxDestroy")
"""


ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"


def default_canary() -> tuple[str, ...]:
    return (sys.executable, "-c", CUDA_CANARY)


@dataclass(frozen=True, slots=True)
class CanaryTarget:
    """Where a canary goes: a server's default namespace (v3) or a GPU (v2), named by `label`,
    reached through the environment `env` (CUDA_MPS_PIPE_DIRECTORY, CUDA_VISIBLE_DEVICES)."""

    label: str
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class CanaryResult:
    hung: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.hung and not self.error


def run_canary(
    argv: Sequence[str], base_env: Mapping[str, str], target: CanaryTarget, timeout_s: float
) -> CanaryResult:
    """Run the canary for `target`; never raises."""
    env = {**base_env, **dict(target.env)}
    shown = f"the MPS canary for {target.label}"
    try:
        code, out, err = run_bounded(list(argv), env, None, timeout_s, shown)
    except MpsTimeoutError:
        return CanaryResult(hung=True, error=f"{shown} did not finish within {timeout_s:g} s")
    except (MpsCommandError, OSError) as e:
        return CanaryResult(error=f"{shown} could not run: {e}")
    if code != 0:
        said = (err or out).strip().splitlines()
        return CanaryResult(
            error=f"{shown} exited with {code}" + (f": {said[-1][:200]}" if said else "")
        )
    return CanaryResult()


def canary_targets(
    pipe: Path, servers: Sequence[str] | None, defaults: MpsDefaults
) -> list[CanaryTarget]:
    """Under MPS v3 each server's default namespace (`servers`); under v2 (`servers` None)
    each GPU of `defaults` through the pipe directory."""
    if servers is not None:
        return [
            CanaryTarget(server, ((ENV_PIPE_DIRECTORY, str(pipe / server)),)) for server in servers
        ]
    return [
        CanaryTarget(uuid, ((ENV_PIPE_DIRECTORY, str(pipe)), ("CUDA_VISIBLE_DEVICES", uuid)))
        for uuid, _ in defaults.pinned_mem_limit_mib
    ]
