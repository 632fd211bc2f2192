"""The docs' tables of flags and config keys are written from the declarations by
tools/gen_docs_tables.py, never by hand: a stale table fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.flags import SERVE_FLAGS, Flag
from tools import gen_docs_tables


def test_every_generated_table_is_current() -> None:
    assert gen_docs_tables.stale() == [], "stale: run python tools/gen_docs_tables.py"


def test_a_new_flag_reaches_the_table_from_its_declaration_alone() -> None:
    new = Flag("--new-thing", "what it does", env="VGPU_NEW_THING", default="on", metavar="X")
    table = gen_docs_tables.flag_table((*SERVE_FLAGS, new))
    assert "| `--new-thing X` | `VGPU_NEW_THING` | `on` | what it does |" in table


def test_markers_missing_from_a_page_are_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        gen_docs_tables.with_table(page.read_text(), "serve flags", "| table |\n")


def test_the_table_replaces_only_what_is_between_its_markers() -> None:
    name = "serve flags"
    text = (
        f"before\n{gen_docs_tables.begin_marker(name)}\nold\n"
        f"{gen_docs_tables.end_marker(name)}\nafter\n"
    )
    written = gen_docs_tables.with_table(text, name, "new\n")
    assert written == (
        f"before\n{gen_docs_tables.begin_marker(name)}\nnew\n"
        f"{gen_docs_tables.end_marker(name)}\nafter\n"
    )
