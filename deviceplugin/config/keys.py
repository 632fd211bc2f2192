"""What a key of the config file is, declared once on the dataclass field that holds its value.

A field of a config dataclass (`model`) declares its key with `key()`, `section()` or `inline()`:
the key's name in the file, the kind of value it takes (with its unit and bounds), a
description and, for a key without a default, an example. The default is the field's. From
these declarations the parser (`vgpu`) reads vgpu's format, and the JSON Schema (`schema`), the
commented default config (`defaults`) and the docs' key table (tools/gen_docs_tables.py) are
written; hand-written code remains only for rules across keys and NVIDIA's format.

`keys_of(cls)` walks a dataclass's declarations as the file nests them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from deviceplugin.config.values import MAX_DURATION_S

T = TypeVar("T")

_DECLARED = "vgpu.config.key"


@dataclass(frozen=True, slots=True)
class Boolean:
    """true or false."""


@dataclass(frozen=True, slots=True)
class Integer:
    minimum: int
    maximum: int | None = None


@dataclass(frozen=True, slots=True)
class Duration:
    """A duration with a unit (500ms, 2s, 1m30s), held as seconds."""

    minimum_s: float = 0.0
    maximum_s: float = MAX_DURATION_S


@dataclass(frozen=True, slots=True)
class Size:
    """A size (10Gi, 512Mi, 1G, or a whole number of bytes), held as bytes. `zero`: 0 is taken
    too, though no other value below `minimum_bytes` is."""

    minimum_bytes: int = 1
    zero: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    """One of an enum's values, or of `synonyms` (another name for a value), which `note`
    mentions in the message for a value that is none of them."""

    values: type[StrEnum]
    synonyms: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    def options(self) -> dict[str, StrEnum]:
        """Every accepted spelling -> its value."""
        members: dict[str, StrEnum] = {m.value: m for m in self.values}
        return members | {name: members[value] for name, value in self.synonyms.items()}

    def shown(self) -> str:
        """The values as a message lists them."""
        values = ", ".join(m.value for m in self.values)
        return f"{values} ({self.note})" if self.note else values


@dataclass(frozen=True, slots=True)
class OneOrMore:
    """One of an enum's values, or a list of distinct ones."""

    values: type[StrEnum]


@dataclass(frozen=True, slots=True)
class XidList:
    """A list of distinct Xid numbers (positive integers); null is empty."""


@dataclass(frozen=True, slots=True)
class Text:
    """A string. `what` it is, in words, where the description does not say; `pattern`,
    `not_pattern`, `min_length` and `max_length` describe it to the JSON Schema (the parser
    checks it with code: see `vgpu`)."""

    what: str = ""
    pattern: str = ""
    not_pattern: str = ""
    min_length: int | None = None
    max_length: int | None = None


@dataclass(frozen=True, slots=True)
class Const:
    """Only this value."""

    value: str


@dataclass(frozen=True, slots=True)
class Section:
    """A mapping of the keys that `of` declares."""

    of: type


@dataclass(frozen=True, slots=True)
class Items:
    """A list of mappings of the keys that `of` declares; null is empty."""

    of: type


@dataclass(frozen=True, slots=True)
class Group:
    """A mapping of keys that the dataclass keeps in fields of its own."""


Kind = (
    Boolean
    | Integer
    | Duration
    | Size
    | Choice
    | OneOrMore
    | XidList
    | Text
    | Const
    | Section
    | Items
    | Group
)


@dataclass(frozen=True, slots=True)
class Declared:
    """A field's key: its `name` in the file, the `kind` of value, a `description`; `example`
    (YAML) shows a value where there is no default. `group`: the mapping the key sits in when
    the dataclass keeps it flat (`dra.memory.min` is DraConfig.memory_min_bytes), with
    `group_description`. `deprecated`: an old spelling, read but never written. `inline`: the
    keys of the field's dataclass sit at this level, with no key of their own."""

    name: str
    kind: Kind
    description: str
    example: str = ""
    group: str = ""
    group_description: str = ""
    deprecated: bool = False
    inline: bool = False


def key(
    name: str,
    default: T,
    kind: Kind,
    description: str,
    *,
    example: str = "",
    group: tuple[str, str] = ("", ""),
    deprecated: bool = False,
) -> T:
    """A field with this default, holding the value of key `name`. `group`: (the mapping's
    name, its description) for a key that the dataclass keeps flat."""
    declared = Declared(name, kind, description, example, *group, deprecated=deprecated)
    result: T = field(default=default, metadata={_DECLARED: declared})
    return result


def section(name: str, cls: type[T], description: str) -> T:
    """A field holding section `name`: a mapping of the keys that `cls` declares."""
    declared = Declared(name, Section(cls), description)
    result: T = field(default_factory=cls, metadata={_DECLARED: declared})
    return result


def required(name: str, kind: Kind, description: str) -> Any:
    """A field without a default holding the value of key `name` (in a list item)."""
    return field(metadata={_DECLARED: Declared(name, kind, description)})


def inline(cls: type[T], factory: Callable[[], T] | None = None) -> T:
    """A field holding a `cls` whose keys sit at this level of the file; without `factory` it
    has no default (in a list item)."""
    declared = Declared("", Section(cls), "", inline=True)
    if factory is None:
        result: T = field(metadata={_DECLARED: declared})
    else:
        result = field(default_factory=factory, metadata={_DECLARED: declared})
    return result


@dataclass(frozen=True, slots=True)
class Node:
    """A key of the file as it nests: its declaration, its default (None: none), the field that
    holds its value ("" for a group), and the keys inside it (a section's, a group's, or a list
    item's)."""

    name: str
    declared: Declared
    default: object
    attribute: str
    children: tuple[Node, ...] = ()


def keys_of(cls: type, instance: object = None) -> tuple[Node, ...]:
    """The keys `cls` declares, in order, with their defaults as `instance` (else a `cls()`,
    where `cls` has defaults) holds them. A group's keys are gathered in a node of their own,
    where the group's first key is."""
    if instance is None and all(_has_default(f) for f in fields(cls)):
        instance = cls()
    nodes: list[Node | list[Node]] = []
    groups: dict[str, list[Node]] = {}
    for f in fields(cls):
        declared: Declared | None = f.metadata.get(_DECLARED)
        if declared is None:
            continue  # not a key of vgpu's format (NVIDIA's only, or bookkeeping)
        default = getattr(instance, f.name) if instance is not None else None
        children: tuple[Node, ...] = ()
        if isinstance(declared.kind, Section):
            children = keys_of(declared.kind.of, default)
        elif isinstance(declared.kind, Items):
            children = keys_of(declared.kind.of)
        if declared.inline:
            nodes.extend(children)
            continue
        node = Node(declared.name, declared, default, f.name, children)
        if not declared.group:
            nodes.append(node)
        elif declared.group in groups:
            groups[declared.group].append(node)
        else:
            groups[declared.group] = [node]
            nodes.append(groups[declared.group])
    return tuple(_group(n) if isinstance(n, list) else n for n in nodes)


def _has_default(f: Field[Any]) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _group(members: list[Node]) -> Node:
    first = members[0].declared
    declared = Declared(first.group, Group(), first.group_description)
    return Node(first.group, declared, None, "", tuple(members))
