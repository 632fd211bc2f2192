"""The node's CUDA MPS control daemon, with `mps.enabled` (docs/design.md §10), by concern:

- `runner`: each command a bounded run of the control command;
- `directories`: `<mps.root>` and its `pipe`, `log` and `shm`, the PID and output files;
- `protocol`: MPS v2 or v3 (detection), v3's names and answers;
- `process`: which process is the control daemon, spawning it, taking over one left running,
  quitting it;
- `defaults`: MPS v2's per-slice defaults, set and read back;
- `namespaces`: MPS v3's servers (one per GPU) and namespaces (one per container or claim);
- `drain`: terminating a client through the control daemon before it is stopped;
- `canary`: a bounded client that tells a wedged GPU from a healthy one;
- `options`: how the supervisor runs MPS (protocol, drain bound, canary, namespace timing);
- `supervisor`: `MpsControlDaemon`, which starts, configures, supervises and stops it.
"""

from deviceplugin.gpu.mps.canary import default_canary
from deviceplugin.gpu.mps.directories import DEFAULT_SHM_PATH, OUTPUT_FILE, PID_FILE
from deviceplugin.gpu.mps.drain import Drain, DrainOutcome
from deviceplugin.gpu.mps.namespaces import MpsNamespaceError, NamespaceTiming
from deviceplugin.gpu.mps.options import MpsOptions
from deviceplugin.gpu.mps.process import ControlProcess, identify
from deviceplugin.gpu.mps.protocol import V2, V3, Detection, detect_protocol
from deviceplugin.gpu.mps.runner import (
    COMMAND_TIMEOUT_S,
    OUTPUT_LIMIT_BYTES,
    ControlCommand,
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
    "V2",
    "V3",
    "ControlCommand",
    "ControlProcess",
    "Detection",
    "Drain",
    "DrainOutcome",
    "MpsCommandError",
    "MpsControlDaemon",
    "MpsNamespaceError",
    "MpsOptions",
    "MpsPathError",
    "NamespaceTiming",
    "default_canary",
    "detect_protocol",
    "identify",
]
