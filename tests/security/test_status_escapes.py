"""Names in the status view come from pods (namespace, pod and container names, through the
kubelet) and from the GPU backend: the view writes their control characters as escapes, as the
logs do, so that no name can clear the screen, move the cursor or forge a line."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

from deviceplugin.model import NodeSnapshot
from deviceplugin.usage.httpserver import HttpServer
from deviceplugin.usage.metrics import DaemonMetrics
from deviceplugin.usage.statusview import render_status
from tests.unit.test_metrics import CONTAINERS, sample_snapshot
from tests.unit.test_statusview import doc_of

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
FORGED_POD = "web\x1b[2J\x1b[H\nnode evil  GPUs 9/9 healthy\rx\u2028y"


def hostile_snapshot() -> NodeSnapshot:
    first = dataclasses.replace(CONTAINERS[0], pod=FORGED_POD, container="c\x07")
    return sample_snapshot(containers=(first, *CONTAINERS[1:]))


def test_the_view_escapes_control_characters_in_names() -> None:
    doc = doc_of(hostile_snapshot())
    doc["node"] = "node\x1b]0;title\x07"
    doc["gpus"][1]["health_reason"] = "Xid\n79"
    doc["gpus"][0]["model"] = "A100\x1b[31m"
    for height in (None, 12):
        lines = render_status(doc, width=200, height=height)
        assert not any(CONTROL.search(line) for line in lines), lines
        text = "\n".join(lines)
        assert "\\x1b[2J" in text  # shown, as an escape
        assert not any(line.startswith("node evil") for line in lines)


def test_the_status_command_prints_no_control_character_from_a_name() -> None:
    snapshot = hostile_snapshot()
    server = HttpServer(
        "127.0.0.1:0",
        DaemonMetrics("n", lambda: snapshot, version="test"),
        lambda: snapshot,
        lambda: (True, ""),
    )
    server.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "deviceplugin", "status", "--address",
             f"127.0.0.1:{server.port}"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\r" not in result.stdout
    assert "web\\x1b[2J" in result.stdout
    assert not any(line.startswith("node evil") for line in result.stdout.splitlines())
