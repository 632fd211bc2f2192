"""Fixtures for the black-box tests: a node with fake GPUs and a running kubelet simulator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.blackbox.daemon_harness import TWO_GPUS, Node, Workloads
from tests.support.fake_apiserver import FakeApiServer

# The node the DRA tests' fake API server knows.
DRA_NODE = "test-node"


@pytest.fixture
async def node(short_tmp: Path) -> AsyncIterator[Node]:
    n = Node(short_tmp, TWO_GPUS)
    await n.sim.start()
    try:
        yield n
    finally:
        await n.sim.stop()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    """A fake API server that knows the node DRA_NODE, for the DRA driver's tests."""
    server = FakeApiServer()
    server.nodes[DRA_NODE] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": DRA_NODE, "uid": "node-uid"},
    }
    server.start()
    yield server
    server.close()
    # Shown with a failing test's output: requests the fake server gave up on.
    for error in server.errors:
        print(f"fake API server: {error}")


@pytest.fixture
def workloads() -> Iterator[Workloads]:
    """Real processes standing in for containers' GPU processes, resumed and killed at the end."""
    w = Workloads()
    try:
        yield w
    finally:
        w.close()
