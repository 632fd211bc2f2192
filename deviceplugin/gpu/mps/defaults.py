"""The MPS v2 defaults: one slice's limits per GPU (`MpsDefaults.commands()`), sent to the control
daemon, and read back so that a default a client changed through the control socket is found.

Every MPS client process that connects after the defaults are set is held to them by the GPU. A
default that a client changed is set again, logged and counted (`drift_total`) by the
supervisor."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from deviceplugin.allocation import MpsDefaults
from deviceplugin.gpu.mps.runner import ControlCommand

log = logging.getLogger(__name__)

# What drift_total counts: a default changed behind the daemon's back, or a quit it did not send.
DRIFT_MEMORY = "pinned_mem_limit"
DRIFT_THREADS = "active_thread_percentage"
DRIFT_QUIT = "quit"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_SIZE_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def mib(text: str) -> float | None:
    """A size as the control daemon prints it ("20480M", "20G", "0") in MiB, or None."""
    match = _SIZE.match(text)
    if match is None:
        return None
    return float(match.group(1)) * _SIZE_MIB[match.group(2).upper()]


@dataclass(frozen=True, slots=True)
class Drift:
    """A default found changed: what (DRIFT_*), the command that sets it again, what was found
    and what it is set to."""

    change: str
    restore: str
    found: str
    wanted: str


def apply_defaults(command: ControlCommand, defaults: MpsDefaults, where: str) -> tuple[str, ...]:
    """Send every default, one run each; the commands sent. Raises MpsCommandError."""
    commands = defaults.commands()
    for line in commands:
        command.send(line)
    log.info(
        "MPS defaults set pipe_directory=%s commands=%s",
        where,
        "; ".join(commands) or "none (no GPU is sliced)",
    )
    return commands


def find_drift(
    command: ControlCommand, defaults: MpsDefaults, unreadable: Callable[[str], None]
) -> list[Drift]:
    """Read the defaults back (in one run where the control daemon answers every line); each
    one that differs from `defaults`. `unreadable` is told each answer that is not a figure.
    Raises MpsCommandError."""
    reads = [f"get_default_device_pinned_mem_limit {uuid}" for uuid, _ in
             defaults.pinned_mem_limit_mib]  # fmt: skip
    if defaults.active_thread_percentage is not None:
        reads.append("get_default_active_thread_percentage")
    if not reads:
        return []
    answers = command.run([], "".join(f"{r}\n" for r in reads)).splitlines()
    if len(answers) != len(reads):
        answers = [command.send(r) for r in reads]
    found: list[Drift] = []
    for (uuid, want_mib), answer in zip(defaults.pinned_mem_limit_mib, answers, strict=False):
        seen = mib(answer)
        if seen is None:
            unreadable(answer)
        elif round(seen) != want_mib:
            found.append(
                Drift(
                    DRIFT_MEMORY,
                    f"set_default_device_pinned_mem_limit {uuid} {want_mib}M",
                    f"{uuid}={answer.strip()}",
                    f"{uuid}={want_mib}M",
                )
            )
    want = defaults.active_thread_percentage
    if want is not None:
        answer = answers[-1]
        try:
            seen_threads: float | None = float(answer)
        except ValueError:
            seen_threads = None
            unreadable(answer)
        if seen_threads is not None and round(seen_threads) != want:
            found.append(
                Drift(
                    DRIFT_THREADS,
                    f"set_default_active_thread_percentage {want}",
                    answer.strip(),
                    str(want),
                )
            )
    return found


def restore_drifted(
    command: ControlCommand,
    defaults: MpsDefaults,
    unreadable: Callable[[str], None],
    count: Callable[[str], None],
    where: str,
) -> None:
    """Read the defaults back; set again, log and `count` each one that a client changed.
    Raises MpsCommandError."""
    for drift in find_drift(command, defaults, unreadable):
        command.send(drift.restore)
        count(drift.change)
        log.warning(
            "an MPS default was changed through the control socket, not by this daemon "
            "(MPS does not say which client sent it); set again setting=%s found=%s "
            "restored=%s pipe_directory=%s",
            drift.change,
            drift.found,
            drift.wanted,
            where,
        )
