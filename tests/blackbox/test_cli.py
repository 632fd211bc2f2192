"""The command line as an operator meets it: real processes, real signals, real exit codes."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deviceplugin.gpu.fake import FakeState, write_state_file
from tests.blackbox.daemon_harness import RESOURCE, TWO_GPUS, Node, registered, serve_args

CLI = [sys.executable, "-m", "deviceplugin"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def _serve(node: Node, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        *serve_args(node),
        "--metrics-address",
        "127.0.0.1:0",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_serve_stops_cleanly_on_signal_and_removes_its_socket(
    node: Node, sig: signal.Signals
) -> None:
    proc = await _serve(node)
    try:
        await registered(node, 8)
        assert node.plugin_socket().exists()
        proc.send_signal(sig)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()
    assert not node.plugin_socket().exists()
    assert b"registered with the kubelet" in stderr


async def test_serve_reads_its_flags_from_the_environment(node: Node) -> None:
    env = {
        **os.environ,
        "VGPU_BACKEND": f"fake:{node.state_file}",
        "VGPU_DEVICE_PLUGIN_DIR": str(node.plugin_dir),
        "VGPU_POD_RESOURCES_SOCKET": str(node.podres_socket),
        "VGPU_STATE_DIR": str(node.root / "state"),
        "VGPU_METRICS_ADDRESS": "127.0.0.1:0",
    }
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        "--log-format",
        "json",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await registered(node, 8)
        proc.terminate()
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    first = stderr.decode().splitlines()[0]
    assert first.startswith("{")
    assert '"level": "INFO"' in first


def test_serve_with_a_missing_state_file_exits_2_naming_it(short_tmp: Path) -> None:
    missing = short_tmp / "nope.json"
    result = run_cli("serve", "--backend", f"fake:{missing}", "--device-plugin-dir", str(short_tmp))
    assert result.returncode == 2
    assert str(missing) in result.stderr


def test_serve_with_an_invalid_config_exits_2_naming_the_key(short_tmp: Path) -> None:
    config = short_tmp / "config.yaml"
    config.write_text("version: v1\nslicing:\n  replicas: zero\n")
    result = run_cli("serve", "--config", str(config), "--backend", "fake:/dev/null")
    assert result.returncode == 2
    assert "slicing.replicas" in result.stderr


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver"
)
def test_serve_on_nvml_without_a_driver_says_what_to_do(short_tmp: Path) -> None:
    result = run_cli("serve", "--backend", "nvml", "--device-plugin-dir", str(short_tmp))
    assert result.returncode == 2
    assert "fake:" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one line, with the hint


def test_check_config_prints_the_plan(short_tmp: Path) -> None:
    config = short_tmp / "config.yaml"
    config.write_text(
        "version: v1\nslicing:\n  replicas: 2\n  overrides:\n"
        "  - match: {model: '*A100*'}\n    memoryPerSlice: 10Gi\n"
    )
    result = run_cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "valid" in out
    a100 = next(line for line in out.splitlines() if "A100" in line)
    assert a100.split()[-3:] == ["8", "10Gi", "12.5%"]
    l4 = next(line for line in out.splitlines() if " L4 " in line)
    assert l4.split()[-2:-1] == ["2"] or "2" in l4.split()
    assert "total: 10 slices" in out


def test_check_config_shows_the_hints_and_the_mps_commands(short_tmp: Path) -> None:
    config = short_tmp / "config.yaml"
    config.write_text("allocation: {contextReserve: 1Gi}\nmps: {enabled: true, root: /run/m}\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "MPS on, framework hints on (context reserve 1Gi)" in out
    # The demo's GPUs in 4 slices: (20Gi - 1Gi) / 80Gi and (5758Mi - 1Gi) / 22.5Gi.
    assert "  GPU 0 0.23, GPU 1 0.20  (XLA_PYTHON_CLIENT_MEM_FRACTION" in out
    assert "pipe /run/m/pipe, log /run/m/log" in out
    assert "set_default_active_thread_percentage 25" in out
    assert (
        "set_default_device_pinned_mem_limit GPU-9b2e4d6f-8a1c-4b3d-9e5f-a7b8c9d00002 5758M" in out
    )
    config.write_text("allocation: {frameworkHints: false}\n")
    out = run_cli("check-config", str(config)).stdout
    assert "framework hints off" in out
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in out
    assert "MPS:" not in out


def test_check_config_against_a_backend(short_tmp: Path) -> None:
    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    config = short_tmp / "config.yaml"
    config.write_text("version: v1\nslicing:\n  replicas: 3\n")
    result = run_cli("check-config", str(config), "--backend", f"fake:{state}")
    assert result.returncode == 0, result.stderr
    assert "total: 6 slices of nvidia.com/vgpu on 2 of 2 GPUs" in result.stdout


def test_check_config_checks_the_dra_slice_of_the_example_l4(short_tmp: Path) -> None:
    # The example node's L4 has NVML's 23034Mi, not a multiple of the 256Mi step.
    config = short_tmp / "config.yaml"
    config.write_text("mig: {strategy: mixed}\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    assert "DRA mode: the ResourceSlice of these 5 devices passes the API server's rules" in (
        result.stdout
    )
    # 12Gi as the least a claim may take: more than a 1g.10gb MIG device holds.
    config.write_text("mig: {strategy: mixed}\ndra: {memory: {min: 12Gi}}\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    mig = [line for line in lines if "gpu-2-mig-9-0" in line]
    assert any("capacity[memory].requestPolicy.validRange.min" in line for line in mig), lines
    assert all("dra.memory" in line for line in mig)
    assert "invalid for these GPUs in DRA mode" in lines[-1]


def test_check_config_reports_every_error_and_exits_2(short_tmp: Path) -> None:
    config = short_tmp / "config.yaml"
    config.write_text("version: v2\nslicing:\n  replicas: -1\nbogus: 1\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 2
    for path in ("version", "slicing.replicas", "bogus"):
        assert path in result.stderr
    assert "3 problems" in result.stderr


def test_check_config_accepts_nvidia_time_slicing_file(short_tmp: Path) -> None:
    config = short_tmp / "nvidia.yaml"
    config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 5\n"
    )
    result = run_cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    assert "resource nvidia.com/gpu" in result.stdout
    assert "total: 10 slices" in result.stdout
    assert "enforcement: monitor mode" in result.stdout
    # The flag serve takes, or its variable as the DaemonSet sets it, says what serve would do.
    on = run_cli("check-config", str(config), "--enforce-nvidia-config", "true")
    assert "enforcement: on for this NVIDIA-format config" in on.stdout
    env = {**os.environ, "VGPU_ENFORCE_NVIDIA_CONFIG": "true"}
    by_env = subprocess.run(
        [*CLI, "check-config", str(config)], capture_output=True, text=True, timeout=60,
        check=False, env=env,
    )  # fmt: skip
    assert by_env.stdout == on.stdout


def test_demo_shows_slices_pods_and_env_then_cleans_up() -> None:
    result = run_cli("demo", "--duration", "0.5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "plugin registered" in out
    assert "NVIDIA A100-SXM4-80GB" in out
    assert "NVIDIA L4" in out
    assert "llm-finetune/trainer" in out
    assert "VGPU_ALLOCATION_ID=" in out
    assert "NVIDIA_VISIBLE_DEVICES=GPU-" in out
    assert "re-registered" in out
    workdir = re.search(r"kubelet in (/\S+)", out)
    assert workdir is not None
    assert Path(workdir.group(1)).name.startswith("vgpu-demo-")
    assert not Path(workdir.group(1)).exists()
    assert RESOURCE in out
    # Counts read as English, and the slice map's columns never run together.
    assert "1 nvidia.com/mig-3g.40gb slice advertised" in out
    assert "1 slice x 40Gi memory" in out
    assert not re.search(r"\b1 [\w./-]*\s?slices\b", out)
    for line in out.splitlines():
        assert not re.search(r"\S::\d", line), line


def test_demo_shows_the_enforcer_at_work() -> None:
    result = run_cli("demo", "--duration", "6")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "throttling default/inference/server" in out
    # It is held to what the view says it may use, not to its bare share.
    # With the figures of a snapshot that shows it over, or, when none did (its use drops once
    # paused), the window's verdict; never a figure below the limit it names.
    throttled = re.search(
        r"throttling default/inference/server: it used (\d+)% of the GPU, more than the "
        r"(\d+)% it may use now \(a 25% share\)",
        out,
    )
    if throttled is not None:
        assert int(throttled.group(1)) > int(throttled.group(2)) >= 25
    else:
        window = re.search(
            r"throttling default/inference/server: over its window it used more than the "
            r"(\d+)% it may use now \(a 25% share\)",
            out,
        )
        assert window is not None, out
        assert int(window.group(1)) >= 25
    assert "THROTTLED" in out
    assert "killed the largest GPU process of default/notebook/jupyter" in out
    # The built-in kubelet speaks no DRA: the demo says where to try DRA mode, a section that
    # is there (tests/e2e/test_try_dra.py runs its commands).
    assert "serve --kubelet-api dra" in out
    section = re.search(r'docs/dra\.md "([^"]+)"', out)
    assert section is not None, out
    dra_doc = (Path(__file__).parents[2] / "docs" / "dra.md").read_text()
    assert f"\n## {section.group(1)}\n" in dra_doc
    # The JAX-style container read its hint and reserved 0.22 of the L4, inside its 5.6Gi slice:
    # it is never killed.
    assert (
        "jax-train/jax is JAX-style: at start it reserves XLA_PYTHON_CLIENT_MEM_FRACTION=0.22"
        in out
    )
    assert "(4.9Gi), within its 5.6Gi limit" in out
    assert "default/jax-train/jax  1 slice" in out
    assert "killed the largest GPU process of default/jax-train/jax" not in out


def test_serve_with_a_bad_metrics_address_exits_2_naming_it(short_tmp: Path) -> None:
    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    result = run_cli("serve", "--backend", f"fake:{state}", "--metrics-address", "nonsense")
    assert result.returncode == 2
    assert "'nonsense'" in result.stderr


def test_serve_on_a_taken_port_exits_2_saying_what_to_change(short_tmp: Path) -> None:
    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "serve",
            "--backend",
            f"fake:{state}",
            "--device-plugin-dir",
            str(short_tmp / "dp"),
            "--state-dir",
            str(short_tmp / "state"),
            "--metrics-address",
            f"127.0.0.1:{port}",
        )
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr
    assert "--metrics-address" in result.stderr
