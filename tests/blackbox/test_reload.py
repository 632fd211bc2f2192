"""Live reload of the config, as an operator does it: a ConfigMap update (the kubelet swaps the
volume's `..data` symlink), SIGHUP to the process, or an edit of the file; with pods holding
slices across it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import re
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from deviceplugin.app import Daemon
from deviceplugin.check import check_config
from deviceplugin.gpu.fake import FakeBackend
from deviceplugin.plugin.lifecycle import PluginLifecycle
from deviceplugin.reload import config_hash, read_config
from deviceplugin.sim.kubelet import AdmissionError
from tests.blackbox.daemon_harness import (
    RESOURCE,
    Node,
    eventually,
    gpu,
    plugins,
    registered,
    serve_args,
)
from tests.blackbox.test_cli import CLI
from tests.blackbox.test_mig import LAYOUT, MIG_1G, MIG_3G, mig_gpu

GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
FAST = "enforcement:\n  pollInterval: 50ms\n"


def configmap(root: Path, version: int, content: str) -> Path:
    """Write `content` as the kubelet writes a ConfigMap volume: a new timestamped directory,
    then an atomic swap of the `..data` symlink. Returns the path the daemon reads."""
    root.mkdir(exist_ok=True)
    target = root / f"..2026_12_01_00_00_0{version}.000000000"
    target.mkdir()
    (target / "config.yaml").write_text(content)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.rename(tmp, root / "..data")
    if not (root / "config.yaml").is_symlink():
        (root / "config.yaml").symlink_to("..data/config.yaml")
    if old is not None:
        (root / old / "config.yaml").unlink()
        (root / old).rmdir()
    return root / "config.yaml"


@contextlib.asynccontextmanager
async def daemon_with_config(
    node: Node,
    path: Path,
    *,
    prepare: Callable[[Daemon], None] = lambda daemon: None,
) -> AsyncIterator[tuple[Daemon, asyncio.Event]]:
    """The daemon, started on the config at `path` as `serve --config` starts it; yields it and
    the event SIGHUP sets."""
    loaded = read_config(path)
    settings = dataclasses.replace(
        node.settings(loaded.config), config_path=path, config_hash=loaded.hash
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend, pod_resources_interval_s=0.2)
    prepare(daemon)
    stop, hangup = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, hangup))
    try:
        yield daemon, hangup
        assert not task.done(), f"daemon exited early: {task}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


def reloads(daemon: Daemon, result: str) -> float:
    value = daemon.metrics.registry.get_sample_value(
        "vgpu_config_reloads_total", {"node": "test-node", "result": result}
    )
    assert value is not None, f"vgpu_config_reloads_total{{result={result!r}}} is not exposed"
    return value


def running_hash(daemon: Daemon) -> str:
    text = daemon.metrics.render()[0].decode()
    hashes = re.findall(r'^vgpu_config_info\{.*hash="([0-9a-f]+)".*\} 1\.0$', text, re.M)
    assert len(hashes) == 1, text
    return str(hashes[0])


async def test_a_configmap_update_reslices_with_a_pod_holding_slices_across_it(
    node: Node,
) -> None:
    path = configmap(node.root / "cfg", 1, FAST + "slicing:\n  replicas: 4\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        assert reloads(daemon, "applied") == 0
        assert reloads(daemon, "refused") == 0
        assert running_hash(daemon) == read_config(path).hash
        # pack puts all four slices on GPU 0.
        pod = await node.sim.admit_pod("held", [("c", 4)])
        held = set(pod.containers[0].device_ids)
        assert held == {f"{GPU0}::{n}" for n in range(4)}

        configmap(node.root / "cfg", 2, FAST + "slicing:\n  replicas: 2\n")
        sim = node.sim
        # GPU 0's slices ::2 and ::3 are gone from the plan but held: advertised Unhealthy.
        await sim.wait_for(lambda: sim.unhealthy_ids(RESOURCE) == {f"{GPU0}::2", f"{GPU0}::3"})
        assert len(sim.healthy_ids(RESOURCE)) == 4  # two per GPU
        # Counted once every part has followed (the kubelet may see the new plan before).
        await eventually(lambda: reloads(daemon, "applied") == 1, what="the reload counted")
        assert running_hash(daemon) == read_config(path).hash
        # The allocation is still known (by its pod, from pod-resources), and the pod still
        # holds what it was given.
        allocation = pod.containers[0].envs["VGPU_ALLOCATION_ID"]
        await eventually(
            lambda: getattr(daemon.book.get(allocation), "pod", "") == "held",
            what="pod-resources to list the pod",
        )
        still = sim.get_pod("default", "held")
        assert still is not None
        assert set(still.containers[0].device_ids) == held

        # Once the kubelet frees them, the dropped slices leave the device list.
        await sim.delete_pod("default", "held")
        await sim.wait_for(
            lambda: not sim.unhealthy_ids(RESOURCE) and len(sim.devices(RESOURCE)) == 4
        )
        after = await sim.admit_pod("after", [("c", 2)])
        assert set(after.containers[0].device_ids) == {f"{GPU0}::0", f"{GPU0}::1"}


async def test_a_change_made_between_reading_the_config_and_watching_it_is_applied(
    node: Node,
) -> None:
    """`serve` reads its config, registers, then starts the watch: a ConfigMap update that lands
    in between is found when the watch starts, not left until the next change."""
    path = configmap(node.root / "cfg", 1, FAST + "slicing:\n  replicas: 4\n")
    read = read_config(path)
    configmap(node.root / "cfg", 2, FAST + "slicing:\n  replicas: 2\n")
    settings = dataclasses.replace(
        node.settings(read.config), config_path=path, config_hash=read.hash
    )
    backend = FakeBackend(node.state_file)
    daemon = Daemon(settings, backend, pod_resources_interval_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, asyncio.Event()))
    try:
        await registered(node, 4)
        assert reloads(daemon, "applied") == 1
        assert running_hash(daemon) == read_config(path).hash
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def test_an_invalid_config_is_refused_with_check_configs_messages_and_the_old_one_kept(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    path = configmap(node.root / "cfg", 1, FAST + "slicing:\n  replicas: 2\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 4)
        before = running_hash(daemon)
        bad = FAST + "slicing:\n  replicas: 0\n  memoryPerSlice: lots\n"
        caplog.set_level(logging.ERROR, logger="deviceplugin.reload")
        configmap(node.root / "cfg", 2, bad)
        await eventually(lambda: reloads(daemon, "refused") == 1, what="the refusal")
        # The same messages check-config prints for that file.
        err = io.StringIO()
        assert check_config(path, "", io.StringIO(), err) == 2
        logged = [r.getMessage() for r in caplog.records]
        for line in err.getvalue().splitlines():
            assert any(line in message for message in logged), (line, logged)
        # The running config stays: same plan, same hash, nothing applied.
        await asyncio.sleep(0.3)
        assert len(node.sim.healthy_ids(RESOURCE)) == 4
        assert running_hash(daemon) == before
        assert reloads(daemon, "applied") == 0
        # A good config after the bad one is applied.
        configmap(node.root / "cfg", 3, FAST + "slicing:\n  replicas: 3\n")
        await registered(node, 6)
        assert reloads(daemon, "applied") == 1


async def test_a_plan_too_large_for_the_kubelet_is_refused_and_the_old_one_kept(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    path = configmap(node.root / "cfg", 1, FAST + "slicing:\n  replicas: 2\n")
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 4)
        before = running_hash(daemon)
        # Valid on its own, but 64Mi slices make 1280 on the 80 GiB GPU: over the bound per GPU.
        too_many = FAST + "slicing:\n  memoryPerSlice: 64Mi\n"
        caplog.set_level(logging.ERROR, logger="deviceplugin.reload")
        configmap(node.root / "cfg", 2, too_many)
        await eventually(lambda: reloads(daemon, "refused") == 1, what="the refusal")
        # The message check-config prints for that file on this node's GPUs.
        err = io.StringIO()
        assert check_config(path, f"fake:{node.state_file}", io.StringIO(), err) == 2
        problem = err.getvalue().splitlines()[0]
        assert "slicing.memoryPerSlice" in problem
        assert "1024" in problem
        logged = [r.getMessage() for r in caplog.records]
        assert any(problem in message for message in logged), (problem, logged)
        # The running config stays: same plan, same hash, nothing applied, polls go on.
        polls = daemon.poller.failures
        await asyncio.sleep(0.3)
        assert daemon.poller.failures == polls
        assert len(node.sim.healthy_ids(RESOURCE)) == 4
        assert running_hash(daemon) == before
        assert reloads(daemon, "applied") == 0
        # A config that fits after the refused one is applied.
        configmap(node.root / "cfg", 3, FAST + "slicing:\n  replicas: 3\n")
        await registered(node, 6)
        assert reloads(daemon, "applied") == 1


async def test_a_renamed_resource_registers_again_under_its_new_name(node: Node) -> None:
    path = configmap(node.root / "cfg", 1, FAST)
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        registrations = plugins(daemon).lifecycle.stats.registrations
        configmap(node.root / "cfg", 2, FAST + "resourceName: example.com/gpu-share\n")
        await registered(node, 8, resource="example.com/gpu-share")
        assert not node.plugin_socket(RESOURCE).exists()
        assert node.plugin_socket("example.com/gpu-share").exists()
        # The registration counter carries on; it does not start again from zero.
        assert plugins(daemon).lifecycle.stats.registrations == registrations + 1
        pod = await node.sim.admit_pod("p", [("c", 1)], resource_name="example.com/gpu-share")
        assert pod.containers[0].envs["VGPU_ALLOCATION_ID"]


async def test_a_rename_keeps_held_slices_known_and_offers_them_under_no_name(
    node: Node,
) -> None:
    renamed = "example.com/gpu-share"
    path = configmap(node.root / "cfg", 1, FAST)
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        held = (await node.sim.admit_pod("held", [("c", 2)])).containers[0]
        allocation = held.envs["VGPU_ALLOCATION_ID"]
        await eventually(
            lambda: (r := daemon.book.get(allocation)) is not None and r.pod == "held",
            what="the pod named",
        )
        configmap(node.root / "cfg", 2, FAST + f"resourceName: {renamed}\n")
        await registered(node, 8, resource=renamed)
        # The held slices are listed under the new name, but not as free.
        await node.sim.wait_for(
            lambda: node.sim.unhealthy_ids(renamed) == set(held.device_ids),
            what="the held slices unhealthy under the new name",
        )
        assert node.sim.allocatable(renamed) == 6
        with pytest.raises(AdmissionError, match="Available: 6"):
            await node.sim.admit_pod("greedy", [("c", 7)], resource_name=renamed)
        others = (await node.sim.admit_pod("others", [("c", 6)], resource_name=renamed)).containers
        assert not set(others[0].device_ids) & set(held.device_ids)
        # Still known, with the name it was made under, after pod-resources was asked again.
        seen = plugins(daemon).tracker.refreshes
        await eventually(lambda: plugins(daemon).tracker.refreshes >= seen + 2, what="refreshes")
        record = daemon.book.get(allocation)
        assert record is not None
        assert record.resource_name == RESOURCE
        [listed] = [r for r in daemon.book if r.allocation_id == allocation]
        assert listed.retired_resource
        # Freed by the kubelet: offered again, under the new name.
        await node.sim.delete_pod("default", "held")
        await node.sim.wait_for(
            lambda: node.sim.healthy_ids(renamed) >= set(held.device_ids),
            timeout_s=10,
            what="the freed slices healthy under the new name",
        )
        assert daemon.book.get(allocation) is None


async def test_sighup_with_unchanged_content_applies_nothing(node: Node) -> None:
    path = configmap(node.root / "cfg", 1, FAST)
    async with daemon_with_config(node, path) as (daemon, hangup):
        await registered(node, 8)
        hangup.set()
        await eventually(lambda: not hangup.is_set(), what="the reload")
        await asyncio.sleep(0.2)
        assert reloads(daemon, "applied") == 0
        assert reloads(daemon, "refused") == 0
        assert plugins(daemon).lifecycle.stats.registrations == 1


async def test_enforcement_settings_are_applied_to_a_new_enforcer(node: Node) -> None:
    path = configmap(node.root / "cfg", 1, FAST)
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 8)
        first = daemon.enforcer
        assert first is not None
        assert first.config.compute.period_s == 0.25
        configmap(node.root / "cfg", 2, FAST + "  compute:\n    period: 100ms\n")
        await eventually(
            lambda: (
                daemon.enforcer is not first
                and daemon.enforcer is not None
                and daemon.enforcer.config.compute.period_s == 0.1
            ),
            what="the new enforcer",
        )
        assert daemon.config.enforcement.compute.period_s == 0.1


# --- the process, as `serve` runs it --------------------------------------------------------


async def test_sighup_reloads_serve_without_stopping_it(node: Node) -> None:
    """SIGHUP alone: the file is rewritten through a hard link in another directory, so that
    the watch on the config's own directory sees nothing and only the signal can bring it in."""
    (node.root / "cfg").mkdir()
    (node.root / "elsewhere").mkdir()
    path = node.root / "cfg" / "config.yaml"
    path.write_text(FAST)
    os.link(path, node.root / "elsewhere" / "config.yaml")
    log = node.root / "serve.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "serve",
            "--config",
            str(path),
            *serve_args(node),
            "--metrics-address",
            "127.0.0.1:0",
            stderr=stderr,
        )
    try:
        await registered(node, 8)
        pod = await node.sim.admit_pod("held", [("c", 1)])
        # serve starts the watch after its first device list; a change before it would be
        # applied when it starts.
        await eventually(
            lambda: "watching the config for changes" in log.read_text(), what="the config watch"
        )
        # Written in place, as the other link sees it: the inode the config's path names.
        (node.root / "elsewhere" / "config.yaml").write_text(FAST + "slicing:\n  replicas: 2\n")
        await asyncio.sleep(0.5)
        assert len(node.sim.devices(RESOURCE)) == 8, "reloaded without being asked"
        proc.send_signal(signal.SIGHUP)
        await registered(node, 4)
        assert proc.returncode is None
        assert node.sim.get_pod("default", "held") == pod
        text = log.read_text()
        new_hash = config_hash(path.read_bytes())
        assert f"config reloaded hash={new_hash}" in text
        assert "trigger=SIGHUP" in text
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
        assert proc.returncode == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_plugin_notices_every_kubelet_event_without_inotify(node: Node) -> None:
    """The poll fallback, where inotify is unavailable: a kubelet restart, our socket deleted,
    and our socket replaced each lead to a new registration."""
    path = configmap(node.root / "cfg", 1, FAST)

    def polling(daemon: Daemon) -> None:
        plugins(daemon).lifecycle = PluginLifecycle(
            plugins(daemon).service,
            plugin_dir=node.plugin_dir,
            resource_name=RESOURCE,
            watch_interval_s=0.05,
            use_inotify=False,
        )

    async with daemon_with_config(node, path, prepare=polling) as (daemon, _):
        sim = node.sim
        await registered(node, 8)
        assert plugins(daemon).lifecycle.watch_mode == "poll"

        async def registers_again(event: Callable[[], object], reason: str) -> None:
            before = plugins(daemon).lifecycle.stats.registrations
            result = event()
            if asyncio.iscoroutine(result):
                await result
            await eventually(
                lambda: (
                    plugins(daemon).lifecycle.stats.registrations > before
                    and sim.is_registered(RESOURCE)
                ),
                what=f"a registration after: {reason}",
            )
            await registered(node, 8)

        await registers_again(sim.restart, "kubelet restart")
        await registers_again(node.plugin_socket().unlink, "our socket deleted")
        assert (
            plugins(daemon).lifecycle.stats.last_restart_reason
            == "plugin socket removed (kubelet restart)"
        )

        def replace_socket() -> None:
            other = node.plugin_dir / "impostor.sock"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(other))
            sock.close()
            os.rename(other, node.plugin_socket())

        await registers_again(replace_socket, "our socket replaced")


async def test_sighup_without_a_config_file_keeps_serving_and_says_why(node: Node) -> None:
    log = node.root / "serve.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "serve",
            *serve_args(node),
            "--metrics-address",
            "127.0.0.1:0",
            stderr=stderr,
            env={**os.environ, "VGPU_CONFIG": ""},
        )
    try:
        await registered(node, 8)
        proc.send_signal(signal.SIGHUP)
        await eventually(
            lambda: "no config file to reload" in log.read_text(), what="the SIGHUP warning"
        )
        assert proc.returncode is None
        assert node.sim.is_registered(RESOURCE)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
    assert proc.returncode == 0, log.read_text()


async def test_a_reload_to_the_mixed_mig_strategy_registers_the_profiles_and_moves_the_labels(
    node: Node,
) -> None:
    """mig.strategy none -> mixed: each MIG profile registers as its own resource, the node
    labels say the new strategy (at the new path; the old file goes) and still count only
    resourceName's slices. Back to none: a profile whose slice a pod holds stays, Unhealthy,
    until the pod ends; the other goes at once."""
    node.write_gpus([gpu(0, name="NVIDIA L4", memory_gib=24), mig_gpu(1, *LAYOUT)])
    features = node.root / "features.d"  # the daemon's --node-features-dir
    old_labels, new_labels = features / "vgpu-a", features / "vgpu-b"
    path = configmap(
        node.root / "cfg", 1, FAST + "nodeLabels:\n  file: vgpu-a\nmig:\n  strategy: none\n"
    )
    sim = node.sim
    async with daemon_with_config(node, path) as (daemon, _):
        await registered(node, 4)  # the L4; the MIG GPU is left out
        await eventually(
            lambda: read_labels(old_labels).get("nvidia.com/vgpu.mig-strategy") == "none",
            what="the first feature file",
        )
        assert not node.plugin_socket(MIG_1G).exists()

        mixed = "nodeLabels:\n  file: vgpu-b\nmig:\n  strategy: mixed\n"
        configmap(node.root / "cfg", 2, FAST + mixed)
        await registered(node, 2, MIG_1G)
        await registered(node, 1, MIG_3G)
        assert set(sim.devices(MIG_1G)) == {f"{d.uuid}::0" for d in LAYOUT[1:]}
        assert len(sim.devices(RESOURCE)) == 4  # the full GPU's slices, as before
        # Counted once every part has followed (the kubelet may see the new plan before).
        await eventually(lambda: reloads(daemon, "applied") == 1, what="the reload counted")
        want = {
            "nvidia.com/vgpu.count": "4",  # resourceName's slices, not the MIG profiles'
            "nvidia.com/vgpu.replicas": "4",
            "nvidia.com/vgpu.memory-per-slice-mib": str(24 * 1024 // 4),
            "nvidia.com/vgpu.product": "NVIDIA-L4",
            "nvidia.com/vgpu.mig-strategy": "mixed",
            "nvidia.com/vgpu.memory-enforcement": "poll",  # memory limits are off here
        }
        await eventually(lambda: read_labels(new_labels) == want, what="the new feature file")
        assert not old_labels.exists()

        pod = await sim.admit_pod("p", [("c", 1)], resource_name=MIG_1G)
        (held,) = pod.containers[0].device_ids
        await eventually(lambda: [r.pod for r in daemon.book] == ["p"], what="allocation named")
        configmap(node.root / "cfg", 3, FAST + mixed.replace("mixed", "none"))
        await eventually(
            lambda: not node.plugin_socket(MIG_3G).exists(), what="the 3g.40gb endpoint gone"
        )
        await sim.wait_for(lambda: sim.unhealthy_ids(MIG_1G) == {held}, timeout_s=10)
        assert set(sim.devices(MIG_1G)) == {held}
        await sim.delete_pod("default", "p")
        await eventually(
            lambda: not node.plugin_socket(MIG_1G).exists(), what="the 1g.10gb endpoint gone"
        )
        assert len(sim.devices(RESOURCE)) == 4


def read_labels(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if line.strip() and line[0] != "#")
