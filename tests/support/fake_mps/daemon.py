"""The fake control daemon: its sockets, one thread per connection, and its start (`-d`, `-f`).

Every socket speaks the same two dialects, told apart by the first line a connection sends:
`attach ...` makes it a client's connection, held open for the client's life (see
tests/support/fake_mps/client.py); anything else is a run of the control command, whose whole
stdin is read to its end and answered, one answer a line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import BinaryIO

from tests.support.fake_mps.records import record
from tests.support.fake_mps.state import DEFAULT, Client, FakeError, FakeState

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
# Marker files in the MPS root (the pipe directory's parent) that make it misbehave on purpose.
FAIL_START = "fake-fail-start"
FAIL_COMMANDS = "fake-fail-commands"
IGNORE_QUIT = "fake-ignore-quit"
IGNORE_SIGTERM = "fake-ignore-sigterm"
TERMINATE_HANGS = "fake-terminate-hangs"


def live_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


def stopped(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class FakeDaemon:
    """The control daemon's sockets and connections over a FakeState."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.listeners: dict[Path, socket.socket] = {}
        state.sockets = self

    # --- Sockets, for the state ---------------------------------------------------------------

    def open(self, path: Path, server: str, namespace: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a crashed daemon's socket
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
        except OSError as e:
            listener.close()
            raise FakeError(f"cannot listen on {path}: {e}") from e
        listener.listen(16)
        self.listeners[path] = listener
        threading.Thread(
            target=self.accept, args=(listener, server, namespace), daemon=True
        ).start()

    def close(self, path: Path) -> None:
        listener = self.listeners.pop(path, None)
        if listener is not None:
            listener.close()
        path.unlink(missing_ok=True)
        if path.parent != self.state.pipe:
            with contextlib.suppress(OSError):
                path.parent.rmdir()

    # --- connections --------------------------------------------------------------------------

    def accept(self, listener: socket.socket, server: str, namespace: str) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self.connection, args=(conn, server, namespace), daemon=True
            ).start()

    def connection(self, conn: socket.socket, server: str, namespace: str) -> None:
        with conn:
            stream = conn.makefile("rb")
            first = stream.readline().decode()
            if first.startswith("attach"):
                self.client(conn, stream, server, namespace, first)
                return
            data = first + stream.read().decode()
            replies = [self.command(line.strip(), conn) for line in data.splitlines()]
            with contextlib.suppress(OSError):
                conn.sendall("\n".join(r for r in replies if r is not None).encode())

    def command(self, command: str, conn: socket.socket) -> str | None:
        """One command's answer ("!error: ..." when refused); None for an empty line."""
        if not command:
            return None
        record({"event": "command", "command": command})
        root = self.state.root
        if (root / FAIL_COMMANDS).exists():
            return "!error: failing on purpose"
        words = command.split()
        if words[0] == "quit":
            if (root / IGNORE_QUIT).exists():
                return ""
            self.quit(conn)
        try:
            if self._terminates(words):
                if words[0] == "terminate_client" and words[1] != str(os.getpid()):
                    raise FakeError(f"No server with pid {words[1]}")
                hangs = (root / TERMINATE_HANGS).exists
                return self.state.terminate(int(words[2]), hangs, stopped)
            with self.state.lock:
                if self.state.protocol == 3 and words[0] in ("server", "namespace", "client"):
                    return self.state.answer_v3(words, command)
                return self.state.answer_v2(words[0], words[1:], command)
        except (FakeError, ValueError) as e:
            return f"!error: {e}"

    def _terminates(self, words: list[str]) -> bool:
        """`terminate_client <server> <pid>` (v2), `client terminate <pid>` (v3)."""
        if len(words) != 3 or not words[2].isdigit():
            return False
        if words[0] == "terminate_client":
            return True
        return self.state.protocol == 3 and words[:2] == ["client", "terminate"]

    def quit(self, conn: socket.socket) -> None:
        """`quit` (with or without `-t <s>`): the sockets and PID file go, the process exits 0.
        The namespaces' directories stay, as a crash leaves them."""
        with contextlib.suppress(OSError):
            conn.sendall(b"")
        for path in list(self.listeners):
            self.listeners.pop(path).close()
            path.unlink(missing_ok=True)
        (self.state.pipe / PID_FILE).unlink(missing_ok=True)
        record({"event": "exit"})
        os._exit(0)

    def client(
        self, conn: socket.socket, stream: BinaryIO, server: str, namespace: str, first: str
    ) -> None:
        """A client's connection: `attach` (already read), then `work`, `sync`, `detach`."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid = int.from_bytes(creds[:4], sys.byteorder)
        asked = dict(w.partition("=")[::2] for w in first.split()[1:])
        state = self.state
        with state.lock:
            wedged = state.is_wedged(state.devices_of(server, asked))
        if wedged:
            # A wedged GPU: a new client hangs in its CUDA init.
            record({"event": "attach-hangs", "client": pid})
            threading.Event().wait()
        try:
            with state.lock:
                reply = state.attach(conn, pid, server, namespace, asked)
                client = state.clients[pid]
        except FakeError as e:
            with contextlib.suppress(OSError):
                conn.sendall(f"error {e}\n".encode())
            return
        conn.sendall(f"{reply}\n".encode())
        detached = False
        while line := stream.readline().decode().strip():
            if line == "detach":
                detached = True
                break
            conn.sendall(f"{self.client_line(client, line)}\n".encode())
        with state.lock:
            state.lost(client, detached)
        if detached:
            with contextlib.suppress(OSError):
                conn.sendall(b"ok\n")

    def client_line(self, client: Client, line: str) -> str:
        with self.state.lock:
            if client.terminated:
                return "error terminated"
            if self.state.is_wedged(client.devices):
                return "error illegal-address"
            if line == "work":
                client.work = True
            elif line == "sync":
                client.work = False
            else:
                return f"error unknown request {line}"
        return "ok"


def control_daemon(
    pipe: Path, root: Path, protocol: int, multiuser: bool, ready_w: int | None
) -> None:
    """Listen on the control socket, write the PID file and serve until quit."""
    if (root / IGNORE_SIGTERM).exists():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state = FakeState(pipe, root, protocol, multiuser)
    daemon = FakeDaemon(state)
    daemon.open(pipe / SOCKET, "", DEFAULT)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    record({"event": "started", "argv": sys.argv[1:], "protocol": protocol})
    if ready_w is not None:
        os.write(ready_w, b"1")
        os.close(ready_w)
    threading.Event().wait()  # until quit ends the process


def refuse_start(pipe: Path, root: Path) -> int | None:
    """Why not to start (an exit status), or None."""
    if (root / FAIL_START).exists():
        print("fake: failing to start on purpose", file=sys.stderr)
        return 1
    if live_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    return None


def foreground(pipe: Path, root: Path, protocol: int, multiuser: bool) -> int:
    refused = refuse_start(pipe, root)
    if refused is not None:
        return refused
    pipe.mkdir(parents=True, exist_ok=True)
    control_daemon(pipe, root, protocol, multiuser, None)
    return 0


def daemonise(pipe: Path, root: Path, protocol: int, multiuser: bool) -> int:
    refused = refuse_start(pipe, root)
    if refused is not None:
        return refused
    pipe.mkdir(parents=True, exist_ok=True)
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
        control_daemon(pipe, root, protocol, multiuser, ready_w)
    finally:
        os._exit(0)
