"""The README's first commands: the demo needs no development tools, the tests install them, and
CI runs what the README says."""

from __future__ import annotations

import re

from tests.deploy.support import ROOT


def first_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, flags=re.DOTALL)
    assert block is not None
    return block.group(1).strip().splitlines()


def test_the_first_line_installs_only_what_the_demo_needs() -> None:
    demo = first_commands()[0]
    assert "vgpu-device-plugin demo" in demo
    assert re.search(r"pip install -e \.(\s|$)", demo), demo
    assert "[dev]" not in demo


def test_the_test_line_installs_the_dev_extras_and_ci_runs_it() -> None:
    tests = first_commands()[1]
    assert "pip install -e '.[dev]'" in tests
    assert tests.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet -e '.[dev]'" in ci
    assert re.search(r"^\.venv/bin/python -m pytest$", ci, flags=re.MULTILINE)
