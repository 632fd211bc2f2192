"""A fake control daemon a test runs by itself (without vgpu's supervisor), and the fake's
record, for the tests of the fake and of the MPS package."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.support.fake_mps.client import FAKE_CONTROL
from tests.support.fake_mps.daemon import PID_FILE
from tests.support.fake_mps.records import RECORD


def fake_env(root: Path, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root / "log"),
        **extra,
    }


def records(root: Path) -> list[dict[str, Any]]:
    """Everything the fake recorded under `root` (its log directory), oldest first."""
    path = root / "log" / RECORD
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def events(root: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in records(root) if r["event"] == name]


def eventually_events(root: Path, name: str, count: int = 1) -> list[dict[str, Any]]:
    """The events `name` once there are `count` of them (the fake records a client's end from
    a thread of its own, after the process is gone), or whatever there is after 10 s."""
    deadline = time.monotonic() + 10
    while len(found := events(root, name)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def control(root: Path, command: str) -> str:
    """The answer of one command that must succeed, to the fake control daemon running under
    `root` (started by whoever: the test, or vgpu's supervisor)."""
    done = subprocess.run(
        [str(FAKE_CONTROL)],
        input=command + "\n",
        env=fake_env(root),
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def namespace_caps(root: Path, pipe_directory: str) -> dict[str, str]:
    """What the control daemon says of the MPS v3 namespace whose directory is
    `pipe_directory` (`active-thread-percentage`, `pinned-memory-limit`, ...)."""
    server, name = Path(pipe_directory).parts[-2:]
    answer = control(root, f"namespace get {name} --server={server}")
    return dict(line.split("=", 1) for line in answer.splitlines() if "=" in line)


def namespaces(root: Path) -> set[str]:
    """Every `<server>/<namespace>` the control daemon has."""
    found = set()
    for server in control(root, "server list").split():
        listed = control(root, f"namespace list --server={server}").split()
        found |= {f"{server}/{name}" for name in listed}
    return found


class FakeControlDaemon:
    """`fake_mps_control.py [-p 3 -m] -f` in the foreground, as the test's child."""

    def __init__(self, root: Path, *, protocol: int = 3) -> None:
        self.root = root
        self.pipe = root / "pipe"
        self.pipe.mkdir(parents=True, exist_ok=True)
        args = ["-p", "3", "-m", "-f"] if protocol == 3 else ["-f"]
        self.process = subprocess.Popen(
            [str(FAKE_CONTROL), *args], env=fake_env(root), start_new_session=True
        )
        deadline = time.monotonic() + 10
        while self._pid_file() != str(self.process.pid):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake control daemon did not start")
            time.sleep(0.01)

    def _pid_file(self) -> str:
        try:
            return (self.pipe / PID_FILE).read_text().strip()
        except OSError:
            return ""

    def run(self, *commands: str, timeout_s: float = 10) -> subprocess.CompletedProcess[str]:
        """One run of the control command with `commands` on its stdin."""
        return subprocess.run(
            [str(FAKE_CONTROL)],
            input="".join(f"{c}\n" for c in commands),
            env=fake_env(self.root),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def start(self, *commands: str) -> subprocess.Popen[str]:
        """A run of the control command with `commands`, left running (the test reaps it)."""
        process = subprocess.Popen(
            [str(FAKE_CONTROL)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=fake_env(self.root),
        )
        assert process.stdin is not None
        process.stdin.write("".join(f"{c}\n" for c in commands))
        process.stdin.close()
        return process

    def ok(self, *commands: str) -> str:
        """The answer of commands that must succeed."""
        done = self.run(*commands)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def stop(self) -> None:
        """Kill it (its own session: the test's child and nothing else), and reap it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
