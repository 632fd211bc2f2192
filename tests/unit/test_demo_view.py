"""The demo's live view: redrawn in place on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

import pytest

from deviceplugin.sim.demo_view import CLEAR_BELOW, CURSOR_UP, LiveView, _size


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_view_is_redrawn_in_place_below_the_events() -> None:
    out = Terminal()
    view = LiveView(out, terminal=True)
    view.update(["view 1", "line 2"])
    view.event("enforcer: throttling a/b/c")
    view.update(["view 2", "line 2", "line 3"])
    view.final()
    text = out.getvalue()
    erase_two = CURSOR_UP.format(2) + CLEAR_BELOW
    # The first view is erased before the event, drawn again under it, then replaced in place.
    assert text == (
        "view 1\nline 2\n"
        + erase_two
        + "enforcer: throttling a/b/c\nview 1\nline 2\n"
        + erase_two
        + "view 2\nline 2\nline 3\n"
    )


def test_elsewhere_only_events_are_written_and_the_view_once_at_the_end() -> None:
    out = io.StringIO()
    view = LiveView(out, terminal=False)
    view.update(["view 1"])
    view.event("process 42 of a/b/c has exited")
    view.update(["view 2"])
    assert out.getvalue() == "process 42 of a/b/c has exited\n"
    view.final()
    assert out.getvalue() == "process 42 of a/b/c has exited\nview 2\n"
    assert "\x1b" not in out.getvalue()


def test_the_live_view_fits_the_terminal_it_is_redrawn_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view taller than the terminal cannot be redrawn in place: on 80x24 it gets at most 22
    lines (an event line above it and the cursor's below), and 79 columns, so no line wraps."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    assert _size(LiveView(Terminal(), terminal=True)) == (79, 22)
    assert _size(LiveView(io.StringIO(), terminal=False)) == (80, None)
