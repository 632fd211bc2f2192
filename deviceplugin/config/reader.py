"""The typed reader of YAML-loaded data, and durations, sizes and resource names.

parse_config() checks the YAML-loaded data section by section through a _Reader, which collects
every problem before it raises, so that one run of `check-config` shows everything that is wrong.
Each problem starts with the key path (`slicing.overrides[1].match`) and shows the bad value.
parse_duration/format_duration and parse_size/format_size read and write the config's units.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

from deviceplugin.config.values import (
    MAX_DURATION_S,
    DeviceIdStrategy,
    DeviceListStrategy,
)

_DURATION_HINT = "use e.g. 500ms, 2s"
_SIZE_HINT = "use e.g. 10Gi, 512Mi, 1G or a whole number of bytes"

_DURATION_UNITS_S: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # the micro sign, as Go's time.ParseDuration accepts it
    "μs": 1e-6,  # the Greek mu, the same
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_BARE_NUMBER = re.compile(r"[+-]?(\d+(?:\.\d*)?|\.\d+)")

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "KiB": 1024,
    "Mi": 1024**2,
    "MiB": 1024**2,
    "Gi": 1024**3,
    "GiB": 1024**3,
    "Ti": 1024**4,
    "TiB": 1024**4,
}
# KB, MB, GB and TB mean 1000^n to some and 1024^n to others (nvidia-smi's "80GB" is GiB), and
# Kubernetes quantities refuse them: a size says which it means.
_AMBIGUOUS_SIZE_UNITS = {"KB": ("K", "Ki"), "MB": ("M", "Mi"), "GB": ("G", "Gi"), "TB": ("T", "Ti")}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)")

# Extended resource names, as the kubelet's IsExtendedResourceName checks them.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MAX_NAME_LENGTH = 63
_MAX_SUBDOMAIN_LENGTH = 253
_QUOTA_PREFIX = "requests."

_STRATEGIES: dict[str, DeviceListStrategy] = {s.value: s for s in DeviceListStrategy}
_ID_STRATEGIES: dict[str, DeviceIdStrategy] = {s.value: s for s in DeviceIdStrategy}

_T = TypeVar("_T")


def _show(value: object) -> str:
    """A value as the user wrote it in YAML, for messages (a long one shortened)."""
    if isinstance(value, str):
        return _shorten(json.dumps(value, ensure_ascii=False))
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _shorten(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def _kind(value: object) -> str:
    return "a string" if isinstance(value, str) else _show(value)


def parse_duration(value: str | int | float) -> float:
    """Seconds from a duration such as `500ms`, `2s`, `1.5s`, `1m30s` or `250us`.

    Units: ns, us, ms, s, m, h. A bare number is refused (is `2` seconds or milliseconds?), except
    0. A leading sign is accepted, so that range checks can report negative values as such."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
    if not isinstance(value, str):
        if value == 0:
            return 0.0
        raise ValueError(
            f"{_show(value)} has no unit: durations need one (use e.g. {value}s or {value}ms)"
        )
    text = value.strip()
    if _BARE_NUMBER.fullmatch(text):
        if float(text) == 0:
            return 0.0
        raise ValueError(
            f"{_show(value)} has no unit: durations need one (use e.g. {text}s or {text}ms)"
        )
    sign = 1.0
    if text[:1] in ("+", "-"):
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    total = 0.0
    position = 0
    while position < len(text):
        part = _DURATION_PART.match(text, position)
        if part is None:
            break
        total += float(part.group(1)) * _DURATION_UNITS_S[part.group(2)]
        position = part.end()
    if not text or position != len(text):
        raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
    return sign * total


def format_duration(seconds: float) -> str:
    """The shortest way to write `seconds` that parse_duration reads back: 2s, 500ms, 1m, 1.5s."""
    if seconds == 0:
        return "0s"
    micros = round(seconds * 1_000_000)
    if abs(micros - seconds * 1_000_000) > 1e-6 * abs(seconds * 1_000_000):
        return f"{seconds:.9f}".rstrip("0") + "s"
    for unit, size_us in (("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000)):
        if micros % size_us == 0:
            return f"{micros // size_us}{unit}"
    if abs(micros) >= 1_000_000:
        return f"{micros / 1_000_000:.6f}".rstrip("0") + "s"
    if micros % 1000 == 0:
        return f"{micros // 1000}ms"
    return f"{micros}us"


def format_size(size_bytes: int) -> str:
    """The shortest binary-unit way to write a size that parse_size reads back: 512Mi, 10Gi."""
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if size_bytes and size_bytes % size == 0:
            return f"{size_bytes // size}{unit}"
    return str(size_bytes)


def parse_size(value: str | int) -> int:
    """Bytes from a size such as `10Gi`, `512Mi`, `80GiB`, `1G` (decimal) or `1024` (bytes).

    Binary units Ki Mi Gi Ti (KiB ...), decimal units K M G T (k). KB, MB, GB and TB are refused
    with a hint, since they are read both ways. A fraction is accepted when the result is a whole
    number of bytes (`1.5Gi`)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is not a size: sizes cannot be negative")
        return value
    found = _SIZE.fullmatch(value.strip())
    if found is not None and found.group(2) in _AMBIGUOUS_SIZE_UNITS:
        number, unit = found.group(1), found.group(2)
        decimal, binary = _AMBIGUOUS_SIZE_UNITS[unit]
        raise ValueError(
            f"{_show(value)} is ambiguous: {unit} means 1000 or 1024 to the power of "
            f"{' KMGT'.index(decimal)}; write {number}{binary} (binary, as nvidia-smi counts) "
            f"or {number}{decimal} (decimal)"
        )
    if found is None or found.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
    size = Fraction(found.group(1)) * _SIZE_UNITS[found.group(2)]
    if size.denominator != 1:
        raise ValueError(f"{_show(value)} is not a whole number of bytes ({_SIZE_HINT})")
    return int(size)


def _resource_name_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name the kubelet accepts, or None if it is."""
    expected = "expected <domain>/<name>, e.g. nvidia.com/vgpu"
    domain, slash, short = name.partition("/")
    if not slash:
        return f"{_show(name)} has no domain ({expected})"
    if "kubernetes.io/" in name:
        return f"{_show(name)} is in the kubernetes.io domain, which is reserved for Kubernetes"
    if name.startswith(_QUOTA_PREFIX):
        return f'{_show(name)} starts with "{_QUOTA_PREFIX}", which Kubernetes reserves for quotas'
    if not _DNS_SUBDOMAIN.fullmatch(domain) or len(_QUOTA_PREFIX + domain) > _MAX_SUBDOMAIN_LENGTH:
        return f"{_show(name)}: the domain {_show(domain)} is not a DNS subdomain ({expected})"
    if not _QUALIFIED_NAME.fullmatch(short) or len(short) > _MAX_NAME_LENGTH:
        return (
            f"{_show(name)}: the name {_show(short)} must be at most {_MAX_NAME_LENGTH} letters,"
            " digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Reader:
    """Typed access to YAML-loaded data that records a problem, with its key path, for every
    value that does not fit and returns None for it. parse_config raises once, at the end."""

    def __init__(
        self,
        *,
        null_is_absent: bool = False,
        top_level_hints: Mapping[str, str] | None = None,
        lenient_keys: bool = False,
    ) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []
        # NVIDIA's files (and its "Running with config" dumps) write unset settings as null.
        self._null_is_absent = null_is_absent
        # Extra words for an unknown top-level key, by key; such a key is always a problem.
        self._top_level_hints = top_level_hints or {}
        # NVIDIA's plugin ignores keys it does not know: a warning, not a problem.
        self._lenient_keys = lenient_keys

    def error(self, path: str, message: str) -> None:
        self.problems.append(f"{path or 'top level'}: {message}")

    def warn(self, sentence: str) -> None:
        """A finding that does not stop the config from loading; it names its key path."""
        self.warnings.append(sentence)

    def section(
        self,
        value: object,
        path: str,
        keys: Sequence[str],
        *,
        fold_case: bool = False,
        keep_null: bool = False,
    ) -> dict[str, object]:
        """The known keys of a mapping; unknown keys are problems (with lenient_keys, warnings).
        A missing or null section is empty. fold_case matches keys ignoring case, as Go's
        encoding/json matches a struct's fields (a key written both ways: the last one wins).
        keep_null keeps a null value where null_is_absent would drop it (NVIDIA's plugin reads
        null as an empty value, not as an absent one, in some places)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            refused = " (NVIDIA's plugin refuses it too)" if self._lenient_keys else ""
            self.error(
                path, f"expected a mapping with keys {', '.join(keys)}, got {_kind(value)}{refused}"
            )
            return {}
        folded = {k.lower(): k for k in keys} if fold_case else {}
        known: dict[str, object] = {}
        for key, item in value.items():
            name = key if key in keys else folded.get(str(key).lower()) if fold_case else None
            if name is None:
                self._unknown_key(path, key, keys)
                continue
            if name != key:
                self.warn(
                    f"{_join(path, str(key))}: read as {name}, as NVIDIA's plugin reads it"
                    " (it matches these keys ignoring case)."
                )
            if self._null_is_absent and item is None and not keep_null:
                known.pop(name, None)
            else:
                known[name] = item
        return known

    def _unknown_key(self, path: str, key: object, keys: Sequence[str]) -> None:
        expected = f"expected one of: {', '.join(sorted(keys))}"
        hint = "" if path else self._top_level_hints.get(str(key), "")
        if self._lenient_keys and not hint:
            self.warn(
                f"{_join(path, str(key))} is ignored: NVIDIA's plugin does not read this key,"
                f" and neither does vgpu ({expected})."
            )
            return
        self.error(path, f"unknown key {_show(key)} ({expected}){hint}")

    def integer(
        self, value: object, path: str, minimum: int, maximum: int | None = None
    ) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(path, f"{_show(value)} is not an integer")
            return None
        if value < minimum:
            self.error(path, f"{_show(value)} is too small (must be >= {minimum})")
            return None
        if maximum is not None and value > maximum:
            self.error(path, f"{_show(value)} is too large (must be <= {maximum})")
            return None
        return value

    def boolean(self, value: object, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.error(path, f"{_show(value)} is not a boolean (use true or false)")
            return None
        return value

    def string(self, value: object, path: str) -> str | None:
        if not isinstance(value, str):
            self.error(path, f"{_show(value)} is not a string")
            return None
        if not value:
            self.error(path, "is empty")
            return None
        return value

    def choice(self, value: object, path: str, options: Mapping[str, _T], shown: str) -> _T | None:
        if isinstance(value, str) and value in options:
            return options[value]
        self.error(path, f"{_show(value)} is not one of {shown}")
        return None

    def duration(
        self, value: object, path: str, minimum_s: float, maximum_s: float = MAX_DURATION_S
    ) -> float | None:
        try:
            if not isinstance(value, str | int | float):
                raise ValueError(f"{_show(value)} is not a duration ({_DURATION_HINT})")
            seconds = parse_duration(value)
        except (ValueError, OverflowError) as e:
            self.error(path, str(e))
            return None
        if not seconds <= maximum_s:  # also NaN
            self.error(
                path, f"{_show(value)} is too long (must be <= {format_duration(maximum_s)})"
            )
            return None
        if seconds < minimum_s:
            self.error(
                path, f"{_show(value)} is too short (must be >= {format_duration(minimum_s)})"
            )
            return None
        return seconds

    def size(self, value: object, path: str) -> int | None:
        try:
            if not isinstance(value, str | int):
                raise ValueError(f"{_show(value)} is not a size ({_SIZE_HINT})")
            size = parse_size(value)
        except ValueError as e:
            self.error(path, str(e))
            return None
        if size <= 0:
            self.error(path, f"{_show(value)} is too small (must be more than 0 bytes)")
            return None
        return size

    def items(self, value: object, path: str) -> list[object]:
        """A list; null is empty."""
        if value is None:
            return []
        if not isinstance(value, list):
            self.error(path, f"expected a list, got {_kind(value)}")
            return []
        return value

    def resource_name(self, value: object, path: str) -> str | None:
        name = self.string(value, path)
        if name is None:
            return None
        problem = _resource_name_problem(name)
        if problem is not None:
            self.error(path, problem)
            return None
        return name

    def device_id_strategy(self, value: object, path: str) -> DeviceIdStrategy | None:
        """deviceIDStrategy: uuid or index (anything else is what NVIDIA's plugin refuses)."""
        return self.choice(value, path, _ID_STRATEGIES, ", ".join(_ID_STRATEGIES))

    def strategies(self, value: object, path: str) -> tuple[DeviceListStrategy, ...] | None:
        """deviceListStrategy: one name or a non-empty list of distinct names."""
        shown = ", ".join(_STRATEGIES)
        if isinstance(value, str):
            one = self.choice(value, path, _STRATEGIES, shown)
            return None if one is None else (one,)
        if not isinstance(value, list):
            self.error(path, f"expected a strategy or a list of them ({shown}), got {_kind(value)}")
            return None
        if not value:
            self.error(path, f"is empty (list at least one of {shown})")
            return None
        chosen: list[DeviceListStrategy] = []
        valid = True
        for i, item in enumerate(value):
            strategy = self.choice(item, f"{path}[{i}]", _STRATEGIES, shown)
            if strategy is None:
                valid = False
            elif strategy in chosen:
                self.error(f"{path}[{i}]", f"{_show(item)} is listed twice")
                valid = False
            else:
                chosen.append(strategy)
        return tuple(chosen) if valid else None

    def xids(self, value: object, path: str) -> tuple[int, ...] | None:
        """A list of distinct Xid numbers (positive integers); null is empty."""
        if value is None:
            return ()
        if not isinstance(value, list):
            self.error(path, f"expected a list of Xid numbers, e.g. [13, 31], got {_kind(value)}")
            return None
        chosen: list[int] = []
        valid = True
        for i, item in enumerate(value):
            xid = self.integer(item, f"{path}[{i}]", 1)
            if xid is None:
                valid = False
            elif xid in chosen:
                self.error(f"{path}[{i}]", f"{xid} is listed twice")
                valid = False
            else:
                chosen.append(xid)
        return tuple(chosen) if valid else None

    def version(self, value: object, path: str) -> str | None:
        return self.const(value, path, "v1")

    def const(self, value: object, path: str, expected: str) -> str | None:
        """`expected` and nothing else (a format's version)."""
        if value != expected:
            self.error(path, f"{_show(value)} is not supported (expected {json.dumps(expected)})")
            return None
        return expected
