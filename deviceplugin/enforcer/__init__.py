"""Quota enforcement (docs/design.md §4): a pure policy, the modules that send signals (named
together in `actuator`), and the enforcer that ties them to the poll loop and to the
stopped-process record in the state directory."""

from deviceplugin.enforcer.actuator import (
    DutyCycler,
    ProcessControl,
    PsutilControl,
    RecordingControl,
    SignalResult,
)
from deviceplugin.enforcer.enforcer import (
    STOPPED_RECORD_NAME,
    EnforcementError,
    Enforcer,
    StoppedRecord,
    load_stopped_record,
    read_stopped_record,
    write_stopped_record,
)
from deviceplugin.enforcer.policy import (
    ControllerTuning,
    Decision,
    EnforcementPolicy,
    Kill,
    Record,
    Release,
    SetDuty,
)
from deviceplugin.enforcer.stopping import StopProcess, plain_stop

__all__ = [
    "STOPPED_RECORD_NAME",
    "ControllerTuning",
    "Decision",
    "DutyCycler",
    "EnforcementError",
    "EnforcementPolicy",
    "Enforcer",
    "Kill",
    "ProcessControl",
    "PsutilControl",
    "Record",
    "RecordingControl",
    "Release",
    "SetDuty",
    "SignalResult",
    "StopProcess",
    "StoppedRecord",
    "load_stopped_record",
    "plain_stop",
    "read_stopped_record",
    "write_stopped_record",
]
