"""The stopped-process record: whatever state the daemon finds it in at start (a bad entry, a
truncated file, JSON nested too deep, another boot's, a wall clock that stepped since it was
written), nothing this daemon stopped stays stopped, nothing crashes, and no record is lost."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from deviceplugin.config import EnforcementConfig
from deviceplugin.enforcer import (
    STOPPED_RECORD_NAME,
    Enforcer,
    PsutilControl,
    load_stopped_record,
    write_stopped_record,
)
from deviceplugin.enforcer.actuator import boot_id, run_state, start_ticks
from deviceplugin.gpu.fake import FakeProcess
from tests.blackbox.daemon_harness import (
    TWO_GPUS,
    GiB,
    Node,
    eventually,
    registered,
    running_daemon,
    with_processes,
)

Spawn = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[bytes]] = []

    def start(envs: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(envs or {})}
        child = subprocess.Popen(["sleep", "120"], env=env)
        children.append(child)
        return child

    yield start
    for child in children:
        try:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
        finally:
            child.wait(timeout=10)


def stopped(child: subprocess.Popen[bytes]) -> int:
    child.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while run_state(child.pid) != "T":
        assert time.monotonic() < deadline, "the child did not stop"
        time.sleep(0.005)
    return child.pid


def resumed_soon(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run_state(pid) != "T":
            return True
        time.sleep(0.01)
    return False


def ticks_of(pid: int) -> int:
    ticks = start_ticks(pid)
    assert ticks is not None
    return ticks


def test_one_bad_entry_does_not_stop_the_others_from_being_resumed(
    spawn: Spawn, tmp_path: Path
) -> None:
    pid = stopped(spawn())
    record = {
        "version": 2,
        "boot_id": boot_id(),
        "processes": [
            {"pid": -1},
            {"pid": pid, "start_ticks": ticks_of(pid)},
            "junk",
            {"pid": 2**70, "start_ticks": 5},
        ],
    }
    (tmp_path / STOPPED_RECORD_NAME).write_text(json.dumps(record))
    with Enforcer(EnforcementConfig(), tmp_path) as enforcer:
        assert enforcer.recover() == 1
    assert resumed_soon(pid)


@pytest.mark.parametrize(
    "content",
    [
        b'{"version": 2, "boot_id": "x", "processes": [{"pid": 12',  # truncated
        b"[" * 100_000 + b"]" * 100_000,  # nested too deep for the parser
        b'{"processes": [{"pid": 1' + b"0" * 5000 + b"}]}",  # a 5000-digit integer
        b"\xff\xfe not text",
    ],
    ids=["truncated", "deeply-nested", "huge-integer", "binary"],
)
def test_an_unreadable_record_is_moved_aside_never_overwritten(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / STOPPED_RECORD_NAME
    path.write_bytes(content)
    with Enforcer(EnforcementConfig(), tmp_path) as enforcer:
        assert enforcer.recover() == 0  # no crash, no RecursionError
    aside = list(tmp_path.glob(f"{STOPPED_RECORD_NAME}.unreadable-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes() == content
    assert load_stopped_record(path).unreadable is None  # the live record is a fresh one


def test_a_fifo_at_the_record_is_moved_aside_never_read(tmp_path: Path) -> None:
    """A FIFO planted at the record's name is refused without being opened for a read that
    would wait for a writer for ever; it is moved aside like any unreadable record."""
    path = tmp_path / STOPPED_RECORD_NAME
    os.mkfifo(path, 0o600)
    recovered: list[int] = []

    def recover() -> None:
        with Enforcer(EnforcementConfig(), tmp_path) as enforcer:
            recovered.append(enforcer.recover())

    thread = threading.Thread(target=recover, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # blocked opening the FIFO: a writer that closes at once frees it
        os.close(os.open(tmp_path / STOPPED_RECORD_NAME, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
        pytest.fail("the daemon's start waited on a FIFO at the stopped-process record")
    assert recovered == [0]
    (aside,) = tmp_path.glob(f"{STOPPED_RECORD_NAME}.unreadable-*")
    assert stat.S_ISFIFO(os.lstat(aside).st_mode)


async def test_after_an_unreadable_record_stopped_gpu_processes_of_allocations_resume(
    node: Node, spawn: Spawn
) -> None:
    """The record is truncated: what it named is unknown, so the daemon resumes every stopped
    GPU process of its allocations at its first poll, and leaves a stopped host process alone."""
    state_dir = node.root / "state"
    state_dir.mkdir()
    (state_dir / STOPPED_RECORD_NAME).write_bytes(b'{"version": 2, "processes": [{"pid"')
    async with running_daemon(node) as daemon:
        await registered(node, 8)
        grant = (await node.sim.admit_pod("p", [("c", 1)])).containers[0]
        ours = stopped(spawn(grant.envs))
        host = stopped(spawn())  # not ours: never signalled
        gpu = next(g for g in TWO_GPUS if g.uuid in grant.envs["NVIDIA_VISIBLE_DEVICES"])
        node.write_gpus(
            [
                with_processes(g, FakeProcess(ours, GiB, 0), FakeProcess(host, GiB, 0))
                if g is gpu
                else g
                for g in TWO_GPUS
            ]
        )
        await eventually(lambda: run_state(ours) != "T", 10, "the stopped GPU process resumed")
        assert daemon.poller.snapshot is not None
    assert run_state(host) == "T"
    assert len(list(state_dir.glob(f"{STOPPED_RECORD_NAME}.unreadable-*"))) == 1


def test_a_wall_clock_step_does_not_leave_a_recorded_process_stopped(
    spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = stopped(spawn())
    control = PsutilControl()
    try:
        control.watch([pid])
        identity = control.create_time(pid)
    finally:
        control.close()
    assert identity is not None
    write_stopped_record(tmp_path / STOPPED_RECORD_NAME, [(pid, identity)])
    # The clock steps an hour forward between the daemon's death and its restart: every
    # wall-clock derived creation time moves with it.
    stepped = psutil.boot_time() + 3600.0
    monkeypatch.setattr(psutil, "boot_time", lambda: stepped)
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
    with Enforcer(EnforcementConfig(), tmp_path) as enforcer:
        assert enforcer.recover() == 1
    assert resumed_soon(pid)


def test_a_record_of_another_boot_resumes_nothing(spawn: Spawn, tmp_path: Path) -> None:
    """Its processes died with that boot: a PID with the same start ticks now is another."""
    pid = stopped(spawn())
    write_stopped_record(
        tmp_path / STOPPED_RECORD_NAME, [(pid, ticks_of(pid))], boot="another-boot"
    )
    with Enforcer(EnforcementConfig(), tmp_path) as enforcer:
        assert enforcer.recover() == 0
    assert run_state(pid) == "T"


def test_the_record_names_start_ticks_and_the_boot(spawn: Spawn, tmp_path: Path) -> None:
    pid = spawn().pid
    write_stopped_record(tmp_path / STOPPED_RECORD_NAME, [(pid, ticks_of(pid))])
    data = json.loads((tmp_path / STOPPED_RECORD_NAME).read_text())
    assert data["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert data["processes"] == [{"pid": pid, "start_ticks": ticks_of(pid)}]
