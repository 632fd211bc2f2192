"""Unit tests for deviceplugin.usage.window: the utilisation window, a time-weighted average."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.usage.window import UtilizationWindow

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"


def test_window_weights_samples_by_duration() -> None:
    window = UtilizationWindow(10.0)
    window.add("k", end_s=1.0, duration_s=1.0, value=0.2)
    window.add("k", end_s=3.0, duration_s=2.0, value=0.8)
    assert window.average("k", 3.0) == pytest.approx((1 * 0.2 + 2 * 0.8) / 3)


def test_window_counts_only_the_part_of_a_sample_inside_it() -> None:
    window = UtilizationWindow(3.0)
    window.add("k", end_s=2.0, duration_s=2.0, value=1.0)  # [0, 2]: only [1, 2] is in the window
    window.add("k", end_s=4.0, duration_s=2.0, value=0.0)
    assert window.average("k", 4.0) == pytest.approx(1 / 3)


def test_window_expires_old_samples() -> None:
    window = UtilizationWindow(5.0)
    window.add("k", end_s=1.0, duration_s=1.0, value=1.0)
    for end in (2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        window.add("k", end_s=end, duration_s=1.0, value=0.0)
    assert window.average("k", 7.0) == 0.0  # the 1.0 sample ended before the window began
    assert window.average("k", 100.0) is None  # nothing left inside the window


def test_window_zero_duration_samples_average_to_zero() -> None:
    window = UtilizationWindow(5.0)
    window.add("k", end_s=1.0, duration_s=0.0, value=0.9)
    assert window.average("k", 1.0) == 0.0
    window.add("k", end_s=2.0, duration_s=1.0, value=0.4)
    assert window.average("k", 2.0) == pytest.approx(0.4)


def test_window_unknown_key_is_none() -> None:
    assert UtilizationWindow(5.0).average("nobody", 1.0) is None


def test_window_keys_are_independent() -> None:
    window = UtilizationWindow(5.0)
    window.add(("a", UUID0), 1.0, 1.0, 0.3)
    window.add(("b", UUID0), 1.0, 1.0, 0.7)
    assert window.average(("a", UUID0), 1.0) == pytest.approx(0.3)
    assert window.average(("b", UUID0), 1.0) == pytest.approx(0.7)


def test_window_forget_except_drops_the_rest() -> None:
    window = UtilizationWindow(5.0)
    for key in ("a", "b", "c"):
        window.add(key, 1.0, 1.0, 0.5)
    window.forget_except({"b", "zzz"})
    assert len(window) == 1
    assert window.average("a", 1.0) is None
    assert window.average("b", 1.0) == pytest.approx(0.5)
    assert window.average("c", 1.0) is None


def test_window_stays_bounded_over_many_samples() -> None:
    window = UtilizationWindow(5.0)
    for tick in range(1, 2001):
        window.add("k", end_s=tick * 0.5, duration_s=0.5, value=(tick % 2) * 1.0)
    assert window.average("k", 1000.0) == pytest.approx(0.5)
    # Samples older than the window are dropped as new ones arrive (a private detail, checked
    # here because memory must stay bounded).
    assert len(window._series["k"].samples) <= 11


def test_window_keeps_one_sample_for_a_steady_value() -> None:
    window = UtilizationWindow(5.0)
    window.add("k", end_s=0.5, duration_s=0.5, value=0.9)
    for tick in range(2, 7):
        window.add("k", end_s=tick * 0.5, duration_s=0.5, value=0.25)
    assert window.average("k", 3.0) == pytest.approx((0.5 * 0.9 + 2.5 * 0.25) / 3.0)
    for tick in range(7, 2001):
        window.add("k", end_s=tick * 0.5, duration_s=0.5, value=0.25)
    assert window.average("k", 1000.0) == pytest.approx(0.25)
    # Polls of a steady container (most of them, most polls) cost one sample, not the window's
    # worth (a private detail: the average stays one step).
    assert len(window._series["k"].samples) == 1


def test_window_extend_adds_only_to_keys_that_hold_still() -> None:
    def window_of(*samples: tuple[str, float, float, float]) -> UtilizationWindow:
        window = UtilizationWindow(5.0)
        for key, end_s, duration_s, value in samples:
            window.add(key, end_s, duration_s, value)
        return window

    steady = window_of(("a", 1.0, 1.0, 0.5), ("a", 2.0, 1.0, 0.5), ("b", 2.0, 2.0, 0.25))
    assert steady.extend([("a", 0.5), ("b", 0.25)], 3.0, 1.0)
    added = window_of(("a", 1.0, 1.0, 0.5), ("a", 2.0, 1.0, 0.5), ("b", 2.0, 2.0, 0.25))
    added.add("a", 3.0, 1.0, 0.5)
    added.add("b", 3.0, 1.0, 0.25)
    for key in ("a", "b"):
        assert steady._series[key].samples == added._series[key].samples  # (private detail)
        assert steady.average(key, 3.0) == added.average(key, 3.0)

    for refused in (
        window_of(("a", 2.0, 1.0, 0.5), ("a", 2.0, 0.0, 0.9)),  # two samples
        window_of(("a", 2.0, 1.0, 0.9)),  # another value
        window_of(("a", 1.0, 1.0, 0.5)),  # a gap before this one
    ):
        before = list(refused._series["a"].samples)
        assert not refused.extend([("a", 0.5)], 3.0, 1.0)
        assert list(refused._series["a"].samples) == before
    assert not UtilizationWindow(5.0).extend([("nobody", 0.5)], 3.0, 1.0)


def test_window_samples_out_of_order_give_the_same_average() -> None:
    ordered = UtilizationWindow(4.0)
    shuffled = UtilizationWindow(4.0)
    samples = [(1.0, 1.0, 0.9), (2.0, 1.0, 0.1), (4.0, 2.0, 0.5), (5.0, 1.0, 0.3)]
    for sample in samples:
        ordered.add("k", *sample)
    for sample in (samples[2], samples[0], samples[3], samples[1]):
        shuffled.add("k", *sample)
    expected = (1 * 0.1 + 2 * 0.5 + 1 * 0.3) / 4  # [1, 5]: the first sample is outside
    assert ordered.average("k", 5.0) == pytest.approx(expected)
    assert shuffled.average("k", 5.0) == pytest.approx(expected)


def test_window_average_at_an_earlier_time_clips_at_that_time() -> None:
    window = UtilizationWindow(10.0)
    window.add("k", end_s=2.0, duration_s=2.0, value=1.0)
    window.add("k", end_s=4.0, duration_s=2.0, value=0.0)
    assert window.average("k", 3.0) == pytest.approx(2 / 3)  # [0, 2] at 1.0, [2, 3] at 0.0


sample_lists = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(1e-3, 3.0)),  # from the previous sample's end
        st.one_of(st.just(0.0), st.floats(1e-3, 4.0)),  # duration
        # value: repeated ones too, which the window merges with the sample before
        st.one_of(st.sampled_from([0.0, 0.5]), st.floats(0.0, 1.0)),
    ),
    min_size=1,
    max_size=40,
)


@given(
    samples=sample_lists,
    window_s=st.floats(0.1, 10.0),
    contiguous=st.booleans(),
    later_s=st.floats(0.0, 5.0),
)
def test_window_matches_a_direct_computation(
    samples: list[tuple[float, float, float]], window_s: float, contiguous: bool, later_s: float
) -> None:
    """Against the definition, with every sample kept: contiguous polls (the daemon's case), and
    samples with gaps or reaching back over earlier ones; queried at the newest sample's end and
    later."""
    window = UtilizationWindow(window_s)
    added: list[tuple[float, float, float]] = []
    end = 0.0
    for step, duration, value in samples:
        end += step
        span = step if contiguous else duration
        returned = window.add("k", end, span, value)
        assert returned == window.average("k", end)  # add answers the average at its end
        added.append((end - span, end, value))
        for now in (end, end + later_s):
            lo = now - window_s
            inside = [(s, e, v) for s, e, v in added if e > lo and s <= now]
            weights = [(min(e, now) - max(s, lo), v) for s, e, v in inside]
            total = sum(w for w, _ in weights)
            got = window.average("k", now)
            if not inside:
                assert got is None
            elif total < 1e-6:
                assert got == 0.0
            else:
                assert got is not None
                expected = sum(w * v for w, v in weights) / total
                assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("window_s", [0.0, -1.0])
def test_window_needs_a_positive_length(window_s: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        UtilizationWindow(window_s)
