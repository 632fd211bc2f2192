"""The runtime hook end to end (docs/design.md §15): the real static binary, built from
deviceplugin/hook/vgpu-hook.c, fed an OCI state, talking to the daemon's socket, which sets the
limits on the fake GPUs and records them, before the hook returns and so before the container's
first instruction. Every way it can go wrong fails the container with the reason on stderr."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import pytest

from deviceplugin.errors import MemoryLimitError
from deviceplugin.gpu.backend import PartitionBackend
from deviceplugin.memlimits.hookserver import HookServer
from deviceplugin.partitions import (
    NVML_ERROR_NO_PERMISSION,
    GpuLimit,
    MemoryLimits,
    PartitionSupport,
)
from deviceplugin.usage.cgroups import CgroupLayout
from tests.security.cgroup_support import subtree
from tests.support.cgroup_tree import POD_UID, GiB, Hierarchy, container_id, leaf_of
from tests.support.memlimits import Grant, LimitRig, compile_hook, oci_state

PID = 4242
LEAF = leaf_of("app")


@pytest.fixture(scope="session")
def hook_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built once for the session: the parallel workers' base directories share a parent.
    shared = tmp_path_factory.getbasetemp().parent / "vgpu-hook"
    shared.mkdir(exist_ok=True)
    with (shared / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        binary = shared / "vgpu-hook"
        return binary if binary.exists() else compile_hook(shared)


@pytest.fixture
def cgroups(short_tmp: Path) -> Hierarchy:
    tree = Hierarchy(short_tmp / "h")
    tree.container(PID, LEAF)
    return tree


@pytest.fixture
async def rig(short_tmp: Path, hook_binary: Path, cgroups: Hierarchy) -> AsyncIterator[LimitRig]:
    r = LimitRig(short_tmp, hook_binary, cgroup_mount=cgroups.root, proc_root=cgroups.proc)
    r.source.grants["alloc-1"] = Grant(
        POD_UID,
        {
            "GPU-dmem": GpuLimit(GiB, 8 * GiB),
            "GPU-misc": GpuLimit(0, 4 * GiB),
            "GPU-poll": GpuLimit(0, 2 * GiB),
        },
    )
    await r.server.start()
    try:
        yield r
    finally:
        await r.close()


async def test_the_hook_returns_once_the_limits_are_set_and_recorded(rig: LimitRig) -> None:
    run = await rig.run_hook(PID, "alloc-1")
    assert (run.returncode, run.stderr) == (0, "")
    dmem = rig.limit_on("GPU-dmem", LEAF)
    assert dmem is not None
    assert (dmem["soft_bytes"], dmem["hard_bytes"]) == (GiB, 8 * GiB)
    misc = rig.limit_on("GPU-misc", LEAF)
    assert misc is not None
    assert (misc["soft_bytes"], misc["hard_bytes"]) == (0, 4 * GiB)
    assert "GPU-poll" not in rig.limits()["gpus"]  # polled: nothing to set
    record = json.loads((rig.base / "state" / "memory-limits.json").read_text())
    (leaf,) = record["leaves"]
    assert (leaf["cgroup"], leaf["pod_uid"], leaf["container_id"]) == (
        LEAF,
        POD_UID,
        container_id("app"),
    )
    assert leaf["applied"]["GPU-dmem"]["set_at_s"] >= dmem["set_at_s"]
    assert leaf["applied"]["GPU-dmem"]["mode"] == "driver-dmem"
    assert set(leaf["applied"]) == {"GPU-dmem", "GPU-misc"}
    assert rig.book.counts["set"] == 2
    # The source was asked about this container's pod, found from /proc alone.
    assert rig.source.asked == [("alloc-1", POD_UID)]


async def test_two_devices_of_one_container_get_the_sum_on_their_gpu(rig: LimitRig) -> None:
    rig.source.grants["alloc-2"] = Grant(POD_UID, {"GPU-dmem": GpuLimit(GiB, 2 * GiB)})
    assert (await rig.run_hook(PID, "alloc-1")).returncode == 0
    assert (await rig.run_hook(PID, "alloc-2")).returncode == 0
    dmem = rig.limit_on("GPU-dmem", LEAF)
    assert dmem is not None
    assert (dmem["soft_bytes"], dmem["hard_bytes"]) == (2 * GiB, 10 * GiB)
    # A hook run again for the same grant (a retried create) changes nothing.
    assert (await rig.run_hook(PID, "alloc-2")).returncode == 0
    dmem = rig.limit_on("GPU-dmem", LEAF)
    assert dmem is not None
    assert dmem["hard_bytes"] == 10 * GiB


@pytest.mark.parametrize(
    ("grant", "reason"),
    [
        ("alloc-9", "grant alloc-9: no allocation or claim has this ID on this node"),
        ("alloc-other", "grant alloc-other: it is held by pod other-pod"),
    ],
)
async def test_a_grant_the_container_does_not_hold_fails_it(
    rig: LimitRig, grant: str, reason: str
) -> None:
    rig.source.grants["alloc-other"] = Grant("other-pod", {"GPU-dmem": GpuLimit(0, GiB)})
    run = await rig.run_hook(PID, grant)
    assert run.returncode == 1
    assert f"the vgpu daemon refused the container's GPU memory limit: {reason}" in run.stderr
    assert rig.limits() == {}
    assert rig.book.counts["refused"] == 1


async def test_a_process_outside_the_kubelets_containers_is_refused(
    rig: LimitRig, cgroups: Hierarchy
) -> None:
    cgroups.mkdir("/system.slice/sshd.service", procs=[99])
    cgroups.process(99, "0::/system.slice/sshd.service\n")
    run = await rig.run_hook(99, "alloc-1")
    assert run.returncode == 1
    assert "is not a container's cgroup in the kubelet's layout" in run.stderr
    run = await rig.run_hook(12345, "alloc-1")  # no such process
    assert run.returncode == 1
    assert "process 12345 cannot be read" in run.stderr
    assert rig.limits() == {}


async def test_a_symlinked_cgroup_or_one_the_process_is_not_in_is_refused(
    rig: LimitRig, cgroups: Hierarchy
) -> None:
    elsewhere = leaf_of("elsewhere")
    cgroups.mkdir(elsewhere, procs=[7])
    linked = leaf_of("linked")
    cgroups.mkdir(linked.rsplit("/", 1)[0])
    cgroups.path(linked).symlink_to(cgroups.path(elsewhere))
    cgroups.process(7, f"0::{linked}\n")
    run = await rig.run_hook(7, "alloc-1")
    assert run.returncode == 1
    assert "cannot be opened" in run.stderr
    assert "symbolic link" in run.stderr
    cgroups.process(8, f"0::{elsewhere}\n")  # claims a cgroup that does not list it
    run = await rig.run_hook(8, "alloc-1")
    assert run.returncode == 1
    assert f"process 8 is not in {elsewhere}" in run.stderr
    assert rig.limits() == {}


class RefusingBackend:
    """The fake backend, whose driver refuses every set as a process that is not root."""

    def __init__(self, inner: PartitionBackend) -> None:
        self.inner = inner

    def memory_partitioning(self) -> Mapping[str, PartitionSupport]:
        return self.inner.memory_partitioning()

    def set_memory_limits(self, gpu_uuid: str, cgroup: str, soft: int, hard: int) -> None:
        raise MemoryLimitError(
            f"GPU {gpu_uuid}, cgroup {cgroup}: NVML_ERROR_NO_PERMISSION (setting a limit needs "
            "root)",
            NVML_ERROR_NO_PERMISSION,
            "NVML_ERROR_NO_PERMISSION",
        )

    def get_memory_limits(self, gpu_uuid: str, cgroup: str) -> MemoryLimits | None:
        return self.inner.get_memory_limits(gpu_uuid, cgroup)

    def clear_memory_limits(self, gpu_uuid: str, cgroup: str) -> bool:
        return self.inner.clear_memory_limits(gpu_uuid, cgroup)


async def test_a_limit_the_driver_refuses_fails_the_container_with_the_code(
    rig: LimitRig,
) -> None:
    rig.book.backend = RefusingBackend(rig.backend)
    run = await rig.run_hook(PID, "alloc-1")
    assert run.returncode == 1
    assert "NVML_ERROR_NO_PERMISSION" in run.stderr
    assert rig.book.counts["failed"] == 1
    leaf = rig.record.get(LEAF)
    assert leaf is not None
    assert leaf.applied == ()  # nothing the driver holds


async def test_an_unreachable_daemon_fails_the_container(rig: LimitRig) -> None:
    await rig.server.close()
    run = await rig.run_hook(PID, "alloc-1")
    assert run.returncode == 1
    assert f"cannot reach the vgpu daemon at {rig.socket}" in run.stderr
    assert "is the vgpu daemon running on this node?" in run.stderr


async def test_a_daemon_that_does_not_answer_fails_the_container_in_time(
    rig: LimitRig, short_tmp: Path
) -> None:
    silent_path = short_tmp / "silent.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(silent_path))
    silent.listen(1)
    try:
        rig.socket = silent_path
        run = await rig.run_hook(PID, "alloc-1", timeout_ms=300)
    finally:
        silent.close()
    assert run.returncode == 1
    assert "timed out while waiting for the vgpu daemon's answer" in run.stderr


async def test_the_socket_answers_root_only(rig: LimitRig, short_tmp: Path) -> None:
    strict = HookServer(short_tmp / "strict" / "hook.sock", rig.applier, allowed_uids={12345})
    await strict.start()
    try:
        assert (short_tmp / "strict").stat().st_mode & 0o777 == 0o700
        assert (short_tmp / "strict" / "hook.sock").stat().st_mode & 0o777 == 0o600
        rig.socket = strict.path
        run = await rig.run_hook(PID, "alloc-1")
    finally:
        await strict.close()
    assert run.returncode == 1
    assert f"answers root only, not uid {os.geteuid()}" in run.stderr
    assert rig.limits() == {}


async def test_a_refused_peer_is_answered_after_its_request_not_before(
    rig: LimitRig, short_tmp: Path
) -> None:
    """An answer sent and the socket closed before the peer wrote its request would break the
    peer's pipe: it would report a broken pipe, not the reason."""
    strict = HookServer(short_tmp / "strict" / "hook.sock", rig.applier, allowed_uids={12345})
    await strict.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(strict.path))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readline(), timeout=0.3)
        writer.write(b"VGPU-HOOK 1 apply 4242 alloc-1\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), timeout=5)
        writer.close()
    finally:
        await strict.close()
    assert answer.startswith(b"ERR the hook socket answers root only")


@pytest.mark.parametrize(
    "state",
    [b"", b"not json", b'{"pid": 0}', b'{"pid": "4242"}', b'{"pid": 1, "pid": 2}', b"[4242]"],
)
async def test_a_state_without_one_valid_pid_is_a_usage_error(rig: LimitRig, state: bytes) -> None:
    run = await rig.run_hook(PID, "alloc-1", state=state)
    assert run.returncode == 2
    assert 'no valid top-level "pid"' in run.stderr


async def test_a_state_past_1_mib_is_refused_unread(rig: LimitRig) -> None:
    huge = b'{"pid": 4242, "annotations": {"x": "' + b"a" * (1 << 20) + b'"}}'
    run = await rig.run_hook(PID, "alloc-1", state=huge)
    assert run.returncode == 2
    assert "cannot read the container's state on stdin: File too large" in run.stderr
    assert rig.limits() == {}


def test_the_hook_needs_nothing_on_the_host(hook_binary: Path) -> None:
    """Static: no program interpreter (PT_INTERP), so no shared library is loaded."""
    elf = hook_binary.read_bytes()
    assert elf[:4] == b"\x7fELF"
    assert elf[4] == 2  # 64-bit
    phoff = int.from_bytes(elf[0x20:0x28], "little")
    entry_size = int.from_bytes(elf[0x36:0x38], "little")
    entries = int.from_bytes(elf[0x38:0x3A], "little")
    types = [
        int.from_bytes(elf[phoff + n * entry_size : phoff + n * entry_size + 4], "little")
        for n in range(entries)
    ]
    pt_interp, pt_dynamic = 3, 2
    assert pt_interp not in types
    assert pt_dynamic not in types


async def test_the_pid_is_read_from_the_top_level_only(rig: LimitRig) -> None:
    nested = oci_state(PID, annotations={"pid": "1"}, extra={"pid": 1, "list": [{"pid": 1}]})
    run = await rig.run_hook(PID, "alloc-1", state=nested)
    assert run.returncode == 0, run.stderr


# -- on real cgroups -----------------------------------------------------------------------------


@contextlib.contextmanager
def gated_container(mount: Path, cgroup: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process that moves itself into `cgroup` and waits, as a created container's init does,
    until a line on its stdin lets it exec its workload, which prints when it started."""
    workload = f"{sys.executable} -c 'import time; print(repr(time.time()))'"
    proc = subprocess.Popen(
        ["sh", "-c", f'echo $$ > "{mount}{cgroup}/cgroup.procs" && read go && exec {workload}'],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


async def test_on_real_cgroups_the_limit_lands_before_the_first_instruction(
    short_tmp: Path, hook_binary: Path
) -> None:
    with subtree(2) as tree:
        pod_uid = str(uuid.uuid4())
        leaf = f"{tree.name}/kubepods/burstable/pod{pod_uid}/{container_id(short_tmp.name)}"
        tree.dir(leaf)
        rig = LimitRig(
            short_tmp,
            hook_binary,
            cgroup_mount=tree.hierarchy,
            proc_root=Path("/proc"),
            layout=CgroupLayout("cgroupfs", tree.name),
        )
        rig.source.grants["alloc-1"] = Grant(pod_uid, {"GPU-dmem": GpuLimit(0, 8 * GiB)})
        await rig.server.start()
        reconciler = asyncio.create_task(rig.reconciler.run())
        try:
            with gated_container(tree.hierarchy, leaf) as proc:
                cgroup_file = Path(f"/proc/{proc.pid}/cgroup")
                for _ in range(500):
                    if leaf in await asyncio.to_thread(cgroup_file.read_text):
                        break
                    await asyncio.sleep(0.01)
                run = await rig.run_hook(proc.pid, "alloc-1")
                assert (run.returncode, run.stderr) == (0, "")
                limit = rig.limit_on("GPU-dmem", leaf)  # before the container may go on
                assert limit is not None
                out, _ = await asyncio.to_thread(proc.communicate, b"go\n", 30)
                started = float(out.decode().strip())
            assert limit["set_at_s"] < started
            assert limit["hard_bytes"] == 8 * GiB
            # The container exited: its cgroup is empty, and the reconciler clears the limit
            # while the cgroup is still there (its directory goes with the subtree, later).
            for _ in range(500):
                if rig.limit_on("GPU-dmem", leaf) is None and rig.record.get(leaf) is None:
                    break
                await asyncio.sleep(0.01)
            assert rig.limit_on("GPU-dmem", leaf) is None
            assert rig.record.get(leaf) is None
            actions = [e["action"] for e in rig.limits()["events"] if e["cgroup"] == leaf]
            assert actions == ["set", "clear"]
            assert await asyncio.to_thread(Path(f"{tree.hierarchy}{leaf}").is_dir)
        finally:
            reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reconciler
            await rig.close()
