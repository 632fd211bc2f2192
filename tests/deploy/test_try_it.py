"""docs/running.md's "Try it without a GPU", run as written: fake GPUs, the kubelet simulator, the
daemon, a process with the container's environment, and `status` showing that container's use.
Only the directory and the port change (the test's own, so that nothing else is touched)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deploy.support import ROOT

SECTION = "### Try it without a GPU"


def section_text() -> str:
    text = (ROOT / "docs" / "running.md").read_text()
    section = text[text.index(SECTION) :]
    return section[: section.index("\n### ", len(SECTION))]


def commands() -> list[list[str]]:
    """Each ```sh block of the section, as its commands (continuation lines joined)."""
    blocks = re.findall(r"```sh\n(.*?)```", section_text(), flags=re.DOTALL)
    return [
        [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
        for block in blocks
    ]


def shown() -> list[list[re.Pattern[str]]]:
    """Each ```text block of the section (what the reader is told they will see), a pattern per
    line: `...` stands for what differs from run to run."""
    blocks = re.findall(r"```text\n(.*?)```", section_text(), flags=re.DOTALL)
    return [
        [
            re.compile(re.escape(line).replace(re.escape("..."), ".+?"))
            for line in block.splitlines()
        ]
        for block in blocks
    ]


def looks_as_shown(patterns: list[re.Pattern[str]], lines: list[str]) -> bool:
    return len(patterns) == len(lines) and all(
        p.fullmatch(line) for p, line in zip(patterns, lines, strict=True)
    )


def test_the_section_is_three_terminals_of_commands() -> None:
    first, second, third = commands()
    assert first[0].startswith("python -m deviceplugin.gpu.fake write ")
    assert first[1].startswith("python -m deviceplugin.sim ")
    assert second[0].startswith("vgpu-device-plugin serve ")
    assert "--trust-host-processes" in second[0]
    assert third[0].startswith("env NVIDIA_VISIBLE_DEVICES=GPU-... VGPU_ALLOCATION_ID=... ")
    assert third[0].endswith("&")
    assert third[1].startswith("vgpu-device-plugin status ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Shell:
    """Runs the section's lines with this interpreter's `python` and `vgpu-device-plugin` first
    on PATH; every process started is ended (its whole session) when the test ends."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
        self.started: list[subprocess.Popen[bytes]] = []

    def line(self, command: str) -> str:
        command = command.replace("/tmp/vgpu", str(self.directory))
        return command.replace("127.0.0.1:9410", f"127.0.0.1:{self.port}")

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", self.line(command)],
            capture_output=True, text=True, timeout=60, check=False, env=self.env,
        )  # fmt: skip

    def start(self, command: str, output: Path) -> subprocess.Popen[bytes]:
        with output.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", "exec " + self.line(command)],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            )  # fmt: skip
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.started):
            for number in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.killpg(proc.pid, number)
                except ProcessLookupError:
                    break
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def shell(short_tmp: Path) -> Iterator[Shell]:
    s = Shell(short_tmp / "vgpu", free_port())
    try:
        yield s
    finally:
        s.close()


def wait_for(what: str, check: Callable[[], object], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_try_it_without_a_gpu_shows_the_containers_usage(shell: Shell) -> None:
    (write, simulate), (serve,), (work, status) = commands()
    logs = shell.directory.parent
    result = shell.run(write)
    assert result.returncode == 0, result.stderr
    sim_out = logs / "sim.out"
    shell.start(simulate, sim_out)
    daemon = shell.start(serve, logs / "serve.out")

    def admitted() -> str:
        found = re.search(
            r"^admitted default/train/trainer: .* env (.*)$", sim_out.read_text(), re.M
        )
        assert daemon.poll() is None, (logs / "serve.out").read_text()
        return found.group(1) if found else ""

    wait_for("the simulator to admit the pod", admitted)
    envs = admitted()
    assert "VGPU_ALLOCATION_ID=" in envs
    (admitted_line,), status_shown = shown()
    found = [line for line in sim_out.read_text().splitlines() if line.startswith("admitted ")]
    assert looks_as_shown([admitted_line], found), (admitted_line.pattern, found)
    # What the reader pastes: the environment the simulator printed.
    work = re.sub(
        r"^env NVIDIA_VISIBLE_DEVICES=GPU-\.\.\. VGPU_ALLOCATION_ID=\.\.\.", f"env {envs}", work
    )
    worker = shell.start(work.removesuffix("&").strip(), logs / "work.out")

    seen: list[str] = []

    def as_shown() -> bool:
        result = shell.run(status)
        seen.append(result.stdout + result.stderr)
        return looks_as_shown(status_shown, result.stdout.rstrip("\n").splitlines())

    try:
        wait_for("status to show what the page shows", as_shown)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last status:\n{seen[-1] if seen else ''}") from e
    # Its GPU work ends: it is taken off the state file.
    os.killpg(worker.pid, signal.SIGTERM)
    worker.wait(15)
    assert '"pid"' not in (shell.directory / "gpus.json").read_text()
