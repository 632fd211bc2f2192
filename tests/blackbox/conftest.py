"""Fixtures for the black-box tests: a node with fake GPUs and a running kubelet simulator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.blackbox.daemon_harness import TWO_GPUS, Node, Workloads


@pytest.fixture
async def node(short_tmp: Path) -> AsyncIterator[Node]:
    n = Node(short_tmp, TWO_GPUS)
    await n.sim.start()
    try:
        yield n
    finally:
        await n.sim.stop()


@pytest.fixture
def workloads() -> Iterator[Workloads]:
    """Real processes standing in for containers' GPU processes, resumed and killed at the end."""
    w = Workloads()
    try:
        yield w
    finally:
        w.close()
