"""How soon `serve`, a new process, gives the kubelet its devices: nothing it needs only later
is imported before the first device list, and all of it still comes up right after; /healthz
and /status answer before the kubelet has the devices, as they always did."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import time
import urllib.request

import pytest

from deviceplugin.usage.httpserver import HttpServer
from tests.blackbox.daemon_harness import Node, serve_args

# Imported only after the kubelet has the first device list (the enforcer and psutil, the
# metrics), or never by this `serve` (the Kubernetes API client: no per-node configs; the MPS
# control daemon: MPS off).
LATER = ("deviceplugin.enforcer", "psutil", "prometheus_client", "deviceplugin.usage.metrics")
NEVER = ("deviceplugin.nodeconfig", "lightkube", "httpx2", "deviceplugin.gpu.mps")


async def _serve_until_enforcing(node: Node, path: str = "/healthz") -> tuple[list[str], str]:
    """`serve` under -X importtime (each import's line on stderr as it completes, between the
    log lines), until it has sent its device list, served HTTP and started its enforcer; then
    GET `path` (200 asserted). Its stderr lines, and the body."""
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
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port[1]}{path}")
        assert status == 200, body
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.communicate(), 15)
    return lines, body


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 (loopback)
        return int(answer.status), answer.read().decode()


def _imported(line: str) -> str | None:
    if not line.startswith("import time:") or "|" not in line:
        return None
    return line.rsplit("|", 1)[1].strip()


async def test_serve_lists_its_devices_before_importing_the_enforcer(node: Node) -> None:
    lines, _ = await _serve_until_enforcing(node)
    listed = next(i for i, line in enumerate(lines) if "sending device list" in line)
    before = {_imported(line) for line in lines[:listed]} - {None}
    after = {_imported(line) for line in lines[listed:]} - {None}
    assert "grpc" in before  # the import lines are there at all
    assert not before & {*LATER, *NEVER}, "imported before the first device list"
    assert set(LATER) <= after
    assert not after & set(NEVER)
    enforcing = next(i for i, line in enumerate(lines) if "enforcer started" in line)
    assert listed < enforcing
    serving = next(i for i, line in enumerate(lines) if "http listening" in line)
    assert serving < listed


async def test_serve_answers_a_scrape_with_every_metric_after_a_start_this_lean(
    node: Node,
) -> None:
    _, text = await _serve_until_enforcing(node, "/metrics")
    # The first poll, made before the metrics were, is counted.
    polls = re.search(r"^vgpu_poll_duration_seconds_count\S* (\S+)$", text, re.MULTILINE)
    assert polls is not None, text
    assert float(polls[1]) >= 1
    assert re.search(r'^vgpu_config_reloads_total\{.*result="applied".*\} 0\.0$', text, re.M)


def test_the_http_server_starts_without_asking_dns_for_the_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """http.server looks up the fully qualified name of the host it binds (a reverse DNS query:
    seconds where the node's DNS is not up yet), before the daemon registers; nothing uses it."""

    def stalled(name: str) -> tuple[str, list[str], list[str]]:
        time.sleep(3)
        raise OSError("DNS is not up")

    monkeypatch.setattr(socket, "gethostbyaddr", stalled)
    for address in ("127.0.0.1:0", ":0"):
        server = HttpServer(address, _NoMetrics(), lambda: None, lambda: (True, "ok"))
        started = time.monotonic()
        server.start()
        try:
            assert time.monotonic() - started < 1.0
            assert _get(f"http://127.0.0.1:{server.port}/healthz") == (200, "ok\n")
        finally:
            server.stop()


class _NoMetrics:
    def render(self, accept: str = "") -> tuple[bytes, str]:
        return b"", "text/plain"
