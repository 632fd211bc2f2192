"""deviceplugin.usage.procs against real processes and against fake /proc trees.

Every process here is spawned by the test in its own session; the `spawn` fixture kills each one's
process group and reaps it whatever the outcome.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from deviceplugin.kubelet.checkpoint import CHECKPOINT_FILE, CheckpointReader
from deviceplugin.usage.procs import (
    ENV_NAME,
    AllocationResolver,
    pid_namespace_warning,
    pod_uid_in_cgroup,
)
from tests.blackbox.daemon_harness import RESOURCE, Node, registered, running_daemon

ALLOC = "abcdef0123456789"
OTHER = "0123456789abcdef"
PATH_ONLY = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

Spawn = Callable[[Sequence[str], Mapping[str, str]], "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[bytes]] = []

    def start(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            list(argv), env=dict(env), stdout=subprocess.PIPE, start_new_session=True
        )
        children.append(child)
        if env:
            # Popen returns once exec has begun; the kernel shows the new program's environment
            # only a moment later, once the program is mapped.
            wait_for(lambda: Path(f"/proc/{child.pid}/environ").read_bytes() != b"")
        return child

    yield start
    for child in children:
        if child.poll() is None:  # not reaped: its group ID is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the child and what it started
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


def own_environ_has_variable() -> bool:
    return (b"\0" + ENV_NAME.encode() + b"=") in b"\0" + Path("/proc/self/environ").read_bytes()


needs_clean_ancestry = pytest.mark.skipif(
    own_environ_has_variable(), reason=f"the test runner itself was started with {ENV_NAME}"
)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# Real processes


def test_child_with_the_variable_resolves(spawn: Spawn) -> None:
    child = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    assert AllocationResolver().resolve([child.pid]) == {child.pid: ALLOC}


def test_no_other_variable_leaks(spawn: Spawn, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    env = {**PATH_ONLY, "SECRET": "hunter2", ENV_NAME: ALLOC, "TOKEN": "s3cr3t-t0ken"}
    child = spawn(["sleep", "30"], env)
    resolver = AllocationResolver()
    first = resolver.resolve([child.pid])
    second = resolver.resolve([child.pid])
    assert first == second == {child.pid: ALLOC}
    kept = repr(first) + repr(vars(resolver)) + caplog.text
    for secret in ("hunter2", "s3cr3t-t0ken", "SECRET", "TOKEN", "PATH"):
        assert secret not in kept


@needs_clean_ancestry
def test_grandchild_with_a_cleared_environment_resolves_through_its_parent(
    spawn: Spawn,
) -> None:
    shell = spawn(["sh", "-c", "env -i sleep 30 & echo $!; wait"], {**PATH_ONLY, ENV_NAME: ALLOC})
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    wait_for(lambda: comm(grandchild) == "sleep")  # `env` has exec'd `sleep` with no environment
    assert ENV_NAME.encode() not in Path(f"/proc/{grandchild}/environ").read_bytes()

    resolver = AllocationResolver()
    assert resolver.resolve([grandchild]) == {grandchild: ALLOC}
    assert resolver.resolve([grandchild, shell.pid]) == {grandchild: ALLOC, shell.pid: ALLOC}


@needs_clean_ancestry
def test_process_without_the_variable_is_none(spawn: Spawn) -> None:
    child = spawn(["sleep", "30"], PATH_ONLY)
    assert AllocationResolver().resolve([child.pid]) == {child.pid: None}


def test_second_call_is_served_from_the_cache(spawn: Spawn) -> None:
    child = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    resolver = AllocationResolver()
    resolver.resolve([child.pid])
    assert (resolver.hits, resolver.misses) == (0, 1)
    assert resolver.resolve([child.pid]) == {child.pid: ALLOC}
    assert (resolver.hits, resolver.misses) == (1, 1)
    assert len(resolver) == 1


def test_a_process_that_exited_is_none_and_dropped(spawn: Spawn) -> None:
    child = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    resolver = AllocationResolver()
    assert resolver.resolve([child.pid]) == {child.pid: ALLOC}
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert resolver.resolve([child.pid]) == {child.pid: None}
    assert len(resolver) == 0


def test_resolved_processes_are_held_by_pidfds_and_let_go_when_they_exit(spawn: Spawn) -> None:
    first = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    second = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: OTHER})
    resolver = AllocationResolver()
    pids = [first.pid, second.pid]
    assert resolver.resolve(pids) == {first.pid: ALLOC, second.pid: OTHER}
    assert resolver.pidfds == 2
    assert resolver.resolve(pids) == {first.pid: ALLOC, second.pid: OTHER}
    assert (resolver.hits, resolver.misses) == (2, 2)

    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert resolver.resolve(pids) == {first.pid: None, second.pid: OTHER}
    assert resolver.pidfds == 1
    # A PID no longer asked about is let go too.
    assert resolver.resolve([]) == {}
    assert resolver.pidfds == 0
    resolver.close()


def test_a_steady_set_of_held_processes_is_answered_at_once_until_one_exits(
    spawn: Spawn,
) -> None:
    """The poller asks about the same set of PIDs at every poll: once every one is held by a
    pidfd, the answer comes without a look at any of them, and an exit is still seen."""
    first = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    second = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: OTHER})
    resolver = AllocationResolver()
    pids = {first.pid, second.pid}
    for _ in range(4):
        assert resolver.resolve(pids) == {first.pid: ALLOC, second.pid: OTHER}
    generation = resolver.generation
    answer = resolver.resolve(pids)
    answer[first.pid] = "changed by the caller"  # the caller's copy, not the resolver's
    assert resolver.resolve(pids) == {first.pid: ALLOC, second.pid: OTHER}
    assert resolver.generation == generation

    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert resolver.resolve(pids) == {first.pid: None, second.pid: OTHER}
    assert resolver.generation != generation
    resolver.close()


def test_without_pidfds_processes_are_still_told_apart_by_their_stat(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfds(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    child = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    resolver = AllocationResolver()
    assert resolver.resolve([child.pid]) == {child.pid: ALLOC}
    assert resolver.resolve([child.pid]) == {child.pid: ALLOC}
    assert (resolver.hits, resolver.misses, resolver.pidfds) == (1, 1, 0)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert resolver.resolve([child.pid]) == {child.pid: None}


NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_pid_taken_by_a_new_process_is_resolved_afresh(spawn: Spawn) -> None:
    """The PID of a resolved process that exited goes to a new process (the kernel's next PID
    set back by hand): the new one gets its own allocation, not the cached one."""
    if not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("needs root to choose the next PID (/proc/sys/kernel/ns_last_pid)")
    old = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    resolver = AllocationResolver()
    assert resolver.resolve([old.pid]) == {old.pid: ALLOC}
    pid = old.pid
    os.killpg(pid, signal.SIGKILL)
    old.wait(timeout=10)
    for _ in range(20):  # another process on the machine may take the PID first: try again
        NS_LAST_PID.write_text(str(pid - 1))
        new = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: OTHER})
        if new.pid == pid:
            break
    else:
        pytest.skip(f"could not get PID {pid} again")
    assert resolver.resolve([pid]) == {pid: OTHER}
    assert resolver.resolve([pid]) == {pid: OTHER}
    resolver.close()


def test_pid_namespace_warning_matches_this_machine() -> None:
    nspid = [
        line.split()[1:]
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("NSpid:")
    ]
    warning = pid_namespace_warning()
    if not nspid or len(nspid[0]) == 1:
        assert warning is None
    else:
        assert warning is not None
        assert "hostPID: true" in warning


# ---------------------------------------------------------------------------------------------
# Fake /proc trees


def fake_process(
    root: Path,
    pid: int,
    *,
    ppid: int = 1,
    start: int = 1000,
    env: Mapping[str, str] | None = None,
    name: str = "python3",
    cgroup: str | None = None,
) -> None:
    """A /proc/<pid> with `stat` (the kernel's layout: field 4 the ppid, field 22 the start time),
    `environ` (NUL-separated) and, when given, `cgroup`."""
    directory = root / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    fields_after_name = f"S {ppid} {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0"
    (directory / "stat").write_text(f"{pid} ({name}) {fields_after_name}\n")
    environ = b"".join(f"{k}={v}".encode() + b"\0" for k, v in (env or {}).items())
    (directory / "environ").write_bytes(environ)
    if cgroup is not None:
        (directory / "cgroup").write_text(cgroup)


def test_fake_tree_recycled_pid_is_not_served_from_the_cache(tmp_path: Path) -> None:
    fake_process(tmp_path, 4242, start=1000, env={ENV_NAME: ALLOC})
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([4242]) == {4242: ALLOC}
    assert resolver.resolve([4242]) == {4242: ALLOC}
    assert (resolver.hits, resolver.misses) == (1, 1)

    # The process exits; another one gets the same PID, with another start time and allocation.
    fake_process(tmp_path, 4242, start=2000, env={ENV_NAME: OTHER})
    assert resolver.resolve([4242]) == {4242: OTHER}
    assert (resolver.hits, resolver.misses) == (1, 2)


def test_fake_tree_empty_environment_is_looked_at_twice_before_it_is_cached(
    tmp_path: Path,
) -> None:
    """A process caught between exec and the mapping of its new program shows an empty
    environment; so does one started with a cleared environment. Neither answer is cached at
    first sight."""
    fake_process(tmp_path, 2000, env={ENV_NAME: OTHER})
    fake_process(tmp_path, 2001, ppid=2000)  # mid-exec: empty for now
    fake_process(tmp_path, 2002, ppid=2000)  # cleared environment: empty for good
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([2001, 2002]) == {2001: OTHER, 2002: OTHER}
    (tmp_path / "2001" / "environ").write_bytes(f"{ENV_NAME}={ALLOC}\0".encode())
    assert resolver.resolve([2001, 2002]) == {2001: ALLOC, 2002: OTHER}
    assert (resolver.hits, resolver.misses) == (0, 4)
    assert resolver.resolve([2001, 2002]) == {2001: ALLOC, 2002: OTHER}
    assert (resolver.hits, resolver.misses) == (2, 4)


def test_fake_tree_command_names_with_parentheses_and_spaces(tmp_path: Path) -> None:
    fake_process(tmp_path, 10, name="a) (b 1 2", start=77, env={ENV_NAME: ALLOC})
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([10]) == {10: ALLOC}
    fake_process(tmp_path, 10, name="a) (b 1 2", start=78, env={ENV_NAME: OTHER})
    assert resolver.resolve([10]) == {10: OTHER}


def test_fake_tree_nearest_ancestor_wins(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, ppid=1, env={ENV_NAME: OTHER})
    fake_process(tmp_path, 200, ppid=100, env={ENV_NAME: ALLOC})
    fake_process(tmp_path, 300, ppid=200, env={"HOME": "/root"})
    fake_process(tmp_path, 301, ppid=300)
    fake_process(tmp_path, 302, ppid=300)
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([301, 302, 100]) == {301: ALLOC, 302: ALLOC, 100: OTHER}


def test_fake_tree_walk_stops_at_pid_one_and_after_max_ancestors(tmp_path: Path) -> None:
    fake_process(tmp_path, 1, ppid=0, env={ENV_NAME: OTHER})  # init's own variable is never used
    fake_process(tmp_path, 50, ppid=1)
    fake_process(tmp_path, 60, ppid=0)
    # 500 has the variable; 501..505 each descend from the previous one.
    fake_process(tmp_path, 500, ppid=50, env={ENV_NAME: ALLOC})
    for pid in range(501, 506):
        fake_process(tmp_path, pid, ppid=pid - 1)
    assert AllocationResolver(tmp_path).resolve([50, 60]) == {50: None, 60: None}
    assert AllocationResolver(tmp_path, max_ancestors=5).resolve([505]) == {505: ALLOC}
    assert AllocationResolver(tmp_path, max_ancestors=4).resolve([505]) == {505: None}
    # A bounded-out walk must not leave a wrong answer for an ancestor asked later in the call.
    assert AllocationResolver(tmp_path, max_ancestors=4).resolve([505, 502]) == {
        505: None,
        502: ALLOC,
    }


def test_fake_tree_parent_loop_ends(tmp_path: Path) -> None:
    fake_process(tmp_path, 70, ppid=71)
    fake_process(tmp_path, 71, ppid=70)
    fake_process(tmp_path, 72, ppid=72)
    assert AllocationResolver(tmp_path).resolve([70, 72]) == {70: None, 72: None}


def test_fake_tree_malformed_value_is_none_and_not_inherited(tmp_path: Path) -> None:
    fake_process(tmp_path, 80, env={ENV_NAME: ALLOC})
    for pid, value in ((81, "ABCDEF0123456789"), (82, "abc"), (83, ""), (84, ALLOC + "00")):
        fake_process(tmp_path, pid, ppid=80, env={ENV_NAME: value})
    result = AllocationResolver(tmp_path).resolve([81, 82, 83, 84])
    assert result == {81: None, 82: None, 83: None, 84: None}


def test_fake_tree_variable_anywhere_in_the_block(tmp_path: Path) -> None:
    env = {"A": "1", f"X{ENV_NAME}": OTHER, ENV_NAME: ALLOC, "Z": "2"}
    fake_process(tmp_path, 90, env=env)
    fake_process(tmp_path, 91, env={f"X{ENV_NAME}": OTHER})  # a longer name is another variable
    (tmp_path / "92").mkdir()
    fake_process(tmp_path, 92)
    (tmp_path / "92" / "environ").write_bytes(f"{ENV_NAME}={ALLOC}".encode())  # no final NUL
    assert AllocationResolver(tmp_path).resolve([90, 91, 92]) == {90: ALLOC, 91: None, 92: ALLOC}


def test_fake_tree_cache_holds_only_the_latest_pids(tmp_path: Path) -> None:
    for pid in (1001, 1002, 1003):
        fake_process(tmp_path, pid, env={ENV_NAME: ALLOC})
    resolver = AllocationResolver(tmp_path)
    resolver.resolve([1001, 1002, 1003])
    assert len(resolver) == 3
    resolver.resolve([1002])
    assert len(resolver) == 1
    resolver.resolve([1001, 1002])
    assert (resolver.hits, resolver.misses) == (2, 4)  # 1001 was dropped, so resolved afresh


def test_fake_tree_generation_moves_only_when_an_answer_may_have(tmp_path: Path) -> None:
    """The snapshot build reuses its last attribution while the generation stands still, so it
    must move whenever a PID's pod, cgroup or claim may read differently."""
    fake_process(tmp_path, 1001, env={ENV_NAME: ALLOC}, cgroup=f"0::/kubepods/pod{POD}/c1\n")
    fake_process(tmp_path, 1002, env={ENV_NAME: ALLOC})
    resolver = AllocationResolver(tmp_path)
    seen = [resolver.generation]

    def after(pids: list[int]) -> int:
        resolver.resolve(pids)
        seen.append(resolver.generation)
        return resolver.generation

    assert after([1001]) != seen[-2]  # resolved for the first time
    assert after([1001]) == seen[-2]  # the same process, from the cache
    assert after([1001, 1002]) != seen[-2]  # one more
    assert after([1001, 1002]) == seen[-2]
    assert after([1002]) != seen[-2]  # one let go: its pod now reads None
    fake_process(tmp_path, 1002, start=2000, env={ENV_NAME: OTHER})  # its PID reused
    assert after([1002]) != seen[-2]
    assert resolver.pod_uid_of(1001) is None
    resolver.close()
    assert resolver.generation != seen[-1]


def test_fake_tree_duplicates_and_invalid_pids(tmp_path: Path) -> None:
    fake_process(tmp_path, 1100, env={ENV_NAME: ALLOC})
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([1100, 1100, 0, -5, 99999]) == {
        1100: ALLOC,
        0: None,
        -5: None,
        99999: None,
    }
    assert len(resolver) == 1


def test_fake_tree_unreadable_environ_is_none_and_retried(tmp_path: Path) -> None:
    fake_process(tmp_path, 1200, env={ENV_NAME: ALLOC})
    environ = tmp_path / "1200" / "environ"
    environ.unlink()
    environ.mkdir()  # reading it fails, as a process's environ may
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([1200]) == {1200: None}
    assert len(resolver) == 0
    environ.rmdir()
    environ.write_bytes(f"{ENV_NAME}={ALLOC}\0".encode())
    assert resolver.resolve([1200]) == {1200: ALLOC}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_fake_tree_permission_denied_is_none_and_not_cached(tmp_path: Path) -> None:
    fake_process(tmp_path, 1300, env={ENV_NAME: ALLOC})
    environ = tmp_path / "1300" / "environ"
    environ.chmod(0)
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([1300]) == {1300: None}
    assert len(resolver) == 0


def test_fake_tree_vanished_ancestor_is_none_and_not_cached(tmp_path: Path) -> None:
    fake_process(tmp_path, 1400, ppid=1399)  # its parent has no /proc entry
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([1400]) == {1400: None}
    assert len(resolver) == 0


def test_negative_max_ancestors_is_refused() -> None:
    with pytest.raises(ValueError, match="max_ancestors"):
        AllocationResolver(max_ancestors=-1)


def status_tree(root: Path, text: str | None) -> Path:
    (root / "self").mkdir(parents=True)
    if text is not None:
        (root / "self" / "status").write_text(text)
    return root


@pytest.mark.parametrize(
    ("status", "warns"),
    [
        ("Name:\tvgpu\nPid:\t42\nNSpid:\t42\nNSpgid:\t42\n", False),
        ("Name:\tvgpu\nPid:\t42\nNSpid:\t4242\t42\n", True),
        ("Name:\tvgpu\nNSpid:\t9\t5\t1\n", True),
        ("Name:\tvgpu\nPid:\t42\n", False),  # kernels before 4.1 have no NSpid line
        (None, False),
    ],
)
def test_fake_tree_pid_namespace_warning(tmp_path: Path, status: str | None, warns: bool) -> None:
    warning = pid_namespace_warning(status_tree(tmp_path, status))
    if warns:
        assert warning is not None
        assert "hostPID: true" in warning
        assert "host PID" in warning
        assert "\n" not in warning
    else:
        assert warning is None


# ---------------------------------------------------------------------------------------------
# The pod a process runs in, from /proc/<pid>/cgroup

POD = "0f1e2d3c-aaaa-bbbb-cccc-0123456789ab"
POD_US = POD.replace("-", "_")
STATIC_POD = "6e1b0b9a3c5d4e7f8a9b0c1d2e3f4a5b"  # a static pod's UID: 32 hex digits
CTR = "4f9c2a7b1d3e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8"
V1_HOST = "12:memory:/user.slice\n11:cpu,cpuacct:/user.slice\n1:name=systemd:/user.slice/s.scope\n"

CGROUPS: list[tuple[str, str, str | None]] = [
    # cgroup v2, systemd driver, each QoS class.
    (
        "v2 systemd burstable",
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_US}.slice/cri-containerd-{CTR}.scope\n",
        POD,
    ),
    (
        "v2 systemd besteffort",
        "0::/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{POD_US}.slice/crio-{CTR}.scope\n",
        POD,
    ),
    (
        "v2 systemd guaranteed",
        f"0::/kubepods.slice/kubepods-pod{POD_US}.slice/docker-{CTR}.scope\n",
        POD,
    ),
    # cgroup v2, cgroupfs driver.
    ("v2 cgroupfs burstable", f"0::/kubepods/burstable/pod{POD}/{CTR}\n", POD),
    ("v2 cgroupfs guaranteed", f"0::/kubepods/pod{POD}/{CTR}\n", POD),
    # Seen from a daemon in a cgroup namespace of its own whose root is not known: refused
    # (see test_paths_relative_to_a_cgroup_namespace_are_resolved_from_its_root).
    (
        "v2 from another cgroup namespace",
        f"0::/../../kubepods-besteffort-pod{POD_US}.slice/cri-containerd-{CTR}.scope\n",
        None,
    ),
    (
        "v2 cgroupfs from another cgroup namespace",
        f"0::/../../../besteffort/pod{POD}/{CTR}\n",
        None,
    ),
    ("v2 host from another cgroup namespace", "0::/../../../../system.slice/a.service\n", None),
    ("v2 the daemon's own cgroup namespace", "0::/\n", None),
    # A kubelet whose cgroup root is not / (kind: /kubelet.slice/kubelet-kubepods.slice).
    (
        "v2 systemd under a kubelet slice",
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
        f"kubelet-kubepods-burstable-pod{POD_US}.slice/cri-containerd-{CTR}.scope\n",
        POD,
    ),
    # cgroup v1: one line per hierarchy.
    (
        "v1 cgroupfs",
        f"12:memory:/kubepods/burstable/pod{POD}/{CTR}\n"
        f"11:cpu,cpuacct:/kubepods/burstable/pod{POD}/{CTR}\n"
        f"1:name=systemd:/kubepods/burstable/pod{POD}/{CTR}\n",
        POD,
    ),
    (
        "v1 systemd",
        f"12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice"
        f"/cri-containerd-{CTR}.scope\n"
        f"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_US}.slice/cri-containerd-{CTR}.scope\n",
        POD,
    ),
    # Hybrid: v1 controllers and an empty unified hierarchy.
    ("hybrid", f"4:memory:/kubepods/besteffort/pod{POD}/{CTR}\n0::/\n", POD),
    ("static pod", f"0::/kubepods/burstable/pod{STATIC_POD}/{CTR}\n", STATIC_POD),
    # Nested: cgroups made inside a pod's container belong to that container (the outer
    # pod), whatever they are called.
    (
        "nested pods",
        f"0::/kubepods/burstable/pod{STATIC_POD}/{CTR}/kubepods/besteffort/pod{POD}/{CTR}\n",
        STATIC_POD,
    ),
    # No pod: host processes, the pod-level QoS slices themselves, look-alikes outside kubepods.
    ("v2 host", "0::/system.slice/containerd.service\n", None),
    ("v2 root", "0::/\n", None),
    ("v1 host", V1_HOST, None),
    ("qos slice", "0::/kubepods.slice/kubepods-burstable.slice\n", None),
    ("look-alike outside kubepods", f"0::/system.slice/pod{POD}/x\n", None),
    ("not a uid", "0::/kubepods/burstable/podnot-a-uid/x\n", None),
    ("docker container", f"0::/system.slice/docker-{CTR}.scope\n", None),
    ("empty", "", None),
    ("garbage", "no colons here\n", None),
]


@pytest.mark.parametrize(
    ("content", "expected"), [(c, e) for _, c, e in CGROUPS], ids=[n for n, _, _ in CGROUPS]
)
def test_pod_uid_in_cgroup(content: str, expected: str | None) -> None:
    assert pod_uid_in_cgroup(content.encode()) == expected


def test_fake_tree_pod_uid_is_read_with_the_allocation(tmp_path: Path) -> None:
    fake_process(
        tmp_path,
        500,
        env={ENV_NAME: ALLOC},
        cgroup=f"0::/kubepods.slice/kubepods-pod{POD_US}.slice/cri-containerd-{CTR}.scope\n",
    )
    fake_process(tmp_path, 501, env={ENV_NAME: ALLOC}, cgroup="0::/user.slice/session-1.scope\n")
    fake_process(tmp_path, 502, env={ENV_NAME: ALLOC})  # no cgroup file: as a host process
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([500, 501, 502]) == {500: ALLOC, 501: ALLOC, 502: ALLOC}
    assert [resolver.pod_uid_of(pid) for pid in (500, 501, 502)] == [POD, None, None]
    assert resolver.pod_uid_of(503) is None  # not resolved


def test_fake_tree_pod_uid_is_cached_per_pid_and_start_time(tmp_path: Path) -> None:
    in_pod = f"0::/kubepods/burstable/pod{POD}/{CTR}\n"
    fake_process(tmp_path, 600, start=10, env={ENV_NAME: ALLOC}, cgroup=in_pod)
    resolver = AllocationResolver(tmp_path)
    resolver.resolve([600])
    assert resolver.pod_uid_of(600) == POD
    # The same process: served from the cache, the file is not read again.
    (tmp_path / "600" / "cgroup").write_text("0::/\n")
    resolver.resolve([600])
    assert resolver.pod_uid_of(600) == POD
    assert (resolver.hits, resolver.misses) == (1, 1)
    # A recycled PID is another process: read afresh.
    fake_process(tmp_path, 600, start=20, env={ENV_NAME: ALLOC}, cgroup="0::/\n")
    resolver.resolve([600])
    assert resolver.pod_uid_of(600) is None
    # A PID the latest call did not resolve has no pod here.
    resolver.resolve([])
    assert resolver.pod_uid_of(600) is None


def test_fake_tree_unreadable_cgroup_is_none_and_not_cached(tmp_path: Path) -> None:
    fake_process(tmp_path, 700, env={ENV_NAME: ALLOC})
    (tmp_path / "700" / "cgroup").mkdir()  # reading it fails
    resolver = AllocationResolver(tmp_path)
    assert resolver.resolve([700]) == {700: None}
    assert len(resolver) == 0
    (tmp_path / "700" / "cgroup").rmdir()
    (tmp_path / "700" / "cgroup").write_text(f"0::/kubepods/pod{POD}/{CTR}\n")
    assert resolver.resolve([700]) == {700: ALLOC}
    assert resolver.pod_uid_of(700) == POD


def test_real_process_pod_uid_matches_its_cgroup_file(spawn: Spawn) -> None:
    child = spawn(["sleep", "30"], {**PATH_ONLY, ENV_NAME: ALLOC})
    resolver = AllocationResolver()
    assert resolver.resolve([child.pid]) == {child.pid: ALLOC}
    expected = pod_uid_in_cgroup(Path(f"/proc/{child.pid}/cgroup").read_bytes())
    assert resolver.pod_uid_of(child.pid) == expected


# ---------------------------------------------------------------------------------------------
# The kubelet's checkpoint, as the kubelet simulator writes it


async def test_simulator_checkpoint_names_the_pod_of_each_allocation(node: Node) -> None:
    reader = CheckpointReader(node.plugin_dir / CHECKPOINT_FILE, RESOURCE)
    async with running_daemon(node):
        await registered(node, 8)
        pod = await node.sim.admit_pod("train", [("main", 2), ("side", 1), ("none", 0)])
        other = await node.sim.admit_pod("infer", [("main", 1)])
        checkpoint = reader.read()
        assert checkpoint.readable, checkpoint.reason
        claims = {
            (p.uid, c.name): c.envs[ENV_NAME]
            for p in (pod, other)
            for c in p.containers
            if c.device_ids
        }
        assert {(e.pod_uid, e.container): e.allocation_id for e in checkpoint.entries} == claims
        for (uid, name), allocation in claims.items():
            assert checkpoint.pod_of(allocation) == ((uid, name),)
        assert reader.read() is checkpoint  # unchanged: not parsed again
        await node.sim.delete_pod("default", "infer")
        after = reader.read()
        assert after.pod_allocations.keys() == {pod.uid}
        assert reader.parses == 2
