"""`vgpu-device-plugin status`: a terminal view of a running daemon, from its /status document."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from typing import TextIO

from deviceplugin.usage.httpserver import parse_address
from deviceplugin.usage.statusview import render_status

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
# Home the cursor and clear the screen: a --watch frame replaces the last one on a terminal.
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _status_url(address: str) -> str:
    host, port = parse_address(address)
    if host in ("", "0.0.0.0"):  # noqa: S104 (the daemon's "all interfaces", reached locally)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}/status" if ":" in host else f"http://{host}:{port}/status"


class _NoStatusError(Exception):
    """The daemon answered, but with no /status document (e.g. 503 before its first poll)."""


def _fetch_status(url: str) -> dict[str, object]:
    """The daemon's /status document. OSError when the daemon cannot be reached; _NoStatusError
    when it answers without a document."""

    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (http only)
            doc = json.load(response)
    except urllib.error.HTTPError as e:
        try:
            reason = str(json.load(e).get("error", e.reason))
        except (ValueError, AttributeError):
            reason = str(e.reason)
        raise _NoStatusError(f"HTTP {e.code}: {reason}") from e
    except ValueError as e:
        raise _NoStatusError(f"not JSON: {e}") from e
    except RecursionError as e:
        raise _NoStatusError("not a /status document: nested too deep") from e
    if not isinstance(doc, dict):
        raise _NoStatusError("not a /status document")
    return doc


def _silence(out: TextIO) -> None:
    """After the reader went away (`status --watch | head`): point `out` at /dev/null, so that
    the interpreter's last flush at exit does not fail again on the closed pipe."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)


def run_status(
    address: str, watch_s: float | None, *, as_json: bool, out: TextIO, err: TextIO
) -> int:
    """Print the daemon's status once, or every `watch_s` seconds until Ctrl-C."""

    try:
        url = _status_url(address)
    except ValueError as e:
        print(f"vgpu-device-plugin status: {e}", file=err)
        return EXIT_USAGE
    if watch_s is not None and watch_s <= 0:
        print("vgpu-device-plugin status: --watch needs SECONDS > 0", file=err)
        return EXIT_USAGE

    def frame() -> str:
        doc = _fetch_status(url)
        if as_json:
            return json.dumps(doc, indent=2)
        width = max(shutil.get_terminal_size().columns, 80)
        try:
            return "\n".join(render_status(doc, width=width))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
            # A daemon of another version, or something else answering on that port.
            raise _NoStatusError(
                f"its /status document has a shape this command does not know "
                f"({type(e).__name__}: {str(e)[:80]}); is the daemon the same version? "
                "--json prints the document as it is"
            ) from e

    def problem(e: Exception) -> str:
        if isinstance(e, _NoStatusError):
            return f"the vgpu daemon at {url} has no status to show: {e}"
        reason = getattr(e, "reason", None) or e  # urllib's URLError wraps the socket error
        return (
            f"cannot reach the vgpu daemon at {url}: {reason} (is `vgpu-device-plugin serve` "
            "running there? point --address at its --metrics-address)"
        )

    # Screen codes only for a terminal; into a pipe or a file each frame follows the last.
    terminal = out.isatty()
    try:
        try:
            text = frame()
        except (OSError, _NoStatusError) as e:
            print(problem(e), file=err)
            return EXIT_RUNTIME
        if watch_s is None:
            print(text, file=out)
            out.flush()
            return EXIT_OK
        first = True
        while True:
            if terminal:
                out.write(CLEAR_SCREEN + text + "\n")
            else:
                out.write(("" if first else "\n") + text + "\n")
            first = False
            out.flush()
            time.sleep(watch_s)
            try:
                text = frame()
            except (OSError, _NoStatusError) as e:  # keep watching: the daemon may be restarting
                text = f"{problem(e)}; retrying every {watch_s:g}s"
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # the reader is gone (`| head`): nothing more to show
        _silence(out)
        return EXIT_OK
