"""The pieces of a state file's validation: the ranges its numbers must keep, and how its
problems are collected and worded (each names its JSON path, the bad value and what is expected).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

_MAX_PROBLEMS_SHOWN = 20
_MAX_VALUE_CHARS = 60

# Ranges of the numbers in a state file: what a real node could report, with room to spare.
# Beyond them a value is a mistake (and 2**63 overflows the kubelet API's integers).
MAX_STATE_BYTES = 1 << 20
# What one poll may have to read, check and report, whatever the file holds: a real node has at
# most a few dozen GPUs of at most 7 MIG devices each, and hundreds of GPU processes. Past these
# a file is refused before any item is checked, so that a file rewritten at every poll costs a
# poll milliseconds, not seconds.
MAX_GPUS = 64
MAX_MIG_DEVICES = 8  # per GPU
MAX_PROCESSES = 4096  # in the whole file
MAX_TEXT_CHARS = 256  # any string: names, UUIDs, reasons, keys
MAX_INDEX = 1 << 16  # GPU indices and device minors
MAX_NUMA_NODE = 1023  # Linux supports at most 1024 NUMA nodes
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_PID = 1 << 22  # Linux's largest pid_max


def _show(value: object) -> str:
    """A value as it appears in JSON, shortened for a message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def expected(self, path: str, what: str, value: object) -> None:
        self.items.append(f"{path}: expected {what}, got {_show(value)}")

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")

    def check_keys(
        self,
        obj: Mapping[Any, object],
        path: str,
        allowed: Sequence[str],
        required: Sequence[str],
    ) -> bool:
        """Report unknown and missing keys; True when none are."""
        ok = True
        for key in obj:
            if not isinstance(key, str):
                self.expected(path, "string keys", key)
                ok = False
            elif key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = (
                    f'did you mean "{close[0]}"?' if close else "known keys: " + ", ".join(allowed)
                )
                self.add(_join(path, key), f"unknown key ({hint})")
                ok = False
        for key in required:
            if key not in obj:
                self.add(_join(path, key), "required key is missing")
                ok = False
        return ok


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _in_range(path: str, values: Iterable[tuple[str, object, int]], problems: _Problems) -> bool:
    """Whether every integer among `values` (key, value, largest allowed) is in range; each one
    that is not is a problem."""
    ok = True
    for key, value, most in values:
        if _is_int(value) and value > most:
            problems.add(f"{path}.{key}", f"out of range: at most {most}, got {_show(value)}")
            ok = False
    return ok


def bounds_problem(data: object) -> str | None:
    """What makes parsed state file data too big to check at every poll (see MAX_GPUS), or None.
    Cheap: counts lists and measures strings, in one pass with no recursion."""
    if not isinstance(data, Mapping):
        return None  # the parser says what is wrong with its shape
    gpus = data.get("gpus")
    if isinstance(gpus, list) and len(gpus) > MAX_GPUS:
        return f"gpus: {len(gpus)} GPUs, at most {MAX_GPUS}"
    processes = 0
    stack: list[object] = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS:
                size = len(value)
                return f"a string of {size} characters, at most {MAX_TEXT_CHARS}: {_show(value)}"
        elif isinstance(value, Mapping):
            devices = value.get("devices")
            if isinstance(devices, list) and len(devices) > MAX_MIG_DEVICES:
                return f"a GPU with {len(devices)} MIG devices, at most {MAX_MIG_DEVICES}"
            listed = value.get("processes")
            if isinstance(listed, list):
                processes += len(listed)
                if processes > MAX_PROCESSES:
                    return f"more than {MAX_PROCESSES} processes in all"
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return None
