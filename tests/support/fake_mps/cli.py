"""The fake's command line: what `nvidia-cuda-mps-control` does with its arguments."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from tests.support.fake_mps.client import run_canary, run_client
from tests.support.fake_mps.daemon import SOCKET, daemonise, foreground
from tests.support.fake_mps.records import directories, record

V2_ONLY = "fake-v2-only"
FLOOD = "fake-flood"
HELP_V2 = """Usage: nvidia-cuda-mps-control [-d | -f] [-h]
Commands: get_server_list, get_client_list, terminate_client, quit,
set_default_active_thread_percentage, set_default_device_pinned_mem_limit, ..."""
HELP_V3 = """Usage: nvidia-cuda-mps-control [-d | -f] [-m] [-a <config>] [-p <protocol>] [-h]
Modules: server, namespace, client, device, sm-partition, feature, memacct, context-share"""


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
    errors = [line for line in out.splitlines() if line.startswith("!error")]
    if errors:
        print("\n".join(e.removeprefix("!") for e in errors), file=sys.stderr)
        return 1
    if out:
        print(out)
    return 0


def protocol_of(argv: list[str]) -> int:
    """The protocol asked for: CUDA_MPS_PROTOCOL_VERSION wins over `-p`; 2 by default."""
    env = os.environ.get("CUDA_MPS_PROTOCOL_VERSION")
    if env:
        return int(env)
    if "-p" in argv and argv.index("-p") + 1 < len(argv):
        return int(argv[argv.index("-p") + 1])
    return 2


def main(argv: list[str]) -> int:
    pipe, _ = directories()
    root = pipe.parent
    if argv[:1] == ["client"]:
        return run_client("--work" in argv)
    if argv[:1] == ["canary"]:
        return run_canary()
    env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
    if not argv:
        text = sys.stdin.read()
        record({"event": "run", "argv": argv, "env": env, "stdin": text})
        if (root / FLOOD).exists():
            line = b"x" * 1023 + b"\n"
            for _ in range(400 * 1024):
                sys.stdout.buffer.write(line)
            return 0
        return send(pipe, text)
    record({"event": "run", "argv": argv, "env": env})
    protocol = protocol_of(argv)
    if protocol == 3 and (root / V2_ONLY).exists():
        print("Unrecognized option or protocol version 3 not supported", file=sys.stderr)
        return 1
    if protocol not in (2, 3):
        print(f"Unsupported protocol version {protocol}", file=sys.stderr)
        return 1
    flags = [a for a in argv if a not in ("-p", "3", "2", "-m")]
    if flags == ["-h"]:
        print(HELP_V3 if protocol == 3 else HELP_V2)
        return 0
    if flags == ["-d"]:
        return daemonise(pipe, root, protocol, "-m" in argv)
    if flags == ["-f"]:
        return foreground(pipe, root, protocol, "-m" in argv)
    print(f"fake: unsupported arguments {argv}", file=sys.stderr)
    return 2
