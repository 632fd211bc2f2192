"""Runs of the MPS control command: each command the control daemon takes is a separate run of
the control command without arguments, with the command on stdin and the daemon's environment,
as `echo quit | nvidia-cuda-mps-control` does. What such a run prints is read up to
OUTPUT_LIMIT_BYTES and for COMMAND_TIMEOUT_S at most (or the timeout the caller gives): past
either, the run is killed and the command counts as failed."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import time
from collections.abc import Mapping

# How long a run of the control command may take and how much it may print.
COMMAND_TIMEOUT_S = 10.0
OUTPUT_LIMIT_BYTES = 64 * 1024


class MpsCommandError(Exception):
    """A run of the control command failed; the message says how."""


class MpsTimeoutError(MpsCommandError):
    """A run of the control command did not finish in time (it was killed)."""


class MpsPathError(MpsCommandError):
    """The MPS directories cannot be made safely: nothing was started, nothing is sent."""


class ControlCommand:
    """The control command (`mps.controlCommand`) and the environment every run of it gets."""

    def __init__(self, command: str, env: Mapping[str, str]) -> None:
        self.command = command
        self.env = dict(env)

    def binary(self) -> str | None:
        """Where the control command is, on the environment's PATH; None when not installed."""
        return shutil.which(self.command, path=self.env.get("PATH"))

    def run(self, args: list[str], stdin: str | None, *, timeout_s: float | None = None) -> str:
        """One run with `args` and `stdin`; what it printed, stripped. Raises MpsCommandError
        (MpsTimeoutError past `timeout_s`, by default COMMAND_TIMEOUT_S)."""
        shown = " ".join([self.command, *args]) + (f" <<< {stdin.strip()}" if stdin else "")
        limit_s = COMMAND_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            code, out, err = run_bounded([self.command, *args], self.env, stdin, limit_s, shown)
        except (FileNotFoundError, PermissionError) as e:
            raise self.not_runnable(e) from e
        if code != 0:
            said = (err or out).strip().splitlines()
            raise MpsCommandError(f"{shown} exited with {code}" + (f": {said[-1]}" if said else ""))
        return out.strip()

    def send(self, command: str, *, timeout_s: float | None = None) -> str:
        """One command on the control daemon's stdin, as `echo <command> | <controlCommand>`."""
        return self.run([], command + "\n", timeout_s=timeout_s)

    def not_runnable(self, e: FileNotFoundError | PermissionError) -> MpsCommandError:
        """Why the control command could not be started, and what to do."""
        if isinstance(e, FileNotFoundError):
            return MpsCommandError(
                f"the MPS control command {self.command!r} is not installed here: give the "
                "daemon the NVIDIA driver's utilities (nvidia-cuda-mps-control) or set "
                "mps.controlCommand"
            )
        return MpsCommandError(f"the MPS control command {self.command!r} is not executable")


def run_bounded(
    argv: list[str], env: Mapping[str, str], stdin: str | None, timeout_s: float, shown: str
) -> tuple[int, str, str]:
    """Run `argv` with `stdin`; its exit status, stdout and stderr, read as `bounded_output`
    does (the process is killed past either bound). Raises MpsCommandError, and
    FileNotFoundError or PermissionError when `argv[0]` cannot be run."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        # The daemon's own umask is 077; the control daemon's socket must be reachable by
        # clients of any user, as when it is started by hand.
        umask=0o022,
    )
    try:
        out, err = bounded_output(proc, (stdin or "").encode(), shown, timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode, out, err


def bounded_output(
    proc: subprocess.Popen[bytes], stdin: bytes, shown: str, timeout_s: float = COMMAND_TIMEOUT_S
) -> tuple[str, str]:
    """Write `stdin`, then read stdout and stderr until both close, at most OUTPUT_LIMIT_BYTES
    together and for `timeout_s`; raises MpsCommandError past either (the caller kills the
    process)."""
    if proc.stdin is None or proc.stdout is None or proc.stderr is None:
        raise MpsCommandError(f"{shown}: its standard streams are not pipes")
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(stdin)
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    deadline = time.monotonic() + timeout_s
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    open_fds = set(chunks)
    total = 0
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MpsTimeoutError(f"{shown} did not finish within {timeout_s:g} s")
        readable, _, _ = select.select(list(open_fds), [], [], left)
        for fd in readable:
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
                continue
            total += len(data)
            if total > OUTPUT_LIMIT_BYTES:
                raise MpsCommandError(
                    f"{shown} printed more than {OUTPUT_LIMIT_BYTES // 1024} KiB; stopped it"
                )
            chunks[fd].append(data)
    try:
        proc.wait(max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired as e:
        raise MpsTimeoutError(f"{shown} did not finish within {timeout_s:g} s") from e
    out = b"".join(chunks[proc.stdout.fileno()]).decode(errors="replace")
    err = b"".join(chunks[proc.stderr.fileno()]).decode(errors="replace")
    return out, err
