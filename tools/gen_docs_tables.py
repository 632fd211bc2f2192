"""Write the docs' tables of flags and config keys from their declarations, or check them.

    python tools/gen_docs_tables.py          # rewrite every table between its markers
    python tools/gen_docs_tables.py --check  # exit 1 if a table is stale

The flags are declared in deviceplugin/flags.py, the config keys on the config's dataclasses
(deviceplugin/config/model.py). Each table sits between two marker comments,

    <!-- generated: NAME (tools/gen_docs_tables.py) -->
    ...
    <!-- end generated: NAME -->

and is written here, never by hand; tests/deploy/test_docs_tables.py fails when one is stale.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from deviceplugin.flags import SERVE_FLAGS, Flag

ROOT = Path(__file__).resolve().parent.parent


def flag_table(flags: Iterable[Flag]) -> str:
    """A Markdown table of `flags`: flag, variable, default, what it does."""
    rows = [("flag", "env", "default", "what it does"), ("---",) * 4]
    for flag in flags:
        default = prose(flag.default_words)
        if flag.default:
            default = f"`{flag.default}`" + (f", {default}" if default else "")
        rows.append(
            (f"`{flag.usage()}`", f"`{flag.env}`" if flag.env else "", default, prose(flag.help))
        )
    return markdown(rows)


def prose(text: str) -> str:
    """Plain text for a table cell: <uuid> stays text, not an HTML tag."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


def markdown(rows: Iterable[tuple[str, ...]]) -> str:
    """Rows as a Markdown table; a | inside a cell (a code span too) is escaped."""
    return "".join("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |\n" for row in rows)


# The flags docs/dra.md lists: those DRA mode reads.
DRA_FLAGS = (
    "--kubelet-api",
    "--kubeconfig",
    "--node-name",
    "--kubelet-root-dir",
    "--cdi-dir",
    "--dra-gpu-cdi",
)

# (file, table name, what writes the table)
TABLES: tuple[tuple[str, str, Callable[[], str]], ...] = (
    ("docs/design.md", "serve flags", lambda: flag_table(SERVE_FLAGS)),
    ("docs/dra.md", "dra flags", lambda: flag_table(named(SERVE_FLAGS, DRA_FLAGS))),
)


def named(flags: Iterable[Flag], names: Iterable[str]) -> list[Flag]:
    """The flags of `names`, in that order; KeyError for a name no flag has."""
    by_name = {flag.name: flag for flag in flags}
    return [by_name[name] for name in names]


def begin_marker(name: str) -> str:
    return f"<!-- generated: {name} (tools/gen_docs_tables.py) -->"


def end_marker(name: str) -> str:
    return f"<!-- end generated: {name} -->"


def with_table(text: str, name: str, table: str) -> str:
    """`text` with `table` between the markers of `name`; ValueError if they are missing."""
    begin, end = begin_marker(name), end_marker(name)
    head, found_begin, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the markers {begin!r} ... {end!r} are missing")
    return f"{head}{begin}\n{table}{end}{tail}"


def wanted(root: Path = ROOT) -> dict[Path, str]:
    """Each file that holds a table -> its text with every table current."""
    texts: dict[Path, str] = {}
    for name, table, render in TABLES:
        path = root / name
        text = texts.get(path, path.read_text())
        try:
            texts[path] = with_table(text, table, render())
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return texts


def stale(root: Path = ROOT) -> list[Path]:
    """The files whose tables are not what the declarations make."""
    return [path for path, text in wanted(root).items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write or check the docs' generated tables")
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    args = parser.parse_args(argv)
    texts = wanted()
    out_of_date = [path for path, text in texts.items() if path.read_text() != text]
    if args.check:
        for path in out_of_date:
            print(f"{path} is stale: run python tools/gen_docs_tables.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for path in out_of_date:
        path.write_text(texts[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
