"""Parsing and validation of a state file's JSON data (pure): every key, type and range is
checked, the `mig` block included, and every problem is reported at once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from deviceplugin.errors import StateFileError
from deviceplugin.gpu.fake.checks import (
    _MAX_PROBLEMS_SHOWN,
    MAX_INDEX,
    MAX_MEMORY_BYTES,
    MAX_NUMA_NODE,
    MAX_PID,
    _in_range,
    _is_int,
    _is_number,
    _Problems,
    _show,
)
from deviceplugin.gpu.fake.partitionrules import STORES
from deviceplugin.gpu.fake.state import FakeGpu, FakeMigDevice, FakeProcess, FakeState
from deviceplugin.partitions import driver_major

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
    "driver_version",
    "memory_partitions",
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
_GPU_REQUIRED = ("uuid", "index", "name", "memory_total_bytes", "minor")
_PROCESS_KEYS = ("pid", "used_memory_bytes", "sm_demand_percent")
_PROCESS_REQUIRED = ("pid", "used_memory_bytes")


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
    driver = field(
        "driver_version",
        'a driver version like "615.71"',
        lambda v: isinstance(v, str) and driver_major(v) is not None,
        None,
    )
    partitions = field(
        "memory_partitions",
        '"dmem", "misc" or null',
        lambda v: v is None or v in STORES,
        None,
    )
    if partitions is not None and driver is None:
        problems.add(
            f"{path}.memory_partitions",
            'needs the GPU\'s driver_version (memory partitions came with "615"; an older one'
            " models a driver without them)",
        )
        ok = False
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

    processes = _parse_processes(data.get("processes", []), f"{path}.processes", problems)
    if processes is None:
        ok = False

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
    assert driver is None or isinstance(driver, str)
    assert partitions is None or isinstance(partitions, str)
    return FakeGpu(
        uuid=uuid,
        index=index,
        name=name,
        memory_total_bytes=memory,
        minor=minor,
        numa_node=numa,
        healthy=healthy,
        processes=tuple(processes or ()),
        pci_bus_id=pci,
        mig_enabled=mig,
        health_reason=reason,
        mig_devices=mig_devices,
        mig_block="mig" in data,
        driver_version=driver,
        memory_partitions=partitions,
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
