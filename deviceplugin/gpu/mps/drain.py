"""The drain before an MPS client is stopped, and the watch for clients that left without one.

An MPS client killed while its GPU work is in flight orphans that work: every other client on the
GPU then fails, and every client that connects afterwards hangs in CUDA init, while the control
daemon answers as if all were well; only a restart of MPS clears it. The workaround is to
terminate the client through the control daemon first, which blocks new submissions and drains
its outstanding work, and only then kill it:

- MPS v2: `get_server_list`, `get_client_list <server>` to find the client's server, then
  `terminate_client <server> <client>`;
- MPS v3: `client list --all`, then `client terminate <client>`.

The terminate is bounded (`timeout_s`): one that does not return in time means the GPU is
wedged. A process that is not an MPS client is stopped as any other; one that is, while the
control daemon cannot be reached, is stopped without a drain (counted: there is no way to drain
it).

`ClientWatch` keeps the MPS clients seen at the last check: one gone since without a drain (the
kubelet's SIGKILL at pod deletion, a crash, or a clean exit: MPS does not say which) is a
reason to run the canary on its GPU.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

from deviceplugin.gpu.mps.protocol import V3, pids
from deviceplugin.gpu.mps.runner import ControlCommand, MpsCommandError, MpsTimeoutError


class DrainOutcome(enum.Enum):
    # Terminated through the control daemon: it may be killed.
    DRAINED = "drained"
    # Not an MPS client: nothing to drain.
    NOT_A_CLIENT = "not_a_client"
    # The control daemon could not be asked: stopped without a drain.
    UNREACHABLE = "unreachable"
    # The terminate did not return in time: the GPU is wedged.
    WEDGED = "wedged"


@dataclass(frozen=True, slots=True)
class Drain:
    outcome: DrainOutcome
    detail: str = ""


class Drainer:
    """Lists MPS clients and terminates them, on one control daemon."""

    def __init__(self, runner: ControlCommand, protocol: int, timeout_s: float) -> None:
        self._runner = runner
        self._protocol = protocol
        self.timeout_s = timeout_s

    def clients(self) -> dict[int, str]:
        """Every MPS client's PID, with its server under v2 (its PID) or "" under v3. Raises
        MpsCommandError."""
        if self._protocol == V3:
            return dict.fromkeys(pids(self._runner.send("client list --all")), "")
        found: dict[int, str] = {}
        for server in pids(self._runner.send("get_server_list")):
            for client in pids(self._runner.send(f"get_client_list {server}")):
                found[client] = str(server)
        return found

    def drain(self, pid: int) -> Drain:
        """Terminate `pid` through the control daemon if it is an MPS client; never raises."""
        try:
            clients = self.clients()
        except MpsCommandError as e:
            return Drain(DrainOutcome.UNREACHABLE, str(e))
        if pid not in clients:
            return Drain(DrainOutcome.NOT_A_CLIENT)
        command = (
            f"client terminate {pid}"
            if self._protocol == V3
            else f"terminate_client {clients[pid]} {pid}"
        )
        try:
            self._runner.send(command, timeout_s=self.timeout_s)
        except MpsTimeoutError as e:
            return Drain(DrainOutcome.WEDGED, str(e))
        except MpsCommandError as e:
            # Refused: the client may have left meanwhile; if it is still listed, it was not
            # drained and stopping it is no worse than without the attempt.
            try:
                still = pid in self.clients()
            except MpsCommandError:
                still = True
            if still:
                return Drain(DrainOutcome.UNREACHABLE, str(e))
            return Drain(DrainOutcome.NOT_A_CLIENT, "left while it was drained")
        return Drain(DrainOutcome.DRAINED)


@dataclass(slots=True)
class ClientWatch:
    """The clients seen at the last check, and those drained since."""

    seen: set[int] = field(default_factory=set)
    drained: set[int] = field(default_factory=set)

    def note_drained(self, pid: int) -> None:
        self.drained.add(pid)

    def left_undrained(self, now: Collection[int]) -> set[int]:
        """The clients seen last time that are gone now and were not drained; remembers
        `now` for next time."""
        current = set(now)
        gone = self.seen - current - self.drained
        self.seen = current
        self.drained &= current
        return gone

    def reset(self) -> None:
        self.seen = set()
        self.drained = set()
