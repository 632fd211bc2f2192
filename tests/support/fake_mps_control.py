#!/usr/bin/env python3
"""A stand-in for `nvidia-cuda-mps-control`, for tests on machines without a GPU.

It behaves like the real program where the daemon relies on it:

- `fake_mps_control.py -d` daemonises: the command returns once a background control daemon
  listens on `$CUDA_MPS_PIPE_DIRECTORY/control` and has written its PID to
  `$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid`. It refuses to start a second one.
- `fake_mps_control.py -f` is the same control daemon in the foreground: it writes its PID file,
  serves until `quit` and then exits 0.
- `fake_mps_control.py` (no argument) sends its stdin to the running control daemon, prints the
  answer and exits 0; with no control daemon running it says so on stderr and exits 1.
- The control daemon answers `set_default_device_pinned_mem_limit <dev> <value>`,
  `get_default_device_pinned_mem_limit <dev>`, `set_default_active_thread_percentage <n>`,
  `get_default_active_thread_percentage`, `get_server_list`, and exits on `quit`, removing
  its PID file and socket. Killed, it leaves both behind, as a crashed daemon does.

Everything is recorded, one JSON object a line, in `$CUDA_MPS_LOG_DIRECTORY/fake-control.jsonl`:
each run's argv, pid and CUDA_MPS_* environment (`"event": "run"`), and each command the control
daemon receives (`"event": "command"`). Tests make it fail on purpose with marker files in the
MPS root (the pipe directory's parent): `fake-fail-start` (`-d` exits 1) and
`fake-fail-commands` (the control daemon answers every command with an error, exit 1). Others
model misbehaving control programs: `fake-flood` (a command run prints 400 MiB and more until it
is killed), `fake-ignore-quit` (the control daemon answers `quit` but runs on) and
`fake-ignore-sigterm` (it ignores SIGTERM; only SIGKILL ends it).
Standard library only: it runs under whatever `python3` is on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
RECORD = "fake-control.jsonl"


def directories() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, logs


def record(event: dict[str, object]) -> None:
    _, logs = directories()
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / RECORD).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **event}) + "\n")


def live_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


def answer(command: str, settings: dict[str, str]) -> str:
    words = command.split()
    if not words:
        return ""
    name, args = words[0], words[1:]
    if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
        settings[f"mem:{args[0]}"] = args[1]
        return ""
    if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return settings.get(f"mem:{args[0]}", "0")
    if name == "set_default_active_thread_percentage" and len(args) == 1:
        settings["threads"] = args[0]
        return f"{float(args[0]):.1f}"
    if name == "get_default_active_thread_percentage":
        return f"{float(settings.get('threads', '100')):.1f}"
    if name == "get_server_list":
        return ""
    return f"Unrecognized command: {command}"


def serve(listener: socket.socket, pipe: Path, root: Path) -> None:
    settings: dict[str, str] = {}
    while True:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            replies: list[str] = []
            failing = (root / "fake-fail-commands").exists()
            for line in data.decode().splitlines():
                command = line.strip()
                if not command:
                    continue
                record({"event": "command", "command": command})
                if failing:
                    replies.append("!error: failing on purpose")
                    continue
                if command == "quit" and (root / "fake-ignore-quit").exists():
                    replies.append("")
                    continue
                if command == "quit":
                    conn.sendall(b"")
                    (pipe / PID_FILE).unlink(missing_ok=True)
                    (pipe / SOCKET).unlink(missing_ok=True)
                    record({"event": "exit"})
                    return
                replies.append(answer(command, settings))
            conn.sendall("\n".join(replies).encode())


def daemonise(pipe: Path, root: Path) -> int:
    if (root / "fake-fail-start").exists():
        print("fake: failing to start on purpose", file=sys.stderr)
        return 1
    if live_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    pipe.mkdir(parents=True, exist_ok=True)
    (pipe / SOCKET).unlink(missing_ok=True)
    ready_r, ready_w = os.pipe()
    if os.fork() > 0:
        os.close(ready_w)
        ok = os.read(ready_r, 1) == b"1"
        return 0 if ok else 1
    os.close(ready_r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        control_daemon(pipe, root, ready_w)
    finally:
        os._exit(0)


def control_daemon(pipe: Path, root: Path, ready_w: int | None = None) -> None:
    """Listen on the control socket, write the PID file and serve until quit."""
    if (root / "fake-ignore-sigterm").exists():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(pipe / SOCKET))
    listener.listen(8)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    record({"event": "started", "argv": sys.argv[1:]})
    if ready_w is not None:
        os.write(ready_w, b"1")
        os.close(ready_w)
    serve(listener, pipe, root)


def foreground(pipe: Path, root: Path) -> int:
    if (root / "fake-fail-start").exists():
        print("fake: failing to start on purpose", file=sys.stderr)
        return 1
    if live_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    pipe.mkdir(parents=True, exist_ok=True)
    (pipe / SOCKET).unlink(missing_ok=True)
    control_daemon(pipe, root)
    return 0


def send(pipe: Path, text: str) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(pipe / SOCKET))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with client:
        client.sendall(text.encode())
        client.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := client.recv(4096):
            reply += chunk
    out = reply.decode()
    if out.startswith("!error"):
        print(out.removeprefix("!"), file=sys.stderr)
        return 1
    if out:
        print(out)
    return 0


def main(argv: list[str]) -> int:
    pipe, _ = directories()
    env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
    if not argv:
        text = sys.stdin.read()
        record({"event": "run", "argv": argv, "env": env, "stdin": text})
        if (pipe.parent / "fake-flood").exists():
            line = b"x" * 1023 + b"\n"
            for _ in range(400 * 1024):
                sys.stdout.buffer.write(line)
            return 0
        return send(pipe, text)
    record({"event": "run", "argv": argv, "env": env})
    if argv == ["-d"]:
        return daemonise(pipe, pipe.parent)
    if argv == ["-f"]:
        return foreground(pipe, pipe.parent)
    print(f"fake: unsupported arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(sys.argv[1:]))
