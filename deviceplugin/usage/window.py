"""Pure: time-weighted averages over a sliding window, per key (docs/design.md §5: utilisation
ratios averaged over `enforcement.compute.window`, so that a scrape does not beat against a duty
cycle)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from collections.abc import Set as AbstractSet

# Running sums are recomputed from the samples after this many updates, so that rounding
# errors of adding and subtracting cannot accumulate over a long run.
_RESUM_EVERY = 1024
# Total weights below this many seconds count as no time at all (rounding residue).
_MIN_WEIGHT_S = 1e-9
# A sample starting at most this long after the previous one ended follows on from it (a poll's
# start is computed as its end minus its duration, which may round a little past the last end).
_MERGE_GAP_S = 1e-6


class _Series:
    """The samples of one key, oldest first, with the running sums of their full weights."""

    __slots__ = ("in_order", "samples", "updates", "weight_total", "weighted_sum")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float, float]] = deque()  # (start_s, end_s, value)
        self.weighted_sum = 0.0
        self.weight_total = 0.0
        self.updates = 0
        # True while starts and ends never decrease: then the samples that reach back before the
        # window are a prefix of the deque, and an average needs to look at that prefix only.
        self.in_order = True

    def resum(self) -> None:
        self.weighted_sum = math.fsum((end - start) * value for start, end, value in self.samples)
        self.weight_total = math.fsum(end - start for start, end, _ in self.samples)
        self.updates = 0

    def follows(self, start_s: float, end_s: float, value: float) -> bool:
        """Whether a sample (start_s, end_s, value) carries on the last one: in order, the same
        value, starting where it ended. `stretch` then makes the two one sample, which gives the
        same averages over any window; a steady key keeps a single sample."""
        last_start, last_end, last_value = self.samples[-1]
        return (
            self.in_order
            and value == last_value
            and start_s >= last_start
            and end_s >= last_end
            and abs(start_s - last_end) <= _MERGE_GAP_S
        )

    def stretch(self, end_s: float) -> None:
        """Make the last sample end at `end_s` (see `follows`)."""
        start_s, last_end, value = self.samples[-1]
        self.samples[-1] = (start_s, end_s, value)
        self.weighted_sum += (end_s - last_end) * value
        self.weight_total += end_s - last_end


def _single_average(sample: tuple[float, float, float], window_start_s: float) -> float:
    """The average of a key holding only `sample`: its value, exactly (running sums of its
    pieces round), so that an unchanged container reads the same from one poll to the next."""
    start_s, end_s, value = sample
    return value if end_s - max(start_s, window_start_s) > _MIN_WEIGHT_S else 0.0


def _clipped_average(
    samples: Iterable[tuple[float, float, float]], window_start_s: float, now_s: float
) -> float | None:
    """The average of samples over [window_start_s, now_s], each weighed by its overlap."""
    seen = False
    weight_total = 0.0
    weighted_sum = 0.0
    for start, end, value in samples:
        if end <= window_start_s or start > now_s:
            continue
        seen = True
        weight = min(end, now_s) - max(start, window_start_s)
        if weight > 0:
            weight_total += weight
            weighted_sum += weight * value
    if not seen:
        return None
    return weighted_sum / weight_total if weight_total > _MIN_WEIGHT_S else 0.0


class UtilizationWindow:
    """Time-weighted averages over the last `window_s` seconds, per key.

    A sample is the average of a value over [end_s - duration_s, end_s]; it weighs in proportion to
    the part of that interval that lies inside the window. Samples that ended before the window of
    the newest one are dropped as new ones arrive. Samples added in time order (the usual case: one
    per poll) are averaged in constant time; any order gives the same result, more slowly."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._series: dict[Hashable, _Series] = {}

    def __len__(self) -> int:
        """How many keys hold samples."""
        return len(self._series)

    def add(self, key: Hashable, end_s: float, duration_s: float, value: float) -> float | None:
        """Add a sample; return the key's average at `end_s` (as `average(key, end_s)`)."""
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series()
        samples = series.samples
        start_s = end_s - max(duration_s, 0.0)
        if samples and series.follows(start_s, end_s, value):
            series.stretch(end_s)
            if len(samples) == 1 and series.updates + 1 < _RESUM_EVERY:
                # The usual case, made short: a steady key gets the same value again.
                series.updates += 1
                return _single_average(samples[0], end_s - self.window_s)
        else:
            if samples and (start_s < samples[-1][0] or end_s < samples[-1][1]):
                series.in_order = False
            samples.append((start_s, end_s, value))
            series.weighted_sum += (end_s - start_s) * value
            series.weight_total += end_s - start_s
        if series.in_order:
            horizon = end_s - self.window_s
            while samples[0][1] <= horizon:
                old_start, old_end, old_value = samples.popleft()
                series.weighted_sum -= (old_end - old_start) * old_value
                series.weight_total -= old_end - old_start
        else:
            horizon = max(end for _, end, _ in samples) - self.window_s
            kept = [sample for sample in samples if sample[1] > horizon]
            if len(kept) != len(samples):
                series.samples = deque(kept)
                series.updates = _RESUM_EVERY  # recompute the sums below
        series.updates += 1
        if series.updates >= _RESUM_EVERY:
            series.resum()
        return self.average(key, end_s)

    def extend(
        self, items: Iterable[tuple[Hashable, float]], end_s: float, duration_s: float
    ) -> bool:
        """`add(key, end_s, duration_s, value)` for every (key, value) of `items`, when each key
        holds one sample of that value, ending where this one starts: then the averages stay
        those values, and True. Otherwise nothing is added, and False."""
        start_s = end_s - max(duration_s, 0.0)
        steady: list[_Series] = []
        for key, value in items:
            series = self._series.get(key)
            if (
                series is None
                or len(series.samples) != 1
                or series.updates + 1 >= _RESUM_EVERY
                or not series.follows(start_s, end_s, value)
            ):
                return False
            steady.append(series)
        for series in steady:
            series.stretch(end_s)
            series.updates += 1
        return True

    def average(self, key: Hashable, now_s: float) -> float | None:
        """The time-weighted mean of the key's samples within [now_s - window_s, now_s]; None when
        there is none. Samples that cover no time there (duration 0) give 0.0."""
        series = self._series.get(key)
        if series is None or not series.samples:
            return None
        samples = series.samples
        window_start_s = now_s - self.window_s
        if not series.in_order or now_s < samples[-1][1]:
            return _clipped_average(samples, window_start_s, now_s)
        if samples[-1][1] <= window_start_s:
            return None
        if len(samples) == 1:
            return _single_average(samples[0], window_start_s)
        # Every sample ends by now_s; only a prefix reaches back before the window: take its
        # full weight out of the running sums and put back the part inside the window.
        weighted_sum = series.weighted_sum
        weight_total = series.weight_total
        for start, end, value in samples:
            if start >= window_start_s:
                break
            weighted_sum -= (end - start) * value
            weight_total -= end - start
            if end > window_start_s:
                weighted_sum += (end - window_start_s) * value
                weight_total += end - window_start_s
        return weighted_sum / weight_total if weight_total > _MIN_WEIGHT_S else 0.0

    def forget_except(self, keys: AbstractSet[Hashable]) -> None:
        """Drop every key not in `keys`, so that memory follows what is still there."""
        for key in [k for k in self._series if k not in keys]:
            del self._series[key]
