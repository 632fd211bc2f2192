"""The fake's MPS clients: a process that attaches to a pipe directory as a CUDA process would,
and the canary, a client that attaches and detaches at once.

`fake_mps_control.py client [--work]`: connects to `$CUDA_MPS_PIPE_DIRECTORY/control`, attaches
(telling the control daemon the limits its environment asks for: a client can only lower them)
and prints the answer (`ok threads=<n> memory=<size>`, or `error ...`); with `--work` it then has
GPU work in flight until it exits. It prints what the control daemon sends it (`terminated`)
and runs until it is killed. Killed (SIGKILL or SIGTERM: nothing drains it) with work in flight
and not terminated first, it wedges its GPU in the control daemon.

`fake_mps_control.py canary`: attaches, detaches, exits 0; it hangs, as a CUDA init does, on a
wedged GPU, and exits 1 when the control daemon refuses it.

`FakeClient` starts the first from a test and waits for its answer.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

FAKE_CONTROL = Path(__file__).resolve().parents[1] / "fake_mps_control.py"


def _attach_line() -> str:
    memory = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
    first = memory.split(",")[0].partition("=")[2] if memory else ""
    return (
        f"attach threads={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '-')} "
        f"memory={first or '-'} devices={os.environ.get('CUDA_VISIBLE_DEVICES', '*')}\n"
    )


def _connect() -> tuple[socket.socket, BinaryIO]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(pipe / "control"))
    return conn, conn.makefile("rb")


def run_client(work: bool) -> int:
    try:
        conn, stream = _connect()
    except OSError as e:
        print(f"error cannot connect: {e}", flush=True)
        return 1
    conn.sendall(_attach_line().encode())
    answer = stream.readline().decode().strip()
    print(answer, flush=True)
    if not answer.startswith("ok"):
        return 1
    if work:
        conn.sendall(b"work\n")
        print(stream.readline().decode().strip(), flush=True)
    while line := stream.readline().decode().strip():
        print(line, flush=True)
    print("server-gone", flush=True)
    threading.Event().wait()  # until killed
    return 0


def run_canary() -> int:
    try:
        conn, stream = _connect()
    except OSError as e:
        print(f"canary: cannot connect: {e}", file=sys.stderr)
        return 1
    with conn:
        conn.sendall(_attach_line().encode())
        answer = stream.readline().decode().strip()
        if not answer.startswith("ok"):
            print(f"canary: {answer or 'no answer'}", file=sys.stderr)
            return 1
        conn.sendall(b"detach\n")
        stream.readline()
    print(answer)
    return 0


class FakeClient:
    """A fake MPS client process a test started, attached (or refused) by the time the
    constructor returns. The test kills it (`kill`, or through the code under test)."""

    def __init__(
        self,
        pipe_directory: str | Path,
        *,
        work: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE_CONTROL), "client", *(["--work"] if work else [])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            bufsize=0,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "CUDA_MPS_PIPE_DIRECTORY": str(pipe_directory),
                **(env or {}),
            },
        )
        self.pid = self.process.pid
        self.answer = self.line()
        if work and self.answer.startswith("ok"):
            self.line()

    def line(self, timeout_s: float = 10.0) -> str:
        """The next line it prints; "" when none comes within `timeout_s` (a hang)."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            readable, _, _ = select.select([stdout], [], [], max(deadline - time.monotonic(), 0))
            if not readable:
                return ""
            byte = os.read(stdout.fileno(), 1)
            if not byte:
                break
            data += byte
        return data.decode().strip()

    @property
    def attached(self) -> bool:
        return self.answer.startswith("ok")

    def limits(self) -> dict[str, str]:
        """What the control daemon held it to: {"threads": ..., "memory": ...}."""
        return dict(w.partition("=")[::2] for w in self.answer.split()[1:])

    def kill(self) -> None:
        """Resume (in case a test stopped it), then SIGKILL; reap."""
        if self.process.poll() is None:
            self.process.send_signal(18)  # SIGCONT
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
