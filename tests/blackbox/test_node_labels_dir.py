"""`serve --node-features-dir DIR --node-features-file vgpu` (env VGPU_NODE_FEATURES_DIR and
VGPU_NODE_FEATURES_FILE, which the chart and the kustomize install set): the feature file goes
into DIR without any key in the config file, and stays across a reload of a config that has none
either."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.blackbox.daemon_harness import Node, eventually, registered, serve_args
from tests.blackbox.test_node_labels import read_labels


def file_has(path: Path, key: str, value: str) -> bool:
    try:
        return read_labels(path).get(key) == value
    except FileNotFoundError:
        return False


async def test_the_feature_file_goes_into_the_directory_and_survives_a_reload(
    node: Node,
) -> None:
    features = node.root / "features.d"
    features.mkdir()
    config = node.root / "config.yaml"
    config.write_text("enforcement:\n  pollInterval: 50ms\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve", *serve_args(node),
        "--config", str(config), "--metrics-address", "127.0.0.1:0",
        "--node-features-dir", str(features), "--node-features-file", "vgpu",
        "--trust-host-processes",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await registered(node, 8)
        await eventually(lambda: file_has(features / "vgpu", "nvidia.com/vgpu.count", "8"))
        # A new config, still without nodeLabels: the file follows it and stays where it is.
        config.write_text("enforcement:\n  pollInterval: 50ms\nslicing:\n  replicas: 2\n")
        process.send_signal(signal.SIGHUP)
        await eventually(lambda: file_has(features / "vgpu", "nvidia.com/vgpu.count", "4"))
        assert sorted(os.listdir(features)) == ["vgpu"]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), 20)
        except TimeoutError:
            process.kill()
            await process.communicate()
            raise
    assert process.returncode == 0, stderr.decode()
