"""CUDA clients for the MPS v3 checks of tests/gpu/test_mps_real.py, through libcuda.so.1 and
ctypes only, each a `python -c` program, and the child process that runs one.

- STEADY: creates a context, prints `{"ready": true, "multiprocessor_count": n}`, then for each
  line `work` on stdin allocates 64 MiB, sets it and synchronises, printing the CUDA result
  (`{"work": code}`); exits at the end of stdin. It stays attached to MPS meanwhile.
- BUSY: creates a context, allocates 256 MiB and keeps queueing asynchronous memsets on it
  without synchronising, so that it always has GPU work in flight; prints `{"busy": true}` once
  the first are queued, and runs until it is killed.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

_PRELUDE = r"""
import ctypes, json, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        print(json.dumps({"error": f"{what} failed with CUDA error {code}"}), flush=True)
        sys.exit(1)
check(cuda.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
"""

STEADY = (
    _PRELUDE
    + r"""
sms = ctypes.c_int()
check(cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev), "cuDeviceGetAttribute")
print(json.dumps({"ready": True, "multiprocessor_count": sms.value}), flush=True)
for line in sys.stdin:
    ptr = ctypes.c_uint64()
    code = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))
    if code == 0:
        code = cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(7), ctypes.c_size_t(64 << 20))
    if code == 0:
        code = cuda.cuCtxSynchronize()
        cuda.cuMemFree_v2(ptr)
    print(json.dumps({"work": code}), flush=True)
"""
)

BUSY = (
    _PRELUDE
    + r"""
ptr = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20)), "cuMemAlloc")
for _ in range(64):
    check(cuda.cuMemsetD8Async(ptr, ctypes.c_ubyte(1), ctypes.c_size_t(256 << 20), None), "memset")
print(json.dumps({"busy": True}), flush=True)
while True:
    cuda.cuMemsetD8Async(ptr, ctypes.c_ubyte(2), ctypes.c_size_t(256 << 20), None)
"""
)


class CudaClient:
    """A client program running as a child of the test, its stdout read a line at a time."""

    def __init__(self, source: str, env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", source],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        )
        self.pid = self.process.pid

    def line(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next JSON line it prints; {"timeout": ...} when none comes in time."""
        stdout = self.process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        if not readable:
            return {"timeout": timeout_s}
        text = stdout.readline()
        return json.loads(text) if text.strip() else {"exited": self.process.poll()}

    def ask(self, request: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return self.line()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
