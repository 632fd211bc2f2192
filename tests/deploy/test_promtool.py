"""`promtool test rules` on the PrometheusRule's alerts and recording rules
(tests/deploy/promtool/alerts_test.yaml), and that every rule has a test there.

promtool comes with Debian's `prometheus` package (.ci/run installs it); without it these tests
skip, saying so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import MONITORING, ROOT, one

RULES = MONITORING / "prometheusrule.yaml"
UNIT_TESTS = ROOT / "tests" / "deploy" / "promtool" / "alerts_test.yaml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (.ci/run does)")
    return found


def rules() -> list[dict[str, Any]]:
    return [rule for group in one(RULES)["spec"]["groups"] for rule in group["rules"]]


def write_rule_file(directory: Path) -> Path:
    """The PrometheusRule's groups as a Prometheus rule file, with the unit tests beside it."""
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": one(RULES)["spec"]["groups"]}))
    shutil.copy(UNIT_TESTS, directory / UNIT_TESTS.name)
    return path


def test_the_rule_file_is_valid(tmp_path: Path) -> None:
    tool = promtool()
    path = write_rule_file(tmp_path)
    result = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_and_recording_rules_pass_their_unit_tests(tmp_path: Path) -> None:
    tool = promtool()
    write_rule_file(tmp_path)
    result = subprocess.run(
        [tool, "test", "rules", UNIT_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_has_a_unit_test() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    firing = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    quiet = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if not case["exp_alerts"]
    }
    recorded = {case["expr"] for test in tests for case in test.get("promql_expr_test", [])}
    for rule in rules():
        if "alert" in rule:
            assert rule["alert"] in firing, f"no test sees {rule['alert']} fire"
            assert rule["alert"] in quiet, f"no test sees {rule['alert']} stay quiet"
        else:
            assert rule["record"] in recorded, f"no test reads {rule['record']}"
