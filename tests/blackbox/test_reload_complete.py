"""A live reload applies only a complete config (docs/running.md, "Live reload"): a file being
written in place is applied once it has settled, an empty file is refused while the daemon runs,
and a refused content is said once, however busy its directory."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from deviceplugin.config import Config
from deviceplugin.reload import read_config
from tests.blackbox.daemon_harness import RESOURCE, Node, eventually, registered
from tests.blackbox.test_reload import FAST, daemon_with_config, reloads, running_hash

REFUSED = "config reload refused: "


def refused_gauge(node_daemon: object) -> float | None:
    registry = node_daemon.metrics.registry  # type: ignore[attr-defined]
    value: float | None = registry.get_sample_value("vgpu_config_refused", {"node": "test-node"})
    return value


def summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The one line each refusal ends with."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(REFUSED) and "keeping the running config" in r.getMessage()
    ]


async def test_a_file_written_in_place_is_applied_once_it_is_whole(node: Node) -> None:
    path = node.root / "config.yaml"
    path.write_text(FAST + "slicing:\n  replicas: 2\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 4)
        # `>` then two writes 0.1 s apart: the first half is itself a valid config (the
        # defaults' 4 replicas), which must never be applied.
        with path.open("w") as f:
            f.write(FAST)
            f.flush()
            await asyncio.sleep(0.1)
            f.write("slicing:\n  replicas: 3\n")
        await registered(node, 6)
        await asyncio.sleep(1.0)  # past the settling time: nothing more is applied
        assert reloads(daemon, "applied") == 1
        assert reloads(daemon, "refused") == 0
        assert len(node.sim.devices(RESOURCE)) == 6


async def test_an_empty_file_is_refused_while_the_daemon_runs(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    path = node.root / "config.yaml"
    path.write_text(FAST + "slicing:\n  replicas: 2\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 4)
        before = running_hash(daemon)
        path.write_text("# being rewritten\n")
        await eventually(lambda: reloads(daemon, "refused") == 1, what="the empty file refused")
        assert any("is empty" in m and "write {}" in m for m in summaries(caplog) + _all(caplog))
        assert refused_gauge(daemon) == 1
        assert running_hash(daemon) == before
        assert len(node.sim.devices(RESOURCE)) == 4
        # `{}` asks for the built-in defaults: 4 slices a GPU.
        path.write_text("{}\n")
        await registered(node, 8)
        assert reloads(daemon, "applied") == 1
        assert refused_gauge(daemon) == 0


def _all(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


async def test_a_refused_config_is_said_once_however_busy_its_directory(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="deviceplugin.reload")
    path = node.root / "config.yaml"
    path.write_text(FAST + "slicing:\n  replicas: 2\n")
    async with daemon_with_config(node, path) as (daemon, hangup):
        await registered(node, 4)
        path.write_text(FAST + "slicing:\n  replicas: 0\n")
        await eventually(lambda: reloads(daemon, "refused") == 1, what="the refusal")
        # A log file beside the config: every line it gets is an event in the directory.
        log_file = node.root / "daemon.log"
        with log_file.open("a") as f:
            for i in range(300):
                f.write(f"line {i}\n")
                f.flush()
                if i % 50 == 0:
                    await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        assert len(summaries(caplog)) == 1
        assert reloads(daemon, "refused") == 1
        assert refused_gauge(daemon) == 1
        # SIGHUP asks for it: said again.
        hangup.set()
        await eventually(lambda: len(summaries(caplog)) == 2, what="the refusal said again")
        # The running config again: nothing refused any more.
        path.write_text(FAST + "slicing:\n  replicas: 2\n")
        await eventually(lambda: refused_gauge(daemon) == 0, what="the gauge back to 0")
        assert reloads(daemon, "applied") == 0


def test_serve_takes_an_empty_file_at_start_for_the_defaults(tmp_path: Path) -> None:
    """At start an empty file is the built-in defaults, as it always was."""
    path = tmp_path / "config.yaml"
    path.write_text("")
    assert read_config(path).config == Config()
