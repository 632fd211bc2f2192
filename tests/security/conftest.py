"""Fixtures for the security suite: a node with fake GPUs and a running kubelet simulator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.blackbox.daemon_harness import TWO_GPUS, Node, Workloads
from tests.blackbox.test_dra import GPU0, GPU1
from tests.support.fake_apiserver import FakeApiServer


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


@pytest.fixture
def dra_api() -> Iterator[FakeApiServer]:
    """A fake API server holding this node (`test-node`) and another (`n1`)."""
    server = FakeApiServer()
    for name in ("test-node", "n1"):
        server.nodes[name] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    server.start()
    yield server
    server.close()


@pytest.fixture
def dra_node(short_tmp: Path) -> Node:
    """A node of two fake GPUs (a 40 GiB A100 and an L4), in DRA mode: no kubelet simulator."""
    return Node(short_tmp, [GPU0, GPU1])
