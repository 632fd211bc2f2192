"""`vgpu-device-plugin status`: a terminal view of a running daemon, from its /status document."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TextIO

from deviceplugin.logs import escape
from deviceplugin.usage.httpserver import parse_address
from deviceplugin.usage.statusview import render_status

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
# Home the cursor and clear the screen: a --watch frame replaces the last one on a terminal.
CLEAR_SCREEN = "\x1b[H\x1b[2J"
# Of an error answer, this much is shown.
_MAX_REASON_BYTES = 400


@dataclasses.dataclass(frozen=True, slots=True)
class StatusTls:
    """How `status` speaks HTTPS to a daemon that serves it. `ca_file`: the CA to verify the
    daemon's certificate with; `daemon_cert`: the daemon's own certificate, trusted as it is when
    no CA is given (in the daemon's pod: VGPU_METRICS_TLS_CERT); neither: the system's CAs.
    `client_cert`/`client_key`: what to present to a daemon that requires client certificates."""

    ca_file: str = ""
    daemon_cert: str = ""
    client_cert: str = ""
    client_key: str = ""


def _status_url(address: str, *, https: bool = False) -> str:
    """The /status URL of a daemon at `address` (`HOST:PORT`, or `https://HOST:PORT`; a URL's
    trailing `/` or `/status` is the same address, as pasted from a browser)."""
    if address.startswith("https://"):
        address, https = address.removeprefix("https://"), True
    elif address.startswith("http://"):
        address = address.removeprefix("http://")
    address = address.removesuffix("/").removesuffix("/status")
    host, port = parse_address(address)
    if host in ("", "0.0.0.0"):  # noqa: S104 (the daemon's "all interfaces", reached locally)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    scheme = "https" if https else "http"
    return (
        f"{scheme}://[{host}]:{port}/status" if ":" in host else f"{scheme}://{host}:{port}/status"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _tls_context(tls: StatusTls, host: str) -> ssl.SSLContext:
    """Verify the daemon against `ca_file`, else its own certificate (the exact certificate is
    the trust: no name to check), else the system's CAs. Names are checked against a CA's
    certificates except on a loopback address, which no certificate names. Raises OSError (an
    unreadable file) or ssl.SSLError (not PEM)."""
    if tls.ca_file:
        context = ssl.create_default_context(cafile=tls.ca_file)
        context.check_hostname = not _is_loopback(host)
    elif tls.daemon_cert:
        context = ssl.create_default_context(cafile=tls.daemon_cert)
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf itself is the anchor
        context.check_hostname = False
    else:
        context = ssl.create_default_context()
    if tls.client_cert:
        context.load_cert_chain(tls.client_cert, tls.client_key or None)
    return context


class _NoStatusError(Exception):
    """The daemon answered, but with no /status document (e.g. 503 before its first poll)."""


def _fetch_status(url: str, context: ssl.SSLContext | None = None) -> dict[str, object]:
    """The daemon's /status document. OSError when the daemon cannot be reached; _NoStatusError
    when it answers without a document."""

    try:
        # http or https only: the URL is built by _status_url.
        with urllib.request.urlopen(url, timeout=5, context=context) as response:  # noqa: S310
            doc = json.load(response)
    except urllib.error.HTTPError as e:
        body = e.read(_MAX_REASON_BYTES)
        try:
            reason = str(json.loads(body).get("error", e.reason))
        except (ValueError, AttributeError):
            # The daemon's reason in its own words (a 403 says why and where to ask), escaped.
            text = body.decode("utf-8", "replace").strip()
            reason = escape(text[:_MAX_REASON_BYTES]) if text else str(e.reason)
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
    address: str,
    watch_s: float | None,
    *,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    tls: StatusTls | None = None,
) -> int:
    """Print the daemon's status once, or every `watch_s` seconds until Ctrl-C. HTTPS when the
    address says `https://` or `tls` is given."""

    if tls is not None and bool(tls.client_cert) != bool(tls.client_key):
        print("vgpu-device-plugin status: --client-cert and --client-key go together", file=err)
        return EXIT_USAGE
    try:
        url = _status_url(address, https=tls is not None)
    except ValueError as e:
        print(f"vgpu-device-plugin status: {e}", file=err)
        return EXIT_USAGE
    context: ssl.SSLContext | None = None
    if url.startswith("https://"):
        host = urllib.parse.urlsplit(url).hostname or ""
        try:
            context = _tls_context(tls or StatusTls(), host)
        except (OSError, ssl.SSLError) as e:
            print(f"vgpu-device-plugin status: cannot load the TLS files: {e}", file=err)
            return EXIT_USAGE
    if watch_s is not None and watch_s <= 0:
        print("vgpu-device-plugin status: --watch needs SECONDS > 0", file=err)
        return EXIT_USAGE

    # Screen codes only for a terminal; into a pipe or a file each frame follows the last.
    terminal = out.isatty()

    def frame() -> str:
        return _frame(url, context, as_json=as_json, terminal=terminal)

    def problem(e: Exception) -> str:
        return _problem(e, url, tls=context is not None)

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


def _frame(url: str, context: ssl.SSLContext | None, *, as_json: bool, terminal: bool) -> str:
    """One frame: the document fetched now, as JSON or rendered to fit the terminal (into a
    pipe or a file, all of it)."""
    doc = _fetch_status(url, context)
    if as_json:
        return json.dumps(doc, indent=2)
    size = shutil.get_terminal_size()
    width = max(size.columns, 80)
    # On a terminal the view fits its height (less the line the cursor ends on), in the
    # compact layout where the full one does not; into a pipe or a file, all of it.
    height = max(size.lines - 1, 10) if terminal else None
    try:
        return "\n".join(render_status(doc, width=width, height=height))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        # A daemon of another version, or something else answering on that port.
        raise _NoStatusError(
            f"its /status document has a shape this command does not know "
            f"({type(e).__name__}: {str(e)[:80]}); is the daemon the same version? "
            "--json prints the document as it is"
        ) from e


def _problem(e: Exception, url: str, *, tls: bool) -> str:
    """What went wrong fetching a frame, and what to do about it."""
    if isinstance(e, _NoStatusError):
        hint = ""
        if "HTTP 403" in str(e) and "loopback" in str(e):
            hint = (
                " (run it where the daemon runs: kubectl exec into its pod, or "
                "kubectl port-forward to it)"
            )
        elif "HTTP 403" in str(e):
            hint = " (it requires a client certificate: --client-cert and --client-key)"
        return f"the vgpu daemon at {url} has no status to show: {e}{hint}"
    reason = getattr(e, "reason", None) or e  # urllib's URLError wraps the socket error
    if isinstance(reason, ssl.SSLError):
        return (
            f"cannot reach the vgpu daemon at {url} over TLS: {reason} (--ca-file names the "
            "CA that signed its certificate; inside its pod the daemon's own certificate is "
            "trusted)"
        )
    hint = "point --address at its --metrics-address"
    if not tls:
        hint += ", with https:// if it serves TLS"
    return (
        f"cannot reach the vgpu daemon at {url}: {reason} (is `vgpu-device-plugin serve` "
        f"running there? {hint})"
    )
