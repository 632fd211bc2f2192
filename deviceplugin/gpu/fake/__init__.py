"""The fake GPU backend: GPUs from a JSON state file (docs/design.md §8), processes that are real.

Part of the product: `--backend fake:PATH`, the demo, CI and users' dry runs all run on it. The file
lists GPUs and the processes using them; the processes are real processes on this machine, so that
attribution reads their real environment and the enforcer's signals act on them.

`state` holds the file's values, `parse` and `checks` validate them, `statefile` reads and writes
the file, `sampler` models time-slicing, and `backend` serves the readings.
"""

from __future__ import annotations

from deviceplugin.gpu.fake.backend import FakeBackend
from deviceplugin.gpu.fake.checks import (
    MAX_GPUS,
    MAX_INDEX,
    MAX_MEMORY_BYTES,
    MAX_MIG_DEVICES,
    MAX_NUMA_NODE,
    MAX_PID,
    MAX_PROCESSES,
    MAX_STATE_BYTES,
    MAX_TEXT_CHARS,
)
from deviceplugin.gpu.fake.parse import parse_state
from deviceplugin.gpu.fake.sampler import proc_stat_state
from deviceplugin.gpu.fake.state import FakeGpu, FakeMigDevice, FakeProcess, FakeState
from deviceplugin.gpu.fake.statefile import read_state_file, write_state_file

__all__ = [
    "MAX_GPUS",
    "MAX_INDEX",
    "MAX_MEMORY_BYTES",
    "MAX_MIG_DEVICES",
    "MAX_NUMA_NODE",
    "MAX_PID",
    "MAX_PROCESSES",
    "MAX_STATE_BYTES",
    "MAX_TEXT_CHARS",
    "FakeBackend",
    "FakeGpu",
    "FakeMigDevice",
    "FakeProcess",
    "FakeState",
    "parse_state",
    "proc_stat_state",
    "read_state_file",
    "write_state_file",
]
