"""R615 GPU memory partitions on real hardware: the checks T0 to T6 of docs/design.md §15's test
plan, one script, a JSON report.

    timeout 540 .venv/bin/python -m tests.gpu.r615_checks --report report.json [--gpu UUID]

Needs root, cgroup v2 at /sys/fs/cgroup, a driver of 615 or newer and a GPU out of MIG mode;
without them the report says why it was skipped (exit 0). Every cgroup lives under a fresh
`/sys/fs/cgroup/vgpu-t/<run id>/`, removed at the end with everything in it (soft limits zeroed
first, but where a check leaks on purpose); `dmem` is enabled for children only where it is not
already, and turned off again at the end where this script turned it on. CUDA work runs in workers
(tests/gpu/r615_worker.py) each held until it is in its cgroup and its limits are set.

- T0 environment: driver and CUDA versions, kernel, cgroup v2, `dmem.capacity`, the store (dmem or
  misc), MIG mode, the binding's calls.
- T1 a leaf's hard limit (8 GiB, soft 0) set before cuInit: cuMemGetInfo's total, how much can be
  allocated (256 MiB steps) and the code at the wall, NVML's currentUsed while held, NVML's memory
  info from inside, and how long the set took.
- T2 a parent's limit alone (8 GiB), two unlimited leaves: their budget is shared or not; what the
  leaves report.
- T3 lowering a leaf's hard limit below its use (holds 6 GiB, set 2 GiB): the code, the readback,
  whether the held buffers still work, whether the next 256 MiB fails.
- T4 a limit set after the context exists (1 GiB held, then 4 GiB): where allocation stops, and
  whether cuMemGetInfo follows.
- T5 (dmem) the ancestors' dmem.min: after a leaf's soft 1 GiB, after zeroing, after a removal
  without zeroing (the leak), and after a set on the parent (the repair the daemon relies on).
- T6 error codes: a missing cgroup, the root, a cgroup without dmem files, soft above hard, a get
  on a leaf with nothing set, a set from a process that is not root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
STEP = 256 * MiB
MOUNT = Path("/sys/fs/cgroup")
WORKER = Path(__file__).with_name("r615_worker.py")
ANSWER_TIMEOUT_S = 90.0
NOT_ROOT_SET = r"""
import os, sys, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1])
os.setgid(65534); os.setuid(65534)
limits = pynvml.c_nvmlSetMemoryLimits_v1_t(nameSpace=sys.argv[2].encode(), softLimit=0,
                                           hardLimit=1 << 30)
try:
    pynvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)
    print(0)
except pynvml.NVMLError as e:
    print(e.value)
"""


class Nvml:
    """The memory-limit calls through pynvml, their codes as values (0: success)."""

    def __init__(self, gpu_uuid: str) -> None:
        import pynvml

        self.pynvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)

    def set(self, path: Path, soft: int, hard: int) -> int:
        limits = self.pynvml.c_nvmlSetMemoryLimits_v1_t(
            nameSpace=str(path).encode(), softLimit=soft, hardLimit=hard
        )
        try:
            self.pynvml.nvmlDeviceSetMemoryLimits_v1(self.handle, limits)
        except self.pynvml.NVMLError as e:
            return int(e.value)
        return 0

    def get(self, path: Path) -> dict[str, int]:
        limits = self.pynvml.c_nvmlGetMemoryLimits_v1_t(nameSpace=str(path).encode())
        try:
            self.pynvml.nvmlDeviceGetMemoryLimits_v1(self.handle, limits)
        except self.pynvml.NVMLError as e:
            return {"code": int(e.value)}
        return {
            "code": 0,
            "soft_bytes": int(limits.softLimit),
            "hard_bytes": int(limits.hardLimit),
            "current_used_bytes": int(limits.currentUsed),
        }

    def clear(self, path: Path) -> None:
        self.set(path, 0, 0xFFFFFFFFFFFFFFFF)


class Worker:
    """A worker process, moved into `cgroup` before any CUDA call."""

    def __init__(self, cgroup: Path, gpu_uuid: str) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu_uuid}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        (cgroup / "cgroup.procs").write_text(str(self.proc.pid))
        self.uuid = gpu_uuid

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "uuid": self.uuid, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"the worker did not answer {op} within {ANSWER_TIMEOUT_S}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited during {op} (code {self.proc.wait(5)})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait(10)


class Run:
    """This run's cgroups, workers and GPU; everything removed by `close`."""

    def __init__(self, gpu_uuid: str) -> None:
        self.gpu = gpu_uuid
        self.nvml = Nvml(gpu_uuid)
        self.top = MOUNT / "vgpu-t"
        self.base = self.top / uuid.uuid4().hex[:12]
        self.made: list[Path] = []
        self.enabled: list[Path] = []
        self.workers: list[Worker] = []
        if not self.top.exists():
            self.top.mkdir()
            self.made.append(self.top)
        self.cgroup(self.base)
        for level in (MOUNT, self.top, self.base):
            self.enable_dmem(level)

    def cgroup(self, path: Path) -> Path:
        path.mkdir()
        self.made.append(path)
        return path

    def enable_dmem(self, level: Path) -> None:
        controls = level / "cgroup.subtree_control"
        if "dmem" in controls.read_text().split():
            return
        if "dmem" not in (level / "cgroup.controllers").read_text().split():
            return  # no dmem controller here: the misc store
        controls.write_text("+dmem")
        self.enabled.append(level)

    def worker(self, cgroup: Path) -> Worker:
        worker = Worker(cgroup, self.gpu)
        self.workers.append(worker)
        return worker

    def close(self) -> list[str]:
        problems: list[str] = []
        for worker in self.workers:
            worker.close()
        for path in [*reversed(self.made), self.top]:
            if path.exists():
                self.nvml.clear(path)  # soft to 0 before the directory goes: no reservation left
                if path not in self.made:
                    continue
                try:
                    path.rmdir()
                except OSError as e:
                    problems.append(f"rmdir {path}: {e}")
        for level in reversed(self.enabled):
            if not level.exists():
                continue
            try:
                (level / "cgroup.subtree_control").write_text("-dmem")
            except OSError as e:
                problems.append(f"-dmem on {level}: {e}")
        return problems


def dmem_min(path: Path) -> str | None:
    try:
        return (path / "dmem.min").read_text().strip()
    except OSError:
        return None


def environment(gpu_uuid: str | None) -> dict[str, Any]:
    """T0: what this node offers; `skip` says why the checks cannot run."""
    import pynvml

    from deviceplugin.gpu.nvml.partitions import (
        CGROUP2_SUPER_MAGIC,
        dmem_devices,
        filesystem_magic,
        normal_bus_id,
    )
    from deviceplugin.partitions import driver_major

    pynvml.nvmlInit()
    driver = pynvml.nvmlSystemGetDriverVersion()
    found: dict[str, Any] = {
        "driver_version": driver,
        "cuda_driver_version": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
        "kernel": platform.release(),
        "root": os.geteuid() == 0,
        "binding_has_calls": hasattr(pynvml, "nvmlDeviceSetMemoryLimits_v1"),
    }
    handle = (
        pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        if gpu_uuid
        else pynvml.nvmlDeviceGetHandleByIndex(0)
    )
    found["gpu_uuid"] = pynvml.nvmlDeviceGetUUID(handle)
    found["gpu_name"] = pynvml.nvmlDeviceGetName(handle)
    found["memory_total_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
    found["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
    with contextlib.suppress(pynvml.NVMLError):
        found["mig_mode"] = pynvml.nvmlDeviceGetMigMode(handle)[0]
    try:
        found["cgroup2"] = filesystem_magic(MOUNT) == CGROUP2_SUPER_MAGIC
    except OSError:
        found["cgroup2"] = False
    with contextlib.suppress(OSError):
        found["dmem_capacity"] = (MOUNT / "dmem.capacity").read_text()
    listed = normal_bus_id(found["pci_bus_id"]) in dmem_devices(MOUNT)
    found["store"] = "dmem" if listed else "misc"
    pynvml.nvmlShutdown()
    major = driver_major(driver)
    reasons = [
        (not found["root"], "not root"),
        (not found["cgroup2"], "/sys/fs/cgroup is not cgroup v2"),
        (major is None or major < 615, f"driver {driver} is older than 615"),
        (found.get("mig_mode") == 1, "the GPU is in MIG mode"),
        (not found["binding_has_calls"], "the NVML binding lacks nvmlDeviceSetMemoryLimits_v1"),
    ]
    found["skip"] = next((why for failed, why in reasons if failed), "")
    return found


def t1_leaf_hard_limit(run: Run) -> dict[str, Any]:
    leaf = run.cgroup(run.base / "t1")
    worker = run.worker(leaf)
    started = time.monotonic()
    code = run.nvml.set(leaf, 0, 8 * GiB)
    result: dict[str, Any] = {"set_code": code, "set_seconds": round(time.monotonic() - started, 4)}
    result["init"] = worker.ask("init")
    result["info"] = worker.ask("info")
    result["nvml_inside"] = worker.ask("nvml")
    result["fill"] = worker.ask("fill", step=STEP, cap=16 * GiB)
    result["get_while_held"] = run.nvml.get(leaf)
    worker.ask("free")
    return result


def t2_parent_only(run: Run) -> dict[str, Any]:
    parent = run.cgroup(run.base / "t2")
    run.enable_dmem(parent)
    a, b = run.cgroup(parent / "a"), run.cgroup(parent / "b")
    result: dict[str, Any] = {"set_code": run.nvml.set(parent, 0, 8 * GiB)}
    first, second = run.worker(a), run.worker(b)
    first.ask("init")
    second.ask("init")
    result["a_info"] = first.ask("info")
    result["a_hold_5gib"] = first.ask("alloc", bytes=5 * GiB)
    result["b_fill"] = second.ask("fill", step=STEP, cap=16 * GiB)
    result["get_parent"] = run.nvml.get(parent)
    first.ask("free")
    second.ask("free")
    return result


def t3_lower_below_use(run: Run) -> dict[str, Any]:
    leaf = run.cgroup(run.base / "t3")
    worker = run.worker(leaf)
    worker.ask("init")
    result: dict[str, Any] = {"hold_6gib": worker.ask("fill", step=GiB, cap=6 * GiB)}
    result["set_code"] = run.nvml.set(leaf, 0, 2 * GiB)
    result["readback"] = run.nvml.get(leaf)
    result["held_buffers"] = worker.ask("check")
    result["next_256mib"] = worker.ask("alloc", bytes=STEP)
    result["info"] = worker.ask("info")
    worker.ask("free")
    return result


def t4_limit_after_context(run: Run) -> dict[str, Any]:
    leaf = run.cgroup(run.base / "t4")
    worker = run.worker(leaf)
    worker.ask("init")
    result: dict[str, Any] = {"before": worker.ask("info")}
    result["hold_1gib"] = worker.ask("alloc", bytes=GiB)
    result["set_code"] = run.nvml.set(leaf, 0, 4 * GiB)
    result["after"] = worker.ask("info")
    result["fill"] = worker.ask("fill", step=STEP, cap=8 * GiB)
    worker.ask("free")
    return result


def t5_propagation_and_leak(run: Run, store: str) -> dict[str, Any]:
    if store != "dmem":
        return {"skipped": "misc store: no dmem.min to propagate"}
    parent = run.cgroup(run.base / "t5")
    run.enable_dmem(parent)
    leaf = run.cgroup(parent / "leaf")
    levels = {"parent": parent, "grandparent": run.base}

    def mins() -> dict[str, str | None]:
        return {name: dmem_min(path) for name, path in levels.items()}

    result: dict[str, Any] = {"before": mins(), "set_code": run.nvml.set(leaf, GiB, 8 * GiB)}
    result["after_set"] = mins()
    result["zero_code"] = run.nvml.set(leaf, 0, 8 * GiB)
    result["after_zero"] = mins()
    result["set_again_code"] = run.nvml.set(leaf, GiB, 8 * GiB)
    leaf.rmdir()  # without zeroing: the leak
    result["after_rmdir"] = mins()
    result["parent_get"] = run.nvml.get(parent)
    result["repair_code"] = run.nvml.set(parent, 0, 0xFFFFFFFFFFFFFFFF)
    result["after_repair"] = mins()
    return result


def t6_error_codes(run: Run) -> dict[str, Any]:
    plain = run.cgroup(run.base / "t6")  # a new cgroup enables nothing for its children
    no_dmem = run.cgroup(plain / "nodmem")
    unset = run.cgroup(run.base / "t6-unset")
    not_root = subprocess.run(
        [sys.executable, "-c", NOT_ROOT_SET, run.gpu, str(unset)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    result: dict[str, Any] = {
        "set_not_root": not_root.stdout.strip() or not_root.stderr.strip()[-300:],
        "get_unset_leaf": run.nvml.get(unset),
        "get_root": run.nvml.get(MOUNT),
    }
    result["missing_cgroup"] = run.nvml.set(run.base / "missing", 0, GiB)
    result["root_cgroup"] = run.nvml.set(MOUNT, 0, GiB)
    result["parent_without_dmem"] = run.nvml.set(no_dmem, 0, GiB)
    result["soft_above_hard"] = run.nvml.set(unset, 2 * GiB, GiB)
    return result


def checked(name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 (a check that breaks is reported; the others run)
        result = {"error": repr(e)}
    result["seconds"] = round(time.monotonic() - started, 2)
    print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def run_checks(gpu_uuid: str | None) -> dict[str, Any]:
    report: dict[str, Any] = {"T0": checked("T0", lambda: environment(gpu_uuid))}
    if report["T0"].get("skip") or "error" in report["T0"]:
        report["skipped"] = report["T0"].get("skip") or report["T0"]["error"]
        return report
    run = Run(report["T0"]["gpu_uuid"])
    try:
        report["T1"] = checked("T1", lambda: t1_leaf_hard_limit(run))
        report["T2"] = checked("T2", lambda: t2_parent_only(run))
        report["T3"] = checked("T3", lambda: t3_lower_below_use(run))
        report["T4"] = checked("T4", lambda: t4_limit_after_context(run))
        report["T5"] = checked("T5", lambda: t5_propagation_and_leak(run, report["T0"]["store"]))
        report["T6"] = checked("T6", lambda: t6_error_codes(run))
    finally:
        report["cleanup_problems"] = run.close()
    return report


@contextlib.contextmanager
def written(path: Path | None) -> Iterator[dict[str, Any]]:
    report: dict[str, Any] = {}
    try:
        yield report
    finally:
        text = json.dumps(report, indent=2, default=str) + "\n"
        if path is None:
            sys.stdout.write(text)
        else:
            path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", type=Path, help="where to write the JSON report")
    parser.add_argument("--gpu", help="the GPU's UUID (default: NVML's first)")
    args = parser.parse_args()
    with written(args.report) as report:
        try:
            report.update(run_checks(args.gpu))
        except ImportError as e:
            report["skipped"] = f"no NVML binding: {e}"
        except Exception as e:
            if type(e).__name__.startswith("NVMLError"):
                report["skipped"] = f"NVML cannot start: {e}"
            else:
                raise


if __name__ == "__main__":
    main()
