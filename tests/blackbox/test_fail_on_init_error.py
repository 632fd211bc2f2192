"""`serve --fail-on-init-error false` (NVIDIA's failOnInitError: false): a node without a usable
GPU backend keeps the daemon waiting, rather than exiting into a restart loop."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.blackbox.test_cli import CLI, run_cli


def serve_on_missing_gpus(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *CLI,
        "serve",
        "--backend",
        f"fake:{tmp_path / 'no-such-state.json'}",
        "--state-dir",
        str(tmp_path / "state"),
        "--metrics-address",
        "",
        *extra,
    ]


def test_by_default_a_backend_that_cannot_start_exits_2(tmp_path: Path) -> None:
    result = run_cli(*serve_on_missing_gpus(tmp_path)[len(CLI) :])
    assert result.returncode == 2, result.stderr
    assert "cannot start" in result.stderr


def test_with_false_the_daemon_waits_until_stopped(tmp_path: Path) -> None:
    process = subprocess.Popen(
        serve_on_missing_gpus(tmp_path, "--fail-on-init-error", "false"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        # Each log line is written when it happens: read until the daemon says it waits.
        while not any("waiting until stopped" in line for line in seen):
            line = process.stderr.readline()
            assert line, f"the daemon exited: {''.join(seen)}"
            seen.append(line)
            assert time.monotonic() < deadline, "".join(seen)
        time.sleep(1)
        assert process.poll() is None, "".join(seen)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, "".join(seen) + rest
    assert any("cannot start" in line for line in seen)


def test_a_value_other_than_true_or_false_is_refused(tmp_path: Path) -> None:
    result = run_cli(*serve_on_missing_gpus(tmp_path, "--fail-on-init-error", "maybe")[len(CLI) :])
    assert result.returncode == 2
    assert "--fail-on-init-error" in result.stderr
