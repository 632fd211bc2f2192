"""The only code that sends signals to processes, in three modules: `enforcer.control` (the
`ProcessControl` seam and `PsutilControl`, which holds each process's identity and checks it, and
where the process is, before a signal), `enforcer.dutycycle` (the SIGSTOP/SIGCONT duty cycles on
a thread of their own) and `enforcer.recording` (the control that sends nothing). This module
names them together for whoever checks that no signal reaches a process it must not.
"""

from __future__ import annotations

from deviceplugin.enforcer.control import (
    CREATE_TIME_TOLERANCE_S,
    ProcessControl,
    PsutilControl,
    SignalResult,
    cgroup_now,
    run_state,
    start_ticks,
)
from deviceplugin.enforcer.dutycycle import DutyCycler
from deviceplugin.enforcer.recording import RecordingControl
from deviceplugin.statefiles import boot_id

__all__ = [
    "CREATE_TIME_TOLERANCE_S",
    "DutyCycler",
    "ProcessControl",
    "PsutilControl",
    "RecordingControl",
    "SignalResult",
    "boot_id",
    "cgroup_now",
    "run_state",
    "start_ticks",
]
