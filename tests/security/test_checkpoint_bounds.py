"""The kubelet checkpoint is read with bounds: whatever sits at its path costs at most its cap.

Each read runs in a child process of its own, under a memory limit and a timeout, so that a
reader without bounds fails the test instead of taking the machine's memory or hanging it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
RESOURCE = "nvidia.com/vgpu"

# Reads the checkpoint at argv[1] once and prints what it cost: the reason (empty when it was
# read), the entries, the peak of Python allocations during the read and the wall time.
_READ_ONCE = """
import json, resource, sys, time, tracemalloc
from pathlib import Path
limit = 768 << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from deviceplugin.kubelet.checkpoint import CheckpointReader
reader = CheckpointReader(Path(sys.argv[1]), "nvidia.com/vgpu")
tracemalloc.start()
started = time.monotonic()
checkpoint = reader.read()
elapsed = time.monotonic() - started
_, peak = tracemalloc.get_traced_memory()
print(json.dumps({"reason": checkpoint.reason, "entries": len(checkpoint.entries),
                  "peak": peak, "seconds": elapsed}))
"""


def read_in_child(path: Path, timeout_s: float = 20.0) -> dict[str, object]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READ_ONCE, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} did not return within {timeout_s:g}s")
    assert done.returncode == 0, f"the reader died reading {path}: {done.stderr[-2000:]}"
    result: dict[str, object] = json.loads(done.stdout)
    return result


def checkpoint_of_size(path: Path, size: int) -> int:
    """A checkpoint in the kubelet's format, about `size` bytes, mostly AllocResp as a real one
    is; returns its number of entries of our resource."""
    alloc_resp = base64.b64encode(os.urandom(3000)).decode()
    entries = []
    n = 0
    while len(alloc_resp) * n < size:
        entries.append(
            {
                "PodUID": f"00000000-0000-4000-8000-{n:012d}",
                "ContainerName": "main",
                "ResourceName": RESOURCE,
                "DeviceIDs": {"-1": [f"GPU-{n % 8}::{n % 4}"]},
                "AllocResp": alloc_resp,
            }
        )
        n += 1
    document = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}
    path.write_text(json.dumps(document))
    return n


def test_a_symlink_to_dev_zero_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.symlink_to("/dev/zero")
    result = read_in_child(path)
    assert "symbolic link" in str(result["reason"])
    assert int(str(result["peak"])) < MiB


def test_a_fifo_at_the_checkpoint_path_neither_blocks_nor_is_read(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    os.mkfifo(path)
    result = read_in_child(path, timeout_s=10)
    assert "not a regular file" in str(result["reason"])


def test_a_20_mib_checkpoint_costs_no_more_than_its_size(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    checkpoint_of_size(path, 20 * MiB)
    size = path.stat().st_size
    result = read_in_child(path)
    assert int(str(result["peak"])) <= size, result
    assert "more than" in str(result["reason"]), result


def test_a_large_checkpoint_under_the_cap_is_read_at_about_its_size(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    entries = checkpoint_of_size(path, 6 * MiB)
    size = path.stat().st_size
    result = read_in_child(path)
    assert result["reason"] == "", result
    assert result["entries"] == entries
    # The file's bytes, their text and the few fields kept per entry: not a multiple of the
    # size for the AllocResp strings that are never used.
    assert int(str(result["peak"])) <= 2.5 * size, (result, size)
