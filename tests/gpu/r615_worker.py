"""A CUDA worker for the R615 checks (tests/gpu/r615_checks.py): started by the checks, moved
into a cgroup by them, then driven one JSON command per line on stdin, one JSON answer per line on
stdout. It drives the GPU through the CUDA driver API (libcuda.so.1, through ctypes) and NVML
(pynvml), on the one GPU CUDA_VISIBLE_DEVICES names.

Commands (`op`): `init` (cuInit, the primary context made current), `info` (cuMemGetInfo_v2),
`alloc` (`bytes`: one cuMemAlloc_v2, held), `fill` (`step`, `cap`: cuMemAlloc_v2 of `step`
bytes until one fails or `cap` is held, all held), `check` (cuMemsetD8_v2 and cuMemcpyDtoH_v2 of
the first MiB of every held buffer), `free` (every held buffer), `nvml` (nvmlDeviceGetMemoryInfo_v2
of the GPU `uuid`, from inside the cgroup), `exit`. Every answer carries the CUDA codes it got.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Any

MiB = 1 << 20


class Worker:
    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.held: list[tuple[ctypes.c_uint64, int]] = []
        self.context = ctypes.c_void_p()

    def init(self, _: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        codes = {"cuInit": self.cuda.cuInit(0)}
        device = ctypes.c_int()
        codes["cuDeviceGet"] = self.cuda.cuDeviceGet(ctypes.byref(device), 0)
        codes["cuDevicePrimaryCtxRetain"] = self.cuda.cuDevicePrimaryCtxRetain(
            ctypes.byref(self.context), device
        )
        codes["cuCtxSetCurrent"] = self.cuda.cuCtxSetCurrent(self.context)
        return {"codes": codes, "seconds": round(time.monotonic() - started, 3)}

    def info(self, _: dict[str, Any]) -> dict[str, Any]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        code = self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return {"code": code, "free_bytes": free.value, "total_bytes": total.value}

    def _alloc(self, size: int) -> int:
        pointer = ctypes.c_uint64()
        code = int(self.cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)))
        if code == 0:
            self.held.append((pointer, size))
        return code

    def alloc(self, command: dict[str, Any]) -> dict[str, Any]:
        return {"code": self._alloc(int(command["bytes"])), "held_bytes": self.held_bytes()}

    def fill(self, command: dict[str, Any]) -> dict[str, Any]:
        step, cap = int(command["step"]), int(command["cap"])
        before = self.held_bytes()
        code = 0
        while self.held_bytes() - before + step <= cap:
            code = self._alloc(step)
            if code != 0:
                break
        return {
            "last_code": code,
            "filled_bytes": self.held_bytes() - before,
            "held_bytes": self.held_bytes(),
            "reached_cap": code == 0,
        }

    def check(self, _: dict[str, Any]) -> dict[str, Any]:
        codes: list[tuple[int, int]] = []
        host = ctypes.create_string_buffer(MiB)
        for pointer, size in self.held:
            n = min(size, MiB)
            memset = int(self.cuda.cuMemsetD8_v2(pointer, ctypes.c_ubyte(0x5A), ctypes.c_size_t(n)))
            copy = int(self.cuda.cuMemcpyDtoH_v2(host, pointer, ctypes.c_size_t(n)))
            codes.append((memset, copy))
        intact = all(m == 0 and c == 0 for m, c in codes) and (not codes or host.raw[0] == 0x5A)
        return {"buffers": len(codes), "codes": codes[:8], "intact": intact}

    def free(self, _: dict[str, Any]) -> dict[str, Any]:
        codes = [int(self.cuda.cuMemFree_v2(pointer)) for pointer, _ in self.held]
        self.held.clear()
        return {"codes": sorted(set(codes))}

    def nvml(self, command: dict[str, Any]) -> dict[str, Any]:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(command["uuid"])
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            return {
                "total_bytes": int(info.total),
                "free_bytes": int(info.free),
                "used_bytes": int(info.used),
                "reserved_bytes": int(info.reserved),
            }
        finally:
            pynvml.nvmlShutdown()

    def held_bytes(self) -> int:
        return sum(size for _, size in self.held)


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        try:
            answer = getattr(worker, command["op"])(command)
        except Exception as e:  # noqa: BLE001 (the checks report what broke)
            answer = {"error": repr(e)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
