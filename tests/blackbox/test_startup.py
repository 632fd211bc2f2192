"""How soon `serve`, a new process, gives the kubelet its devices: nothing it needs only later
is imported before the first device list, and all of it still comes up right after."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request

from tests.blackbox.daemon_harness import Node, serve_args

# Imported only after the kubelet has the first device list (the enforcer and psutil), or never
# by this `serve` (the Kubernetes API client: no per-node configs; the MPS control daemon: MPS
# off).
LATER = ("deviceplugin.enforcer", "psutil")
NEVER = ("deviceplugin.nodeconfig", "lightkube", "httpx2", "deviceplugin.gpu.mps")


async def _serve_until_enforcing(node: Node) -> list[str]:
    """`serve` under -X importtime (each import's line on stderr as it completes, between the
    log lines), until it has sent its device list, served HTTP and started its enforcer (and
    /healthz says ok); its stderr lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "importtime", "-m", "deviceplugin", "serve",
        *serve_args(node), "--metrics-address", "127.0.0.1:0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        marks = ("sending device list", "http listening", "enforcer started")
        while not all(any(mark in line for line in lines) for mark in marks):
            left = deadline - time.monotonic()
            line = await asyncio.wait_for(proc.stderr.readline(), max(left, 0.1))
            if not line:
                raise AssertionError("serve exited before it was up:\n" + "".join(lines))
            lines.append(line.decode(errors="replace"))
        port = re.search(r"http listening .* port=(\d+)", "".join(lines))
        assert port is not None, "".join(lines)
        assert await asyncio.to_thread(_status, f"http://127.0.0.1:{port[1]}/healthz") == 200
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.communicate(), 15)
    return lines


def _status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 (loopback)
        return int(answer.status)


def _imported(line: str) -> str | None:
    if not line.startswith("import time:") or "|" not in line:
        return None
    return line.rsplit("|", 1)[1].strip()


async def test_serve_lists_its_devices_before_importing_the_enforcer(node: Node) -> None:
    lines = await _serve_until_enforcing(node)
    listed = next(i for i, line in enumerate(lines) if "sending device list" in line)
    before = {_imported(line) for line in lines[:listed]} - {None}
    after = {_imported(line) for line in lines[listed:]} - {None}
    assert "grpc" in before  # the import lines are there at all
    assert not before & {*LATER, *NEVER}, "imported before the first device list"
    assert set(LATER) <= after
    assert not after & set(NEVER)
    enforcing = next(i for i, line in enumerate(lines) if "enforcer started" in line)
    assert listed < enforcing
