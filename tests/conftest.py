"""Shared fixtures: short temporary directories (Unix socket paths are limited to 107 bytes).

And how the suite runs in parallel (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml):
more workers than CPUs, since most tests wait on processes, sockets and timers rather than
compute; tests sharing a module-scoped fixture stay on one worker, so it is built once (a real
cluster in tests/e2e: one per module, the modules on several workers at once); the real-GPU tests
all run on one worker, one after another, as they share the hardware."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Workers per CPU for `-n auto`; PYTEST_XDIST_AUTO_NUM_WORKERS=N, or `-n N`, overrides it.
WORKERS_PER_CPU = 2
# Fixture scopes that outlive one test: their tests are grouped by module.
SHARED_SCOPES = frozenset({"module", "package", "class"})

# Property tests share the CPUs with the other workers: how long one example takes says nothing
# about the code under test, so no per-example deadline and no "too slow" health check.
settings.register_profile("parallel", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("parallel")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist reads it
    return WORKERS_PER_CPU * len(os.sched_getaffinity(0))


def xdist_group(item: pytest.Item) -> str | None:
    """The group of tests that must run on the same worker as `item`, if any."""
    if item.get_closest_marker("gpu") is not None:
        return "gpu"
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for defs in info.name2fixturedefs.values():
        if any(d.scope in SHARED_SCOPES for d in defs):
            return item.nodeid.split("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a worker under `--dist loadgroup`, a grouped test's node ID carries its group once
    xdist has seen it: where a pytest and xdist pair no longer manage that, the groups would be
    silently ignored (a module's cluster built on every worker), so the run stops here instead."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    grouped = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group")]
    lost = [nodeid for nodeid in grouped if "@" not in nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): this pytest and "
            "pytest-xdist do not work together; install the versions pyproject.toml asks for"
        )


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vg", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
