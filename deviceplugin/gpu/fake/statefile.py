"""Reading and writing a state file: hostile content (huge, not UTF-8, not JSON, nested too
deep) is refused with a message that says what is wrong; writes are atomic."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deviceplugin.errors import StateFileError
from deviceplugin.gpu.fake.checks import _MAX_VALUE_CHARS, MAX_STATE_BYTES
from deviceplugin.gpu.fake.parse import parse_state
from deviceplugin.gpu.fake.state import FakeState


def _short_text(text: str) -> str:
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def _decode_state(content: bytes) -> FakeState:
    """Parse the bytes of a state file; StateFileError describes what is wrong (not where)."""
    if not content.strip():
        raise StateFileError('the file is empty; expected a JSON object like {"gpus": [...]}')
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StateFileError(f"the file is not UTF-8 text: {e.reason} at byte {e.start}") from e
    if len(content) > MAX_STATE_BYTES:
        raise StateFileError(f"the file is larger than {MAX_STATE_BYTES} bytes")
    try:
        data = json.loads(text)
        return parse_state(data)
    except json.JSONDecodeError as e:
        raise StateFileError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise StateFileError("not a state file: nested too deep") from e
    except ValueError as e:  # an integer of thousands of digits
        raise StateFileError(f"not valid JSON: {_short_text(str(e))}") from e


def read_state_file(path: Path) -> FakeState:
    """Read and validate a state file. Raises StateFileError naming the file and the problem."""
    try:
        content = path.read_bytes()
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
    """Write a state file atomically (a temporary file in the same directory, then os.replace),
    so that a reader never sees half a file. A FakeState or mapping is validated first unless
    `validate` is False, which lets tests write a malformed state on purpose."""
    data = state.to_json() if isinstance(state, FakeState) else dict(state)
    if validate:
        parse_state(data)
    content = json.dumps(data, indent=2).encode() + b"\n"
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
            # mkstemp creates 0600; a state file is not secret, and readers may be other users.
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
