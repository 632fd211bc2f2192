"""How the enforcer stops a process for good (a memory kill): through a `StopProcess`, given the
PID and the kill it would send, which decides when to send it. By default it is sent at once
(`plain_stop`). Where the GPU is shared through MPS, the composition root gives the MPS
supervisor's `stop_client` instead, which first terminates the process through the MPS control
daemon (draining its GPU work: an MPS client killed with work in flight wedges its GPU for every
client), then sends the kill. The enforcer resumes a process it holds stopped before either."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from deviceplugin.enforcer.control import SignalResult

Kill = Callable[[], SignalResult]


class StopProcess(Protocol):
    def __call__(self, pid: int, kill: Kill, /) -> SignalResult:
        """Stop process `pid` for good: call `kill` (once) when it is safe, and return what
        it returned."""
        ...


def plain_stop(pid: int, kill: Kill, /) -> SignalResult:
    """The kill at once: for processes that share the GPU without MPS."""
    return kill()
