"""Fixtures for the end-to-end tests: one real cluster per test module (see harness.py).

Without VGPU_E2E_K8S_BUNDLE every test here skips, saying so. With it, a cluster that does not
come up is an error of every test in the module, never a skip."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.e2e.harness import (
    BUNDLE_ENV,
    Bundle,
    Cluster,
    ContainerdOptions,
    Runtime,
    containerd_missing,
    resolve_bundle,
)


def bundle() -> Bundle:
    spec = os.environ.get(BUNDLE_ENV)
    if not spec:
        pytest.skip(
            f"{BUNDLE_ENV} is not set: name a Kubernetes v1.36.2 bundle (tarball or directory) "
            "to run the end-to-end tests on a real node"
        )
    if os.geteuid() != 0:
        pytest.fail(f"{BUNDLE_ENV} is set, but the end-to-end cluster needs root (namespaces)")
    return resolve_bundle(spec)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A fresh one-node cluster for the module. The module may set RUNTIME = "fakecri" (or
    "containerd": its tests skip, saying why, where real containers cannot run); the default
    takes containerd + runc where they can. CONTAINERD_OPTIONS (a ContainerdOptions) says how
    containerd runs (NRI, the CDI spec directories)."""
    runtime: Runtime = getattr(request.module, "RUNTIME", "auto")
    options: ContainerdOptions | None = getattr(request.module, "CONTAINERD_OPTIONS", None)
    found = bundle()
    if runtime == "containerd":
        missing = containerd_missing(found)
        if missing:
            pytest.skip(f"needs real containers: {missing}")
    with Cluster.start(found, runtime, containerd=options) as c:
        yield c


@pytest.fixture
def node(cluster: Cluster) -> Iterator[Cluster]:
    """The module's cluster, cleaned after the test: every pod deleted, every vgpu daemon the
    test started stopped, the kubelet running again."""
    before = len(cluster.daemons)
    try:
        yield cluster
    finally:
        kubelet = cluster.components.get("kubelet")
        if kubelet is not None and not kubelet.alive():
            cluster.start_kubelet()
        cluster.delete_all_pods()
        for daemon in cluster.daemons[before:]:
            daemon.kill()
        if len(cluster.daemons) > before:
            cluster.wait_no_extended_resources()
