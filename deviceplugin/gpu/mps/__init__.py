"""The node's CUDA MPS control daemon, with `mps.enabled` (docs/design.md §10), by concern:

- `runner`: each command a bounded run of the control command;
- `directories`: `<mps.root>` and its `pipe`, `log` and `shm`, the PID and output files;
- `process`: which process is the control daemon, spawning it, taking over one left running;
- `defaults`: MPS v2's per-slice defaults, set and read back;
- `supervisor`: `MpsControlDaemon`, which starts, supervises and stops it.
"""

from deviceplugin.gpu.mps.directories import DEFAULT_SHM_PATH, OUTPUT_FILE, PID_FILE
from deviceplugin.gpu.mps.process import ControlProcess, identify
from deviceplugin.gpu.mps.runner import (
    COMMAND_TIMEOUT_S,
    OUTPUT_LIMIT_BYTES,
    MpsCommandError,
    MpsPathError,
)
from deviceplugin.gpu.mps.supervisor import SETTLE_TIMEOUT_S, MpsControlDaemon

__all__ = [
    "COMMAND_TIMEOUT_S",
    "DEFAULT_SHM_PATH",
    "OUTPUT_FILE",
    "OUTPUT_LIMIT_BYTES",
    "PID_FILE",
    "SETTLE_TIMEOUT_S",
    "ControlProcess",
    "MpsCommandError",
    "MpsControlDaemon",
    "MpsPathError",
    "identify",
]
