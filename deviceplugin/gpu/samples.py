"""Samples a GPU backend hands out again while a process's figures hold still."""

from __future__ import annotations

from deviceplugin.model import ProcessSample


class SampleReuse:
    """Hands out the previous poll's ProcessSample for a process whose figures did not change.

    A backend makes every sample through one of these (keyed as it likes: per GPU and PID), and
    calls `next_poll` once a poll is read. A GPU whose processes hold still then reads as the
    very objects of the poll before, which the snapshot build recognises without comparing
    field by field (most processes, most polls: an idle process keeps its memory and has no
    utilisation)."""

    __slots__ = ("_current", "_previous")

    def __init__(self) -> None:
        self._previous: dict[object, ProcessSample] = {}
        self._current: dict[object, ProcessSample] = {}

    def sample(
        self, key: object, pid: int, used_memory_bytes: int | None, sm_util_percent: float | None
    ) -> ProcessSample:
        kept = self._previous.get(key)
        if (
            kept is None
            or kept.pid != pid
            or kept.used_memory_bytes != used_memory_bytes
            or kept.sm_util_percent != sm_util_percent
        ):
            kept = ProcessSample(pid, used_memory_bytes, sm_util_percent)
        self._current[key] = kept
        return kept

    def keep(self, key: object, sample: ProcessSample) -> None:
        """Count `sample`, handed out again by the backend itself, as made in this poll."""
        self._current[key] = sample

    def next_poll(self) -> None:
        """Samples made from now on are compared with those made since the last call."""
        self._previous, self._current = self._current, {}
