"""Logging set-up for the command line: text (key=value) or JSON lines, on stderr."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Sequence

# Control characters (a newline forges a log line; escapes rewrite a terminal), and the Unicode
# line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Values from outside (device IDs, error texts) are cut to this many characters in a log line.
MAX_VALUE_CHARS = 200
MAX_LIST_ITEMS = 8


def escape(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def brief(text: str, most: int = MAX_VALUE_CHARS) -> str:
    """`text` escaped and cut to about `most` characters, saying how much was cut."""
    text = escape(text)
    if len(text) <= most:
        return text
    return f"{text[:most]}...({len(text) - most} more characters)"


def brief_list(items: Sequence[str], first: int = MAX_LIST_ITEMS) -> str:
    """The first few items, escaped and joined with commas, then how many there are in all."""
    shown = ",".join(brief(item, 100) for item in items[:first])
    if len(items) <= first:
        return shown
    return f"{shown},...({len(items)} in all)"


class _EscapingFormatter(logging.Formatter):
    """Text lines: the message's control characters escaped, so that one record is one line
    whatever a value from outside holds (a traceback, added after, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = _EscapingFormatter(
            "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s %(message)s", "%Y-%m-%dT%H:%M:%S"
        )
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # grpc's own logger is chatty at INFO about channel state; keep it to warnings.
    logging.getLogger("grpc").setLevel(logging.WARNING)
