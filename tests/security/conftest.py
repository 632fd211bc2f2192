"""Fixtures for the security suite: a node with fake GPUs and a running kubelet simulator."""

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
    w = Workloads()
    try:
        yield w
    finally:
        w.close()
