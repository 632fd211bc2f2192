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

from deviceplugin.config import Config
from deviceplugin.config.defaults import yaml_value
from deviceplugin.config.keys import (
    Boolean,
    Choice,
    Const,
    Duration,
    Group,
    Integer,
    Items,
    Kind,
    Node,
    OneOrMore,
    Section,
    Size,
    Text,
    XidList,
    keys_of,
)
from deviceplugin.config.reader import format_duration, format_size
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


def config_table(nodes: Iterable[Node] = keys_of(Config)) -> str:
    """A Markdown table of every key of vgpu's format: path, default, what it takes, what it
    does. A list's items are `key[]`; a section is a row of its own, before its keys."""
    rows = [("key", "default", "takes", "what it does"), ("---",) * 4]
    rows += [_key_row(path, node) for path, node in _walk(nodes, "")]
    return markdown(rows)


def _walk(nodes: Iterable[Node], prefix: str) -> Iterable[tuple[str, Node]]:
    for node in nodes:
        path = f"{prefix}.{node.name}" if prefix else node.name
        yield path, node
        inside = f"{path}[]" if isinstance(node.declared.kind, Items) else path
        yield from _walk(node.children, inside)


def _key_row(path: str, node: Node) -> tuple[str, str, str, str]:
    declared = node.declared
    if isinstance(declared.kind, Section | Group):
        return (f"`{path}`", "", "a mapping", prose(declared.description))
    default = "none" if node.default is None else f"`{yaml_value(node)}`"
    if declared.example:
        default += f"; e.g. `{declared.example}`"
    if declared.deprecated:
        default = "deprecated"
    return (f"`{path}`", default, takes(declared.kind), prose(declared.description))


def takes(kind: Kind) -> str:
    """What a key of this kind takes, in words."""
    if isinstance(kind, Boolean):
        return "`true` or `false`"
    if isinstance(kind, Integer):
        if kind.maximum is None:
            return f"a whole number, at least {kind.minimum}"
        return f"a whole number, {kind.minimum} to {kind.maximum}"
    if isinstance(kind, Duration):
        return f"a duration, {format_duration(kind.minimum_s)} to {format_duration(kind.maximum_s)}"
    if isinstance(kind, Size):
        text = (
            "a size"
            if kind.minimum_bytes <= 1
            else f"a size, at least {format_size(kind.minimum_bytes)}"
        )
        return f"{text}, or 0" if kind.zero else text
    if isinstance(kind, Choice):
        values = ", ".join(f"`{m.value}`" for m in kind.values)
        return f"{values} ({kind.note})" if kind.note else values
    if isinstance(kind, OneOrMore):
        return "one or a list of " + ", ".join(f"`{m.value}`" for m in kind.values)
    if isinstance(kind, XidList):
        return "a list of Xid numbers"
    if isinstance(kind, Const):
        return f"`{kind.value}`"
    if isinstance(kind, Items):
        return "a list of mappings"
    assert isinstance(kind, Text), kind
    return prose(kind.what or "a string")


def prose(text: str) -> str:
    """Plain text for a table cell: <uuid> stays text, not an HTML tag, and *A100* is not
    emphasis."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


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
    ("docs/configuration.md", "config keys", config_table),
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
