"""The time-slicing model of the fake GPU, and what its sampler reads.

A process's SM utilisation is its `sm_demand_percent`, scaled down in proportion
when the running processes' total demand on its GPU exceeds 100, and 0 while the process is stopped
(SIGSTOP) or gone. A sampler thread reads the processes' run state every `sample_interval_s` and
integrates the utilisation over time (it sleeps, with no timer, while no process with a demand is
listed, and never reads the run state of one without); `poll` reports the average since the
previous poll, as NVML's process utilisation samples do. That is what lets a SIGSTOP/SIGCONT duty
cycle of a few hundred milliseconds show in the readings. The sampler stands for the driver's own
sampling, so it keeps to a CPU budget: 5% of a core, 1% while it tracks more than
`_MANY_PROCESSES` processes (a full node), its rounds spaced further apart when one costs more.
The sampler thread itself is FakeBackend's (`backend`), as it shares the backend's lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The sampler spends at most this fraction of a core (CPU time, its own thread's): when a round
# over many processes costs more, the rounds are spaced further apart than sample_interval_s.
_SAMPLER_CPU_BUDGET = 0.05
# Above this many processes to sample (hundreds on a full node), the budget is lower: a round then
# costs milliseconds (procfs formats every stat line), and the rounds come a few hundred ms apart,
# every process still sampled about once per poll at the default 500 ms.
_MANY_PROCESSES = 64
_SAMPLER_CPU_BUDGET_MANY = 0.01
# Run states of /proc/<pid>/stat in which a process does not compute: stopped, traced, zombie, dead.
_NOT_RUNNING_STATES = frozenset("TtZXx")
# Enough for any /proc/<pid>/stat line (52 fields and a command name of at most 64 bytes).
_STAT_READ_BYTES = 4096


def proc_stat_state(stat: bytes | str) -> str:
    """The run state letter (R, S, D, T, t, Z, ...) from the content of /proc/<pid>/stat.

    The command name in parentheses may itself contain spaces and parentheses, so the state is
    the first field after the last ')'. Raises ValueError for content that is not a stat line."""
    raw = stat.encode("utf-8", "surrogateescape") if isinstance(stat, str) else stat
    _, paren, rest = raw.rpartition(b")")
    fields = rest.split()
    if not paren or not fields:
        raise ValueError(f"not the content of /proc/<pid>/stat: {raw[:80]!r}")
    return fields[0].decode("ascii", "replace")


def _instant_utilisation(
    plan: Sequence[tuple[str, Sequence[tuple[int, float]]]], running: Mapping[int, bool]
) -> dict[tuple[str, int], float]:
    """SM utilisation per (gpu uuid, pid) at one instant: demand, scaled down in proportion when
    the running processes on the GPU want more than 100 in total; stopped processes get nothing."""
    utils: dict[tuple[str, int], float] = {}
    for uuid, processes in plan:
        total = sum(demand for pid, demand in processes if running.get(pid, False))
        scale = 1.0 if total <= 100 else 100.0 / total
        for pid, demand in processes:
            if running.get(pid, False):
                utils[(uuid, pid)] = demand * scale
    return utils
