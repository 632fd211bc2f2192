"""Reading and writing a state file: hostile content (huge, not UTF-8, not JSON, nested too
deep) is refused with a message that says what is wrong; writes are atomic."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deviceplugin.errors import StateFileError
from deviceplugin.gpu.fake.checks import _MAX_VALUE_CHARS, MAX_STATE_BYTES, bounds_problem
from deviceplugin.gpu.fake.parse import parse_state
from deviceplugin.gpu.fake.state import FakeState
from deviceplugin.statefiles import write_file


def _short_text(text: str) -> str:
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def _decode_state(content: bytes) -> FakeState:
    """Parse the bytes of a state file; StateFileError describes what is wrong (not where)."""
    if len(content) > MAX_STATE_BYTES:
        raise StateFileError(f"the file is larger than {MAX_STATE_BYTES} bytes")
    if not content.strip():
        raise StateFileError('the file is empty; expected a JSON object like {"gpus": [...]}')
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StateFileError(f"the file is not UTF-8 text: {e.reason} at byte {e.start}") from e
    try:
        data = json.loads(text)
        too_big = bounds_problem(data)
        if too_big is not None:
            raise StateFileError(f"too big to read at every poll: {too_big}")
        return parse_state(data)
    except json.JSONDecodeError as e:
        raise StateFileError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise StateFileError("not a state file: nested too deep") from e
    except ValueError as e:  # an integer of thousands of digits
        raise StateFileError(f"not valid JSON: {_short_text(str(e))}") from e


def read_bounded(path: Path) -> tuple[os.stat_result, bytes]:
    """The file's status and at most MAX_STATE_BYTES + 1 of its bytes (one more than allowed, so
    that a bigger file is told apart): a regular file only, so that a FIFO or a device such as
    /dev/zero neither blocks the poll nor fills memory. OSError as `open` raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError("not a regular file; point --backend fake:PATH at a JSON file")
        if st.st_size > MAX_STATE_BYTES:
            return st, b" " * (MAX_STATE_BYTES + 1)  # refused by its size, unread
        return st, f.read(MAX_STATE_BYTES + 1)


def read_state_file(path: Path) -> FakeState:
    """Read and validate a state file. Raises StateFileError naming the file and the problem."""
    try:
        _, content = read_bounded(path)
    except StateFileError as e:
        raise StateFileError(f"state file {path}: {e}") from e
    except FileNotFoundError as e:
        raise StateFileError(f"state file {path} does not exist") from e
    except OSError as e:
        raise StateFileError(f"state file {path} cannot be read: {e.strerror or e}") from e
    try:
        return _decode_state(content)
    except StateFileError as e:
        raise StateFileError(f"state file {path}: {e}") from e


def write_state_file(
    path: Path, state: FakeState | Mapping[str, Any], *, validate: bool = True
) -> None:
    """Write a state file atomically (`statefiles`: a temporary file, then a rename),
    so that a reader never sees half a file. A FakeState or mapping is validated first unless
    `validate` is False, which lets tests write a malformed state on purpose."""
    data = state.to_json() if isinstance(state, FakeState) else dict(state)
    if validate:
        parse_state(data)
    content = json.dumps(data, indent=2).encode() + b"\n"
    path = Path(path)
    # Not secret, and readers may be other users; atomic, not durable (a test's GPUs).
    write_file(path.parent, path.name, content, mode=0o644, sync=False, create=False)
