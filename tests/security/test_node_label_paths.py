"""A config never writes outside the place meant for it: node labels go only into the features
directory the daemon was started with (VGPU_NODE_FEATURES_DIR), under a name the config chooses,
through a temporary file of a random name that is never a symlink's target, and the daemon
removes only the file it wrote. `serve` runs as a real process on the simulated node."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from deviceplugin.config import parse_config
from deviceplugin.errors import ConfigError
from tests.blackbox.daemon_harness import Node, eventually, registered, serve_args
from tests.blackbox.test_reload import configmap, daemon_with_config, reloads

PRECIOUS = "what the kubelet keeps here\n"


@asynccontextmanager
async def serving(node: Node, config: str) -> AsyncIterator[list[str]]:
    """`serve` with `config` and the features directory node.root/features.d; yields a list
    that holds its stderr once it has stopped (SIGTERM at the end of the block)."""
    path = node.root / "config.yaml"
    path.write_text(config)
    env = {**os.environ, "VGPU_NODE_FEATURES_DIR": str(node.root / "features.d")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deviceplugin", "serve", "--config", str(path),
        *serve_args(node), "--metrics-address", "",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stderr: list[str] = []
    try:
        await registered(node, 8)
        yield stderr
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        stderr.append(err.decode())


def victim(node: Node) -> Path:
    """A host file that is not the daemon's (standing for the kubelet's checkpoint)."""
    path = node.root / "kubelet" / "checkpoint"
    path.parent.mkdir(exist_ok=True)
    path.write_text(PRECIOUS)
    path.chmod(0o600)
    return path


def untouched(path: Path) -> bool:
    return path.read_text() == PRECIOUS and stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_an_old_path_outside_the_features_directory_writes_nothing(node: Node) -> None:
    target = victim(node)
    async with serving(node, f"nodeLabels:\n  path: {target}\n") as stderr:
        await asyncio.sleep(1.5)  # several polls: time enough to write labels
        assert untouched(target)
        assert not (node.root / "features.d").exists()
    assert "node labels are not written: nodeLabels.path names the directory" in stderr[0]
    assert "nodeLabels.file: checkpoint" in stderr[0]


async def test_a_symlink_at_the_temporary_name_is_not_followed(node: Node) -> None:
    target = victim(node)
    features = node.root / "features.d"
    features.mkdir()
    (features / ".vgpu.tmp").symlink_to(target)  # the name the daemon used to write through
    async with serving(node, f"nodeLabels:\n  path: {features}/vgpu\n"):
        await eventually((features / "vgpu").exists, what="the feature file")
        assert "nvidia.com/vgpu.count=8" in (features / "vgpu").read_text()
    assert untouched(target)
    assert (features / ".vgpu.tmp").is_symlink()  # not the daemon's: left alone
    assert sorted(p.name for p in features.iterdir()) == [".vgpu.tmp", "vgpu"]


async def test_a_symlink_at_the_file_name_is_neither_written_through_nor_replaced(
    node: Node,
) -> None:
    """A symlink at the name is not a file vgpu wrote: left in place, its target untouched."""
    target = victim(node)
    features = node.root / "features.d"
    features.mkdir()
    (features / "vgpu").symlink_to(target)
    async with serving(node, "nodeLabels:\n  file: vgpu\n") as stderr:
        await asyncio.sleep(1.0)  # polls enough to have written the labels
    assert untouched(target)
    assert (features / "vgpu").is_symlink()
    assert f"the node feature file {features / 'vgpu'} was not written by vgpu" in stderr[0]
    assert "is a symbolic link" in stderr[0]


async def test_a_file_that_is_no_longer_the_daemons_is_not_deleted(node: Node) -> None:
    """A reload that turns node labels off removes the file only while it is the one the
    daemon wrote: one put there since (by whoever) stays."""
    features = node.root / "features.d"  # the harness's --node-features-dir
    mine = features / "vgpu"
    path = configmap(node.root / "cfg", 1, f"nodeLabels:\n  path: {mine}\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        await eventually(mine.exists, what="the feature file")
        replacement = features / "theirs"
        replacement.write_text("someone.else/label=1\n")
        os.rename(replacement, mine)
        configmap(node.root / "cfg", 2, 'nodeLabels:\n  path: ""\n')
        await eventually(lambda: reloads(daemon, "applied") == 1, what="the reload")
        await asyncio.sleep(0.2)
        assert mine.read_text() == "someone.else/label=1\n"


@pytest.mark.parametrize(
    "name", ["../kubelet.sock", "/var/lib/kubelet/kubelet.sock", "a/b", ".vgpu.tmp", ""]
)
def test_a_file_name_with_a_path_is_refused(name: str) -> None:
    if name == "":
        assert parse_config({"nodeLabels": {"file": name}}).node_labels.file == ""
        return
    with pytest.raises(ConfigError, match=r"nodeLabels\.file"):
        parse_config({"nodeLabels": {"file": name}})


# What GPU feature discovery writes into features.d, standing for any other tool's file.
THEIRS = "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB\nnvidia.com/gpu.count=2\n"


async def test_a_feature_file_another_tool_wrote_is_neither_taken_over_nor_deleted(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """`nodeLabels.file` naming a file that was there before vgpu, and is not vgpu's: vgpu does
    not overwrite it, says so (which file, that it is not vgpu's, what to do), and a reload to
    another name leaves it in place; the new name, free, is written."""
    features = node.root / "features.d"
    features.mkdir()
    theirs = features / "gpu"
    theirs.write_text(THEIRS)
    path = configmap(node.root / "cfg", 1, "nodeLabels:\n  file: gpu\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        await eventually(
            lambda: "node labels are not written: the node feature file" in caplog.text,
            what="the refusal",
        )
        assert theirs.read_text() == THEIRS
        (line,) = {
            r.getMessage() for r in caplog.records if "not written by vgpu" in r.getMessage()
        }
        assert str(theirs) in line
        assert "set nodeLabels.file to another name" in line
        configmap(node.root / "cfg", 2, "nodeLabels:\n  file: vgpu\n")
        await eventually(lambda: reloads(daemon, "applied") == 1, what="the reload")
        await eventually((features / "vgpu").exists, what="vgpu's own file")
        assert theirs.read_text() == THEIRS
    assert "nvidia.com/vgpu.count=8" in (features / "vgpu").read_text()


async def test_vgpus_own_file_is_written_again_after_a_restart(node: Node) -> None:
    """vgpu's file from an earlier run (its header), or from a version before the header (only
    vgpu's own labels in it), is vgpu's: rewritten, not refused."""
    features = node.root / "features.d"
    features.mkdir()
    older = features / "vgpu"
    older.write_text("nvidia.com/vgpu.count=3\nnvidia.com/vgpu.mig-strategy=none\n")
    path = configmap(node.root / "cfg", 1, "nodeLabels:\n  file: vgpu\n")
    async with daemon_with_config(node, path):
        await registered(node, 8)
        await eventually(lambda: "vgpu.count=8" in older.read_text(), what="the file rewritten")
    written = older.read_text()
    async with daemon_with_config(node, path):
        await registered(node, 8)
        node.write_gpus(node.gpus[:1])
        await eventually(lambda: "vgpu.count=4" in older.read_text(), what="rewritten again")
    assert written.startswith("# ")
