"""The command line helps the person typing it: help that shows defaults and environment
variables, exit codes that say what went wrong, the schema for editors."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

CLI = [sys.executable, "-m", "deviceplugin"]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def option_help(help_text: str) -> dict[str, str]:
    """Each option of a --help text -> its help, on one line."""
    options: dict[str, str] = {}
    current = ""
    for line in help_text.splitlines():
        found = re.match(r"\s{2}(--[\w-]+)", line)
        if found:
            current = found.group(1)
            options[current] = line
        elif current and line.startswith(" " * 10):
            options[current] += " " + line.strip()
        else:
            current = ""
    return options


def test_serve_help_shows_every_default_and_its_environment_variable() -> None:
    result = run_cli("serve", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0
    options = option_help(result.stdout)
    expected = {
        "--config": "VGPU_CONFIG",
        "--backend": "VGPU_BACKEND",
        "--device-plugin-dir": "VGPU_DEVICE_PLUGIN_DIR",
        "--pod-resources-socket": "VGPU_POD_RESOURCES_SOCKET",
        "--metrics-address": "VGPU_METRICS_ADDRESS",
        "--metrics-tls-cert": "VGPU_METRICS_TLS_CERT",
        "--metrics-tls-key": "VGPU_METRICS_TLS_KEY",
        "--metrics-client-ca": "VGPU_METRICS_CLIENT_CA",
        "--metrics-client-names": "VGPU_METRICS_CLIENT_NAMES",
        "--probe-address": "VGPU_PROBE_ADDRESS",
        "--state-dir": "VGPU_STATE_DIR",
        "--node-features-dir": "VGPU_NODE_FEATURES_DIR",
        "--node-name": "NODE_NAME",
        "--trust-host-processes": "VGPU_TRUST_HOST_PROCESSES",
        "--config-dir": "VGPU_CONFIG_DIR",
        "--config-label": "VGPU_CONFIG_LABEL",
        "--default-config": "VGPU_DEFAULT_CONFIG",
        "--fallback-strategies": "VGPU_FALLBACK_STRATEGIES",
        "--kubeconfig": "VGPU_KUBECONFIG",
        "--fail-on-init-error": "VGPU_FAIL_ON_INIT_ERROR",
        "--device-id-strategy": "VGPU_DEVICE_ID_STRATEGY",
        "--enforce-nvidia-config": "VGPU_ENFORCE_NVIDIA_CONFIG",
        "--node-features-file": "VGPU_NODE_FEATURES_FILE",
        "--kubelet-cgroup-driver": "VGPU_KUBELET_CGROUP_DRIVER",
        "--kubelet-cgroup-root": "VGPU_KUBELET_CGROUP_ROOT",
        "--log-format": "VGPU_LOG_FORMAT",
        "--log-level": "VGPU_LOG_LEVEL",
        "--kubelet-api": "VGPU_KUBELET_API",
        "--kubelet-root-dir": "VGPU_KUBELET_ROOT_DIR",
        "--cdi-dir": "VGPU_CDI_DIR",
        "--dra-gpu-cdi": "VGPU_DRA_GPU_CDI",
    }
    assert expected.keys() <= options.keys(), options.keys()
    for option, help_line in options.items():
        assert "default:" in help_line, f"{option} shows no default: {help_line}"
        variable = re.search(r"env ([A-Z][A-Z0-9_]*)\)", help_line)
        assert variable, f"{option} names no variable"
        assert variable.group(1) == expected.get(option, variable.group(1)), option
    assert "/var/lib/kubelet/device-plugins" in options["--device-plugin-dir"]
    assert "default: :9410" in options["--metrics-address"]
    assert "default: info" in options["--log-level"]


def test_log_level_and_format_come_from_the_environment(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    result = run_cli(
        "serve",
        "--backend",
        f"fake:{missing}",
        "--device-plugin-dir",
        str(tmp_path),
        env={"VGPU_LOG_FORMAT": "json", "VGPU_LOG_LEVEL": "ERROR"},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines, "no log line"
    entries = [json.loads(line) for line in lines]  # json, from VGPU_LOG_FORMAT
    assert {e["level"] for e in entries} == {"ERROR"}  # nothing below error, from VGPU_LOG_LEVEL


def test_a_bad_log_level_in_the_environment_is_named() -> None:
    result = run_cli("serve", env={"VGPU_LOG_LEVEL": "loud"})
    assert result.returncode == 2
    assert "--log-level" in result.stderr
    assert "'loud' is not one of debug, info, warning, error" in result.stderr


def test_a_bad_device_id_strategy_in_the_environment_is_named() -> None:
    result = run_cli("serve", env={"VGPU_DEVICE_ID_STRATEGY": "serial"})
    assert result.returncode == 2
    assert "--device-id-strategy" in result.stderr
    assert "'serial' is not one of uuid, index" in result.stderr


def test_a_bad_cgroup_driver_in_the_environment_is_named() -> None:
    result = run_cli("serve", env={"VGPU_KUBELET_CGROUP_DRIVER": "bogus"})
    assert result.returncode == 2
    assert "--kubelet-cgroup-driver" in result.stderr
    assert "bad --kubelet-cgroup-root" not in result.stderr
    assert "'bogus' is not one of auto, cgroupfs, systemd" in result.stderr


@pytest.mark.parametrize("root", ["vgpu", "/vgpu/../kubepods.slice", "/./x"])
def test_a_memory_limit_probe_root_that_is_not_a_plain_cgroup_path_is_refused(
    root: str, tmp_path: Path
) -> None:
    """The probe makes a cgroup under it: a relative path or one with . or .. could leave the
    hierarchy, so the daemon does not start and says which value and what it wants."""
    result = run_cli(
        "serve",
        "--backend",
        f"fake:{tmp_path / 'gpus.json'}",
        "--device-plugin-dir",
        str(tmp_path),
        env={"VGPU_MEMORY_LIMIT_PROBE_ROOT": root},
    )
    assert result.returncode == 2
    assert f"--memory-limit-probe-root {root!r} is not a cgroup path" in result.stderr


@pytest.mark.parametrize("spelling", ["warning", "WARNING", "Warning"])
def test_log_levels_are_spelled_alike_in_any_case(spelling: str) -> None:
    daemon = run_cli("serve", "--log-level", spelling, "--help")
    sim = subprocess.run(
        [sys.executable, "-m", "deviceplugin.sim.kubelet", "--log-level", spelling, "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert daemon.returncode == 0, daemon.stderr
    assert sim.returncode == 0, sim.stderr
    assert "debug|info|warning|error" in daemon.stdout
    assert "debug|info|warning|error" in sim.stdout


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver"
)
def test_check_config_on_nvml_without_a_gpu_says_the_config_is_valid(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nslicing:\n  replicas: 2\n")
    result = run_cli("check-config", str(config), "--backend", "nvml")
    assert result.returncode == 3, result.stderr  # not 2, which means an invalid config
    assert "the config itself is valid" in result.stderr
    assert "cannot read GPUs from nvml" in result.stderr


def test_check_config_with_a_missing_state_file_exits_3(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    result = run_cli("check-config", str(config), "--backend", f"fake:{tmp_path / 'nope.json'}")
    assert result.returncode == 3
    assert "the config itself is valid" in result.stderr


def test_check_config_of_an_invalid_file_with_a_backend_still_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nslicing:\n  replicas: 0\n")
    result = run_cli("check-config", str(config), "--backend", "nvml")
    assert result.returncode == 2
    assert "slicing.replicas" in result.stderr


def test_config_schema_prints_a_schema_that_validates_config_files(tmp_path: Path) -> None:
    result = run_cli("config-schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"version": "v1", "slicing": {"replicas": 8}})
    errors = list(validator.iter_errors({"version": "v1", "slicing": {"replica": 8}}))
    assert errors


def test_the_standalone_simulator_admits_pods_from_the_command_line(short_tmp: Path) -> None:
    from deviceplugin.gpu.fake import FakeState, write_state_file
    from tests.blackbox.daemon_harness import TWO_GPUS

    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    podres = short_tmp / "podres.sock"
    sim = subprocess.Popen(
        [
            sys.executable, "-m", "deviceplugin.sim", "--dir", str(plugin_dir),
            "--pod-resources-socket", str(podres),
            "--pod", "ml/train:trainer=2", "--pod", "serve:api=1,sidecar=0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    daemon = None
    try:
        daemon = subprocess.Popen(
            [
                *CLI, "serve", "--backend", f"fake:{state}", "--device-plugin-dir",
                str(plugin_dir), "--pod-resources-socket", str(podres),
                "--state-dir", str(short_tmp / "state"), "--metrics-address", "127.0.0.1:0",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert sim.stdout is not None
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            for line in sim.stdout or ():
                lines.put(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        admitted: list[str] = []
        deadline = time.monotonic() + 30
        while len(admitted) < 3:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"admitted only {admitted} in 30 s")
            if line.startswith("admitted"):
                admitted.append(line)
    finally:
        for proc in (daemon, sim):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    trainer = next(line for line in admitted if "ml/train/trainer" in line)
    assert trainer.split("devices ")[1].split()[0].count("::") == 2
    assert "VGPU_ALLOCATION_ID=" in trainer
    assert any(
        "default/serve/api" in line and "NVIDIA_VISIBLE_DEVICES=GPU-" in line for line in admitted
    )
    assert any("default/serve/sidecar: devices none" in line for line in admitted)


def test_device_ids_by_index_from_the_environment_win_over_the_config_file(
    short_tmp: Path,
) -> None:
    # As NVIDIA's chart passes DEVICE_ID_STRATEGY, vgpu's passes VGPU_DEVICE_ID_STRATEGY; the
    # user's config file (here one that says uuid) stays as written.
    from deviceplugin.gpu.fake import FakeState, write_state_file
    from tests.blackbox.daemon_harness import TWO_GPUS

    state = short_tmp / "gpus.json"
    write_state_file(state, FakeState(gpus=TWO_GPUS))
    config = short_tmp / "config.yaml"
    config.write_text("allocation: {deviceIDStrategy: uuid, policy: spread}\n")
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    podres = short_tmp / "podres.sock"
    sim = subprocess.Popen(
        [
            sys.executable, "-m", "deviceplugin.sim", "--dir", str(plugin_dir),
            "--pod-resources-socket", str(podres), "--pod", "ml/train:trainer=2",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    daemon = None
    admitted = ""
    try:
        daemon = subprocess.Popen(
            [
                *CLI, "serve", "--backend", f"fake:{state}", "--config", str(config),
                "--device-plugin-dir", str(plugin_dir), "--pod-resources-socket", str(podres),
                "--state-dir", str(short_tmp / "state"), "--metrics-address", "127.0.0.1:0",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "VGPU_DEVICE_ID_STRATEGY": "index"},
        )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            for line in sim.stdout or ():
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 30
        while not admitted.startswith("admitted"):
            try:
                admitted = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("no pod admitted in 30 s")
    finally:
        for proc in (daemon, sim):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    # Two slices spread over both GPUs: named 0 and 1, not by UUID.
    assert "NVIDIA_VISIBLE_DEVICES=0,1 " in admitted + " ", admitted
    assert "VGPU_ALLOCATION_ID=" in admitted


@pytest.mark.parametrize("bad", ["train", "ml/train:trainer", "ml/train:trainer=x", "a:c=1,c=2"])
def test_the_simulator_names_a_bad_pod_argument(bad: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin.sim", "--dir", str(tmp_path), "--pod", bad],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "NAMESPACE/NAME:CONTAINER=N" in result.stderr or "named twice" in result.stderr


def test_the_demo_tells_its_story_once_and_writes_no_screen_codes_into_a_pipe() -> None:
    result = run_cli("demo", "--duration", "6")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b" not in out
    assert out.count("vgpu demo:") == 1
    assert out.count("enforcement actions:") == 2  # the view in the story, and at the end
    kill = out.index("killed the largest GPU process of default/notebook/jupyter")
    exited = re.search(r"process \d+ of default/notebook/jupyter has exited", out)
    assert exited is not None
    assert kill < exited.start(), "the exit was reported before the kill"
    # Containers are namespace/pod/container everywhere the demo names them.
    assert "default/llm-finetune/trainer" in out
    assert not re.search(r"(?<![/\w-])llm-finetune/trainer", out)


def test_a_misspelt_flag_shows_the_usage_of_its_command() -> None:
    result = run_cli("serve", "--bakend", "nvml")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: vgpu-device-plugin serve ")
    assert "--device-plugin-dir" in result.stderr
    assert "unrecognized arguments: --bakend nvml" in result.stderr


def piped_into(args: list[str], reader: str, timeout: float = 60) -> tuple[int, str, str]:
    """Run the CLI into `reader` (a shell command that may close the pipe early); the CLI's exit
    code and stderr, and what the reader printed."""
    with subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as cli:
        assert cli.stdout is not None
        read = subprocess.run(
            ["sh", "-c", reader], stdin=cli.stdout, capture_output=True, text=True, check=True
        )
        cli.stdout.close()
        try:
            _, stderr = cli.communicate(timeout=timeout)
        finally:
            cli.kill()
        return cli.returncode, stderr, read.stdout


def test_check_config_into_head_ends_quietly(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    code, stderr, first = piped_into(["check-config", str(config)], "head -1")
    assert first.startswith(f"{config}: valid")
    assert "Traceback" not in stderr
    assert "BrokenPipeError" not in stderr
    assert code in (0, 141)


def test_the_demo_into_head_ends_quietly_and_leaves_nothing_behind() -> None:
    code, stderr, shown = piped_into(["demo", "--duration", "20"], "head -3")
    assert shown.startswith("vgpu demo: 3 fake GPUs")
    assert "Traceback" not in stderr
    assert code == 141
    workdir = re.search(r"kubelet in (/\S+)", shown)
    assert workdir is not None
    assert not Path(workdir.group(1)).exists()
