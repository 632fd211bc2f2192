"""The fake GPU backend: GPUs from a JSON state file (docs/design.md §8), processes that are real.

Part of the product: `--backend fake:PATH`, the demo, CI and users' dry runs all run on it. The file
lists GPUs and the processes using them; the processes are real processes on this machine, so that
attribution reads their real environment and the enforcer's signals act on them.

Time-slicing model: a process's SM utilisation is its `sm_demand_percent`, scaled down in proportion
when the running processes' total demand on its GPU exceeds 100, and 0 while the process is stopped
(SIGSTOP) or gone. A sampler thread reads the processes' run state every `sample_interval_s` and
integrates the utilisation over time (it sleeps, with no timer, while no process with a demand is
listed, and never reads the run state of one without); `poll` reports the average since the
previous poll, as NVML's process utilisation samples do. That is what lets a SIGSTOP/SIGCONT duty
cycle of a few hundred milliseconds show in the readings. The sampler stands for the driver's own
sampling, so it keeps to a CPU budget: 5% of a core, 1% while it tracks more than
`_MANY_PROCESSES` processes (a full node), its rounds spaced further apart when one costs more.

The file is re-read whenever it changes (inode, size or mtime). A malformed or missing file is
logged once per distinct problem, and the last good state stays in force.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from deviceplugin.errors import BackendError, StateFileError
from deviceplugin.model import GpuInfo, GpuReading, NodeReading, ProcessSample

logger = logging.getLogger(__name__)

# The sampler spends at most this fraction of a core (CPU time, its own thread's): when a round
# over many processes costs more, the rounds are spaced further apart than sample_interval_s.
_SAMPLER_CPU_BUDGET = 0.05
# Above this many processes to sample (hundreds on a full node), the budget is lower: a round then
# costs milliseconds (procfs formats every stat line), and the rounds come a few hundred ms apart,
# every process still sampled about once per poll at the default 500 ms.
_MANY_PROCESSES = 64
_SAMPLER_CPU_BUDGET_MANY = 0.01
# Run states of /proc/<pid>/stat in which a process does not compute: stopped, traced, zombie, dead.
_NOT_RUNNING_STATES = frozenset("TtZXx")
# Enough for any /proc/<pid>/stat line (52 fields and a command name of at most 64 bytes).
_STAT_READ_BYTES = 4096
_MAX_PROBLEMS_SHOWN = 20
_MAX_VALUE_CHARS = 60
_CLOSE_JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class FakeProcess:
    """A real process on this machine that the fake GPU reports as using it."""

    pid: int
    used_memory_bytes: int
    sm_demand_percent: float = 0


@dataclass(frozen=True, slots=True)
class FakeMigDevice:
    """One MIG device (a GPU instance with one compute instance) of a fake GPU in MIG mode."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    memory_total_bytes: int
    processes: tuple[FakeProcess, ...] = ()


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One fake GPU. `health_reason` explains an unhealthy GPU (like an Xid would). A GPU in MIG
    mode with a `mig` block reports its MIG devices, and its own `processes` are ignored."""

    uuid: str
    index: int
    name: str
    memory_total_bytes: int
    minor: int
    numa_node: int | None = None
    healthy: bool = True
    processes: tuple[FakeProcess, ...] = ()
    pci_bus_id: str | None = None
    mig_enabled: bool = False
    health_reason: str = ""
    mig_devices: tuple[FakeMigDevice, ...] = ()
    # Whether the file had a `mig` block (written back as one).
    mig_block: bool = False

    def mig_info(self, device: FakeMigDevice) -> GpuInfo:
        """A MIG device as NVML reports it: its own UUID and memory, its parent's index."""
        return GpuInfo(
            uuid=device.uuid,
            index=self.index,
            name=f"{self.name} MIG {device.profile}",
            memory_total_bytes=device.memory_total_bytes,
            minor=self.minor,
            numa_node=self.numa_node,
            pci_bus_id=self.pci_bus_id,
            parent_uuid=self.uuid,
            mig_profile=device.profile,
            gpu_instance_id=device.gpu_instance_id,
            compute_instance_id=device.compute_instance_id,
        )

    @property
    def info(self) -> GpuInfo:
        return GpuInfo(
            uuid=self.uuid,
            index=self.index,
            name=self.name,
            memory_total_bytes=self.memory_total_bytes,
            minor=self.minor,
            numa_node=self.numa_node,
            pci_bus_id=self.pci_bus_id,
            mig_enabled=self.mig_enabled,
        )


@dataclass(frozen=True, slots=True)
class FakeState:
    """The content of a state file. GPUs keep the file's order."""

    gpus: tuple[FakeGpu, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The state as JSON data; `parse_state(state.to_json()) == state`. The optional keys beyond
        docs/design.md §8 (pci_bus_id, mig_enabled, health_reason) are written only when
        they are set."""
        gpus: list[dict[str, Any]] = []
        for gpu in self.gpus:
            entry: dict[str, Any] = {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "name": gpu.name,
                "memory_total_bytes": gpu.memory_total_bytes,
                "minor": gpu.minor,
                "numa_node": gpu.numa_node,
                "healthy": gpu.healthy,
                "processes": [
                    {
                        "pid": p.pid,
                        "used_memory_bytes": p.used_memory_bytes,
                        "sm_demand_percent": p.sm_demand_percent,
                    }
                    for p in gpu.processes
                ],
            }
            if gpu.pci_bus_id is not None:
                entry["pci_bus_id"] = gpu.pci_bus_id
            if gpu.mig_block:
                entry["mig"] = {
                    "enabled": gpu.mig_enabled,
                    "devices": [
                        {
                            "uuid": d.uuid,
                            "gpu_instance_id": d.gpu_instance_id,
                            "compute_instance_id": d.compute_instance_id,
                            "profile": d.profile,
                            "memory_total_bytes": d.memory_total_bytes,
                            "processes": [
                                {
                                    "pid": p.pid,
                                    "used_memory_bytes": p.used_memory_bytes,
                                    "sm_demand_percent": p.sm_demand_percent,
                                }
                                for p in d.processes
                            ],
                        }
                        for d in gpu.mig_devices
                    ],
                }
            elif gpu.mig_enabled:
                entry["mig_enabled"] = True
            if gpu.health_reason:
                entry["health_reason"] = gpu.health_reason
            gpus.append(entry)
        return {"gpus": gpus}


# ---------------------------------------------------------------------------------------------
# Parsing and validation (pure)

_TOP_KEYS = ("gpus",)
_GPU_KEYS = (
    "uuid",
    "index",
    "name",
    "memory_total_bytes",
    "minor",
    "numa_node",
    "healthy",
    "processes",
    "pci_bus_id",
    "mig_enabled",
    "health_reason",
    "mig",
)
_MIG_KEYS = ("enabled", "devices")
_MIG_DEVICE_KEYS = (
    "uuid",
    "gpu_instance_id",
    "compute_instance_id",
    "profile",
    "memory_total_bytes",
    "processes",
)
_MIG_DEVICE_REQUIRED = (
    "uuid",
    "gpu_instance_id",
    "compute_instance_id",
    "profile",
    "memory_total_bytes",
)
# Ranges of the numbers in a state file: what a real node could report, with room to spare.
# Beyond them a value is a mistake (and 2**63 overflows the kubelet API's integers).
MAX_STATE_BYTES = 16 << 20
MAX_INDEX = 1 << 16  # GPU indices and device minors
MAX_NUMA_NODE = 1023  # Linux supports at most 1024 NUMA nodes
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_PID = 1 << 22  # Linux's largest pid_max
_GPU_REQUIRED = ("uuid", "index", "name", "memory_total_bytes", "minor")
_PROCESS_KEYS = ("pid", "used_memory_bytes", "sm_demand_percent")
_PROCESS_REQUIRED = ("pid", "used_memory_bytes")


def _show(value: object) -> str:
    """A value as it appears in JSON, shortened for a message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def expected(self, path: str, what: str, value: object) -> None:
        self.items.append(f"{path}: expected {what}, got {_show(value)}")

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")

    def check_keys(
        self,
        obj: Mapping[Any, object],
        path: str,
        allowed: Sequence[str],
        required: Sequence[str],
    ) -> bool:
        """Report unknown and missing keys; True when none are."""
        ok = True
        for key in obj:
            if not isinstance(key, str):
                self.expected(path, "string keys", key)
                ok = False
            elif key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = (
                    f'did you mean "{close[0]}"?' if close else "known keys: " + ", ".join(allowed)
                )
                self.add(_join(path, key), f"unknown key ({hint})")
                ok = False
        for key in required:
            if key not in obj:
                self.add(_join(path, key), "required key is missing")
                ok = False
        return ok


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _in_range(path: str, values: Iterable[tuple[str, object, int]], problems: _Problems) -> bool:
    """Whether every integer among `values` (key, value, largest allowed) is in range; each one
    that is not is a problem."""
    ok = True
    for key, value, most in values:
        if _is_int(value) and value > most:
            problems.add(f"{path}.{key}", f"out of range: at most {most}, got {_show(value)}")
            ok = False
    return ok


def _parse_process(data: object, path: str, problems: _Problems) -> FakeProcess | None:
    if not isinstance(data, Mapping):
        problems.expected(path, "an object with pid, used_memory_bytes, sm_demand_percent", data)
        return None
    ok = problems.check_keys(data, path, _PROCESS_KEYS, _PROCESS_REQUIRED)
    pid = data.get("pid")
    if "pid" in data and not (_is_int(pid) and pid > 0):
        problems.expected(f"{path}.pid", "a positive integer", pid)
        ok = False
    memory = data.get("used_memory_bytes")
    if "used_memory_bytes" in data and not (_is_int(memory) and memory >= 0):
        problems.expected(f"{path}.used_memory_bytes", "a non-negative integer", memory)
        ok = False
    bounds = (("pid", pid, MAX_PID), ("used_memory_bytes", memory, MAX_MEMORY_BYTES))
    ok = _in_range(path, bounds, problems) and ok
    demand = data.get("sm_demand_percent", 0)
    if not (_is_number(demand) and 0 <= demand <= 100):
        problems.expected(f"{path}.sm_demand_percent", "a number from 0 to 100", demand)
        ok = False
    if not ok:
        return None
    assert isinstance(pid, int)
    assert isinstance(memory, int)
    assert isinstance(demand, int | float)
    return FakeProcess(pid=pid, used_memory_bytes=memory, sm_demand_percent=demand)


def _parse_processes(data: object, path: str, problems: _Problems) -> list[FakeProcess] | None:
    """A list of processes, each pid once; None when anything is wrong (reported)."""
    if not isinstance(data, list):
        problems.expected(path, "a list of processes", data)
        return None
    ok = True
    processes: list[FakeProcess] = []
    first_seen: dict[int, int] = {}
    for i, raw in enumerate(data):
        process = _parse_process(raw, f"{path}[{i}]", problems)
        if process is None:
            ok = False
            continue
        if process.pid in first_seen:
            problems.add(
                f"{path}[{i}].pid",
                f"duplicate of {path}[{first_seen[process.pid]}].pid, "
                f"got {process.pid}; list a process once per GPU",
            )
            ok = False
        else:
            first_seen[process.pid] = i
        processes.append(process)
    return processes if ok else None


def _parse_mig_device(
    data: object, path: str, parent_memory: object, problems: _Problems
) -> FakeMigDevice | None:
    if not isinstance(data, Mapping):
        problems.expected(path, "an object describing a MIG device", data)
        return None
    ok = problems.check_keys(data, path, _MIG_DEVICE_KEYS, _MIG_DEVICE_REQUIRED)
    uuid = data.get("uuid", "")
    if "uuid" in data and not (isinstance(uuid, str) and uuid.strip()):
        problems.expected(f"{path}.uuid", "a non-empty string", uuid)
        ok = False
    ids: list[int] = []
    for key in ("gpu_instance_id", "compute_instance_id"):
        value = data.get(key, 0)
        if not (_is_int(value) and value >= 0):
            problems.expected(f"{path}.{key}", "a non-negative integer", value)
            ok = False
            value = 0
        ids.append(int(value))
    profile = data.get("profile", "")
    if "profile" in data and not (isinstance(profile, str) and profile.strip()):
        problems.expected(f"{path}.profile", 'a profile name like "1g.10gb"', profile)
        ok = False
    memory = data.get("memory_total_bytes", parent_memory)
    if not (_is_int(memory) and memory >= 0):
        problems.expected(f"{path}.memory_total_bytes", "a non-negative integer", memory)
        ok = False
    elif _is_int(parent_memory) and memory > parent_memory:
        problems.add(
            f"{path}.memory_total_bytes",
            f"{memory} is more than the GPU's memory_total_bytes {parent_memory}",
        )
        ok = False
    processes = _parse_processes(data.get("processes", []), f"{path}.processes", problems)
    if not ok or processes is None:
        return None
    assert isinstance(uuid, str)
    assert isinstance(profile, str)
    assert isinstance(memory, int)
    return FakeMigDevice(uuid, ids[0], ids[1], profile, memory, tuple(processes))


def _parse_mig(
    data: object, path: str, parent_memory: object, problems: _Problems
) -> tuple[bool, tuple[FakeMigDevice, ...]] | None:
    """The `mig` block: whether MIG mode is on, and its devices."""
    if not isinstance(data, Mapping):
        problems.expected(path, 'an object like {"enabled": true, "devices": [...]}', data)
        return None
    ok = problems.check_keys(data, path, _MIG_KEYS, ("enabled",))
    enabled = data.get("enabled", False)
    if not isinstance(enabled, bool):
        problems.expected(f"{path}.enabled", "true or false", enabled)
        ok = False
    raw_devices = data.get("devices", [])
    devices: list[FakeMigDevice] = []
    if not isinstance(raw_devices, list):
        problems.expected(f"{path}.devices", "a list of MIG devices", raw_devices)
        return None
    seen_gi: dict[int, int] = {}
    for i, raw in enumerate(raw_devices):
        device = _parse_mig_device(raw, f"{path}.devices[{i}]", parent_memory, problems)
        if device is None:
            ok = False
            continue
        if device.gpu_instance_id in seen_gi:
            problems.add(
                f"{path}.devices[{i}].gpu_instance_id",
                f"duplicate of {path}.devices[{seen_gi[device.gpu_instance_id]}]"
                f".gpu_instance_id, got {device.gpu_instance_id}; each MIG device is its own"
                " GPU instance",
            )
            ok = False
        seen_gi[device.gpu_instance_id] = i
        devices.append(device)
    if devices and enabled is False:
        problems.add(f"{path}.devices", "lists MIG devices but enabled is false")
        ok = False
    if not ok:
        return None
    return bool(enabled), tuple(devices)


def _parse_gpu(data: object, path: str, problems: _Problems) -> FakeGpu | None:
    if not isinstance(data, Mapping):
        problems.expected(path, "an object describing a GPU", data)
        return None
    ok = problems.check_keys(data, path, _GPU_KEYS, _GPU_REQUIRED)

    def field(key: str, what: str, valid: Callable[[object], bool], default: object) -> object:
        nonlocal ok
        value = data.get(key, default)
        if key in data and not valid(value):
            problems.expected(f"{path}.{key}", what, value)
            ok = False
        return value

    def non_negative(v: object) -> bool:
        return _is_int(v) and v >= 0

    uuid = field("uuid", "a non-empty string", lambda v: isinstance(v, str) and v.strip() != "", "")
    index = field("index", "a non-negative integer", non_negative, 0)
    name = field("name", "a string", lambda v: isinstance(v, str), "")
    memory = field("memory_total_bytes", "a non-negative integer", non_negative, 0)
    minor = field("minor", "a non-negative integer", non_negative, 0)
    numa = field(
        "numa_node", "a non-negative integer or null", lambda v: v is None or non_negative(v), None
    )
    bounds = (
        ("index", index, MAX_INDEX),
        ("minor", minor, MAX_INDEX),
        ("memory_total_bytes", memory, MAX_MEMORY_BYTES),
        ("numa_node", numa, MAX_NUMA_NODE),
    )
    ok = _in_range(path, bounds, problems) and ok
    healthy = field("healthy", "true or false", lambda v: isinstance(v, bool), True)
    pci = field("pci_bus_id", "a string or null", lambda v: v is None or isinstance(v, str), None)
    mig = field("mig_enabled", "true or false", lambda v: isinstance(v, bool), False)
    reason = field("health_reason", "a string", lambda v: isinstance(v, str), "")
    mig_devices: tuple[FakeMigDevice, ...] = ()
    if "mig" in data:
        parsed_mig = _parse_mig(data["mig"], f"{path}.mig", memory, problems)
        if parsed_mig is None:
            ok = False
        elif "mig_enabled" in data and data["mig_enabled"] != parsed_mig[0]:
            problems.add(f"{path}.mig_enabled", "disagrees with mig.enabled; keep one of them")
            ok = False
        else:
            mig, mig_devices = parsed_mig

    processes: list[FakeProcess] = []
    raw_processes = data.get("processes", [])
    if not isinstance(raw_processes, list):
        problems.expected(f"{path}.processes", "a list of processes", raw_processes)
        ok = False
    else:
        first_seen: dict[int, int] = {}
        for i, raw in enumerate(raw_processes):
            process = _parse_process(raw, f"{path}.processes[{i}]", problems)
            if process is None:
                ok = False
                continue
            if process.pid in first_seen:
                problems.add(
                    f"{path}.processes[{i}].pid",
                    f"duplicate of {path}.processes[{first_seen[process.pid]}].pid, "
                    f"got {process.pid}; list a process once per GPU",
                )
                ok = False
            else:
                first_seen[process.pid] = i
            processes.append(process)

    if not ok:
        return None
    assert isinstance(uuid, str)
    assert isinstance(index, int)
    assert isinstance(name, str)
    assert isinstance(memory, int)
    assert isinstance(minor, int)
    assert numa is None or isinstance(numa, int)
    assert isinstance(healthy, bool)
    assert pci is None or isinstance(pci, str)
    assert isinstance(mig, bool)
    assert isinstance(reason, str)
    return FakeGpu(
        uuid=uuid,
        index=index,
        name=name,
        memory_total_bytes=memory,
        minor=minor,
        numa_node=numa,
        healthy=healthy,
        processes=tuple(processes),
        pci_bus_id=pci,
        mig_enabled=mig,
        health_reason=reason,
        mig_devices=mig_devices,
        mig_block="mig" in data,
    )


def _check_unique(
    gpus: Sequence[tuple[int, FakeGpu]],
    key: str,
    get: Callable[[FakeGpu], object],
    problems: _Problems,
) -> None:
    first_seen: dict[object, int] = {}
    for position, gpu in gpus:
        value = get(gpu)
        if value is None:
            continue
        if value in first_seen:
            problems.add(
                f"gpus[{position}].{key}",
                f"duplicate of gpus[{first_seen[value]}].{key}, got {_show(value)}; "
                f"every GPU needs its own {key}",
            )
        else:
            first_seen[value] = position


def parse_state(data: object) -> FakeState:
    """Validate parsed JSON data as a state file (docs/design.md §8). Raises StateFileError listing
    every problem, each naming its JSON path, the bad value and what is expected."""
    problems = _Problems()
    gpus: list[tuple[int, FakeGpu]] = []
    if not isinstance(data, Mapping):
        problems.expected("document", 'an object like {"gpus": [...]}', data)
    elif problems.check_keys(data, "", _TOP_KEYS, _TOP_KEYS):
        raw_gpus = data["gpus"]
        if not isinstance(raw_gpus, list):
            problems.expected("gpus", "a list of GPUs", raw_gpus)
        else:
            for i, raw in enumerate(raw_gpus):
                gpu = _parse_gpu(raw, f"gpus[{i}]", problems)
                if gpu is not None:
                    gpus.append((i, gpu))
    _check_unique(gpus, "uuid", lambda g: g.uuid, problems)
    _check_unique(gpus, "index", lambda g: g.index, problems)
    _check_unique(gpus, "minor", lambda g: g.minor, problems)
    _check_unique(gpus, "pci_bus_id", lambda g: g.pci_bus_id, problems)
    uuids: dict[str, str] = {g.uuid: f"gpus[{i}].uuid" for i, g in gpus}
    for i, gpu in gpus:
        for j, device in enumerate(gpu.mig_devices):
            where = f"gpus[{i}].mig.devices[{j}].uuid"
            if device.uuid in uuids:
                problems.add(
                    where,
                    f"duplicate of {uuids[device.uuid]}, got {_show(device.uuid)}; every GPU"
                    " and MIG device needs its own uuid",
                )
            else:
                uuids[device.uuid] = where
    if problems.items:
        shown = problems.items[:_MAX_PROBLEMS_SHOWN]
        more = len(problems.items) - len(shown)
        if more:
            shown.append(f"... and {more} more")
        raise StateFileError("; ".join(shown))
    return FakeState(gpus=tuple(gpu for _, gpu in gpus))


def _short_text(text: str) -> str:
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def _decode_state(content: bytes) -> FakeState:
    """Parse the bytes of a state file; StateFileError describes what is wrong (not where)."""
    if not content.strip():
        raise StateFileError('the file is empty; expected a JSON object like {"gpus": [...]}')
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StateFileError(f"the file is not UTF-8 text: {e.reason} at byte {e.start}") from e
    if len(content) > MAX_STATE_BYTES:
        raise StateFileError(f"the file is larger than {MAX_STATE_BYTES} bytes")
    try:
        data = json.loads(text)
        return parse_state(data)
    except json.JSONDecodeError as e:
        raise StateFileError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise StateFileError("not a state file: nested too deep") from e
    except ValueError as e:  # an integer of thousands of digits
        raise StateFileError(f"not valid JSON: {_short_text(str(e))}") from e


def read_state_file(path: Path) -> FakeState:
    """Read and validate a state file. Raises StateFileError naming the file and the problem."""
    try:
        content = path.read_bytes()
    except FileNotFoundError as e:
        raise StateFileError(f"state file {path} does not exist") from e
    except OSError as e:
        raise StateFileError(f"state file {path} cannot be read: {e.strerror or e}") from e
    try:
        return _decode_state(content)
    except StateFileError as e:
        raise StateFileError(f"state file {path}: {e}") from e


def write_state_file(
    path: Path, state: FakeState | Mapping[str, Any], *, validate: bool = True
) -> None:
    """Write a state file atomically (a temporary file in the same directory, then os.replace),
    so that a reader never sees half a file. A FakeState or mapping is validated first unless
    `validate` is False, which lets tests write a malformed state on purpose."""
    data = state.to_json() if isinstance(state, FakeState) else dict(state)
    if validate:
        parse_state(data)
    content = json.dumps(data, indent=2).encode() + b"\n"
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
            # mkstemp creates 0600; a state file is not secret, and readers may be other users.
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# Process run state


def proc_stat_state(stat: bytes | str) -> str:
    """The run state letter (R, S, D, T, t, Z, ...) from the content of /proc/<pid>/stat.

    The command name in parentheses may itself contain spaces and parentheses, so the state is
    the first field after the last ')'. Raises ValueError for content that is not a stat line."""
    raw = stat.encode("utf-8", "surrogateescape") if isinstance(stat, str) else stat
    _, paren, rest = raw.rpartition(b")")
    fields = rest.split()
    if not paren or not fields:
        raise ValueError(f"not the content of /proc/<pid>/stat: {raw[:80]!r}")
    return fields[0].decode("ascii", "replace")


def _instant_utilisation(
    plan: Sequence[tuple[str, Sequence[tuple[int, float]]]], running: Mapping[int, bool]
) -> dict[tuple[str, int], float]:
    """SM utilisation per (gpu uuid, pid) at one instant: demand, scaled down in proportion when
    the running processes on the GPU want more than 100 in total; stopped processes get nothing."""
    utils: dict[tuple[str, int], float] = {}
    for uuid, processes in plan:
        total = sum(demand for pid, demand in processes if running.get(pid, False))
        scale = 1.0 if total <= 100 else 100.0 / total
        for pid, demand in processes:
            if running.get(pid, False):
                utils[(uuid, pid)] = demand * scale
    return utils


_Signature = tuple[int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# The backend


class FakeBackend:
    """A GpuBackend serving the GPUs of a state file, with utilisation modelled from the real run
    state of the listed processes. Starts a daemon sampler thread; `close` stops it."""

    def __init__(
        self,
        path: Path,
        *,
        sample_interval_s: float = 0.02,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be positive, got {sample_interval_s}")
        self._path = Path(path)
        self._sample_interval_s = sample_interval_s
        self._proc_root = str(proc_root)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set when there are processes to sample again (or on close): an idle sampler waits on it.
        self._wake = threading.Event()
        self._closed = False
        self._sampler_error: BaseException | None = None

        try:
            st = os.stat(self._path)
        except FileNotFoundError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: state file {self._path} does not exist; "
                'create it with a JSON object like {"gpus": [{"uuid": "GPU-...", "index": 0, '
                '"name": "...", "memory_total_bytes": ..., "minor": 0}]} '
                "or point --backend fake:PATH at an existing file"
            ) from e
        except OSError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: state file {self._path} cannot be read: "
                f"{e.strerror or e}; check the path and its permissions"
            ) from e
        try:
            self._state = read_state_file(self._path)
        except StateFileError as e:
            raise StateFileError(
                f"cannot start the fake GPU backend: {e}; fix the file and start again"
            ) from e

        self._signature: _Signature | None = _signature(st)
        self._problem: str | None = None
        # Utilisation: the latest instantaneous value per (gpu uuid, pid), and its integral
        # (percent x seconds) since the window began at the previous poll.
        now = clock()
        self._window_start = now
        self._integrated_until = now
        self._current: dict[tuple[str, int], float] = {}
        self._integrated: dict[tuple[str, int], float] = {}
        # Health transitions, counted where polls see them (the file may flip and flip back
        # between two polls unseen, as a real GPU's health can between two reads).
        self._healthy_before: dict[str, bool] = {}
        self._unhealthy_transitions: dict[str, int] = {}
        self._generation = 0
        self._plan: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
        self._sampled_pids: frozenset[int] = frozenset()
        self._set_plan()

        # The first sampling round runs here, so that the first poll's window is fully measured
        # and a /proc that cannot be read stops the start rather than the first poll.
        try:
            self._sample_round()
        except Exception as e:
            raise BackendError(
                f"cannot start the fake GPU backend: reading the processes' run state under "
                f"{self._proc_root} failed: {e!r}"
            ) from e
        self._window_start = self._integrated_until

        self._thread = threading.Thread(
            target=self._run_sampler, name=f"fake-gpu-sampler:{self._path.name}", daemon=True
        )
        self._thread.start()
        logger.info(
            "fake GPU backend started path=%s gpus=%d sample_interval_s=%s",
            self._path,
            len(self._state.gpus),
            sample_interval_s,
        )

    @property
    def name(self) -> str:
        return f"fake:{self._path}"

    def poll(self) -> NodeReading:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self.name}: poll after close")
            if self._sampler_error is not None:
                error = self._sampler_error
                raise BackendError(
                    f"{self.name}: the process sampler failed ({error!r}); "
                    "utilisation can no longer be measured, see the traceback logged earlier"
                ) from error
            self._refresh()
            now = self._clock()
            self._advance(now)
            window_s = now - self._window_start
            if window_s > 0:
                average = {key: total / window_s for key, total in self._integrated.items()}
            else:
                average = dict(self._current)
            self._integrated = {}
            self._window_start = now
            state = self._state

        readings: list[GpuReading] = []
        for gpu in sorted(state.gpus, key=lambda g: g.index):
            if not gpu.healthy and self._healthy_before.get(gpu.uuid, True):
                self._unhealthy_transitions[gpu.uuid] = (
                    self._unhealthy_transitions.get(gpu.uuid, 0) + 1
                )
            self._healthy_before[gpu.uuid] = gpu.healthy
            if gpu.mig_enabled and gpu.mig_block:
                readings.extend(self._mig_readings(gpu))
                continue
            # One plain loop over the processes: hundreds of them on a full node, every poll.
            samples: list[ProcessSample] = []
            memory_used_bytes = 0
            sm_util_percent = 0.0
            for p in gpu.processes:
                util = average.get((gpu.uuid, p.pid), 0.0)
                samples.append(ProcessSample(p.pid, p.used_memory_bytes, util))
                memory_used_bytes += p.used_memory_bytes
                sm_util_percent += util
            readings.append(
                GpuReading(
                    info=gpu.info,
                    healthy=gpu.healthy,
                    health_reason=gpu.health_reason,
                    memory_used_bytes=memory_used_bytes,
                    sm_util_percent=min(100.0, sm_util_percent),
                    processes=tuple(samples),
                    unhealthy_transitions=self._unhealthy_transitions.get(gpu.uuid, 0),
                )
            )
        return NodeReading(timestamp_s=now, gpus=tuple(readings))

    def _mig_readings(self, gpu: FakeGpu) -> list[GpuReading]:
        """A GPU in MIG mode, as NVML reports it: the GPU with the memory its MIG devices use,
        and no utilisation, then each MIG device with its own memory and processes and no
        utilisation either (NVML samples none per MIG device)."""
        transitions = self._unhealthy_transitions.get(gpu.uuid, 0)
        readings = [
            GpuReading(
                info=gpu.info,
                healthy=gpu.healthy,
                health_reason=gpu.health_reason,
                memory_used_bytes=sum(
                    p.used_memory_bytes for d in gpu.mig_devices for p in d.processes
                ),
                sm_util_percent=None,
                unhealthy_transitions=transitions,
            )
        ]
        for device in sorted(gpu.mig_devices, key=lambda d: d.uuid):
            readings.append(
                GpuReading(
                    info=gpu.mig_info(device),
                    healthy=gpu.healthy,
                    health_reason=gpu.health_reason,
                    memory_used_bytes=sum(p.used_memory_bytes for p in device.processes),
                    sm_util_percent=None,
                    processes=tuple(
                        ProcessSample(p.pid, p.used_memory_bytes, None) for p in device.processes
                    ),
                )
            )
        return readings

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=_CLOSE_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning(
                "fake GPU sampler did not stop path=%s timeout_s=%s",
                self._path,
                _CLOSE_JOIN_TIMEOUT_S,
            )
        else:
            logger.info("fake GPU backend closed path=%s", self._path)

    def __enter__(self) -> FakeBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- state file (callers hold the lock) ------------------------------------------------

    def _refresh(self) -> None:
        """Re-read the state file if it changed; keep the last good state if it is bad."""
        try:
            st = os.stat(self._path)
            if _signature(st) == self._signature:
                return
            with open(self._path, "rb") as f:
                signature = _signature(os.fstat(f.fileno()))
                content = f.read()
        except FileNotFoundError:
            self._signature = None
            self._reject("the file does not exist")
            return
        except OSError as e:
            self._signature = None
            self._reject(f"the file cannot be read: {e.strerror or e}")
            return
        self._signature = signature
        try:
            state = _decode_state(content)
        except StateFileError as e:
            self._reject(str(e))
            return
        recovered = self._problem is not None
        self._problem = None
        if recovered:
            logger.info("state file accepted again path=%s gpus=%d", self._path, len(state.gpus))
        elif state != self._state:
            logger.info("state file reloaded path=%s gpus=%d", self._path, len(state.gpus))
        if state != self._state:
            self._advance(self._clock())
            self._state = state
            self._set_plan()

    def _reject(self, problem: str) -> None:
        if problem != self._problem:
            logger.error(
                "state file rejected path=%s error=%s; keeping the last good state",
                self._path,
                problem,
            )
        self._problem = problem

    def _set_plan(self) -> None:
        self._plan = tuple(
            (
                gpu.uuid,
                # A GPU in MIG mode reports no utilisation: nothing of it to sample.
                ()
                if gpu.mig_block and gpu.mig_enabled
                else tuple((p.pid, float(p.sm_demand_percent)) for p in gpu.processes),
            )
            for gpu in self._state.gpus
        )
        self._sampled_pids = frozenset(
            pid for _, processes in self._plan for pid, demand in processes if demand > 0
        )
        self._generation += 1
        if self._sampled_pids:
            self._wake.set()
        # Processes that left the file stop accruing; new ones start at the next sampling round.
        keys = {(uuid, pid) for uuid, processes in self._plan for pid, _ in processes}
        self._current = {k: v for k, v in self._current.items() if k in keys}

    # -- utilisation ------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Credit the current instantaneous utilisation up to `now` (caller holds the lock)."""
        elapsed = now - self._integrated_until
        if elapsed <= 0:
            return
        for key, util in self._current.items():
            self._integrated[key] = self._integrated.get(key, 0.0) + util * elapsed
        self._integrated_until = now

    def _is_running(self, pid: int) -> bool:
        # os.open/os.read rather than open(): half the CPU time for a file of one short line,
        # read for every sampled process many times a second.
        try:
            fd = os.open(f"{self._proc_root}/{pid}/stat", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):
            return False
        try:
            content = os.read(fd, _STAT_READ_BYTES)
        except ProcessLookupError:
            return False  # exited between the open and the read
        finally:
            os.close(fd)
        return proc_stat_state(content) not in _NOT_RUNNING_STATES

    def _sample_round(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._refresh()
            generation = self._generation
            plan = self._plan
            pids = self._sampled_pids
        running = {pid: self._is_running(pid) for pid in pids}
        now = self._clock()
        utils = _instant_utilisation(plan, running)
        with self._lock:
            if generation != self._generation:
                return  # the state changed meanwhile; the next round samples the new one
            self._advance(now)
            self._current = utils

    def _run_sampler(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    idle = not self._sampled_pids
                if idle:
                    # Nothing to sample: no timer until a poll finds processes in the file.
                    self._wake.wait()
                    self._wake.clear()
                    continue
                started_cpu_s = time.thread_time()
                started_s = time.perf_counter()
                self._sample_round()
                cost_s = time.thread_time() - started_cpu_s
                took_s = time.perf_counter() - started_s
                with self._lock:
                    many = len(self._sampled_pids) > _MANY_PROCESSES
                budget = _SAMPLER_CPU_BUDGET_MANY if many else _SAMPLER_CPU_BUDGET
                period_s = max(self._sample_interval_s, cost_s / budget)
                self._stop.wait(max(0.0, period_s - took_s))
        except Exception as e:
            logger.exception("fake GPU sampler failed path=%s; polls will fail", self._path)
            with self._lock:
                self._sampler_error = e
