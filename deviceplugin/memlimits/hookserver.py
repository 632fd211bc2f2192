"""The daemon's end of the runtime hook (docs/design.md §15): a unix socket that only root
reaches, one request per connection.

The protocol is one line each way, ASCII:

    request   VGPU-HOOK 1 apply <pid> <grant ID>\\n      (at most 512 bytes)
    answer    OK <what was set>\\n  |  ERR <reason>\\n     (at most 4096 bytes)

The socket is made in a directory the daemon creates owner-only (0700) and is itself 0600; a
connection whose peer (SO_PEERCRED) is not root (uid 0; `allowed_uids` in tests) is answered
`ERR` and closed. A request must arrive within `read_timeout_s` and is answered within
`request_timeout_s`, or `ERR` says what took too long. A grant ID is 1 to 256 of
`A-Za-z0-9._:=-`. Each request is handed to the LimitApplier; its refusals and failures are the
`ERR` reason, which the hook prints and the runtime shows as the container's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import Collection
from pathlib import Path

from deviceplugin.errors import StartupError
from deviceplugin.memlimits.apply import ApplyError, LimitApplier
from deviceplugin.safefs import open_directory
from deviceplugin.statedir import writable_by_others

log = logging.getLogger(__name__)

PROTOCOL = ("VGPU-HOOK", "1")
MAX_REQUEST_BYTES = 512
MAX_REASON_CHARS = 1000
GRANT_ID = re.compile(r"[A-Za-z0-9._:=-]{1,256}")
DEFAULT_READ_TIMEOUT_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 8.0
_MAX_PID = 1 << 22
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


class RequestError(ValueError):
    """A request that is not one of the protocol's."""


def parse_request(line: bytes) -> tuple[int, str]:
    """(pid, grant ID) of a request line; RequestError naming what is wrong."""
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise RequestError("the request is not ASCII") from None
    words = text.rstrip("\n").split(" ")
    if len(words) != 5 or tuple(words[:2]) != PROTOCOL or words[2] != "apply":
        raise RequestError(f"expected '{' '.join(PROTOCOL)} apply <pid> <grant ID>'")
    pid, grant = words[3], words[4]
    if not pid.isdigit() or not 0 < int(pid) < _MAX_PID or pid.startswith("0"):
        raise RequestError(f"{_printable(pid)!r} is not a process ID")
    if not GRANT_ID.fullmatch(grant):
        raise RequestError(f"{_printable(grant)!r} is not a grant ID")
    return int(pid), grant


def _printable(text: str) -> str:
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def answer(ok: bool, text: str) -> bytes:
    return f"{'OK' if ok else 'ERR'} {_printable(text)}\n".encode("ascii")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", raw)
    return int(uid)


class HookServer:
    """Serves the hook's socket at `path` until `close`."""

    def __init__(
        self,
        path: Path,
        applier: LimitApplier,
        *,
        allowed_uids: Collection[int] = (0,),
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        self.path = Path(path)
        self.applier = applier
        self.allowed_uids = frozenset(allowed_uids)
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Create the owner-only directory if needed, replace a stale socket, and listen."""
        directory = open_directory(str(self.path.parent), create=True, mode=0o700)
        try:
            why = writable_by_others(os.fstat(directory.fd))
            if why is not None:
                raise StartupError(
                    f"the hook socket's directory {self.path.parent} can be written by others "
                    f"({why}): make it owner-only or choose another"
                )
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self.path.name, dir_fd=directory.fd, follow_symlinks=False)
                if not stat.S_ISSOCK(st.st_mode):
                    raise FileExistsError(f"{self.path} exists and is not a socket")
                os.unlink(self.path.name, dir_fd=directory.fd)
        finally:
            os.close(directory.fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            self._server = await asyncio.start_unix_server(
                self._serve, sock=sock, limit=MAX_REQUEST_BYTES
            )
        except BaseException:
            sock.close()
            raise
        log.info("memory-limit hook socket serving path=%s", self.path)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await self._answer(reader, writer)
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), timeout=self.read_timeout_s)
        except (OSError, TimeoutError) as e:
            log.warning("memory-limit hook connection lost error=%r", e)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else -1
        # The request is read whoever sent it (at most 512 bytes), so that a refusal reaches a
        # peer still sending rather than breaking its pipe.
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=self.read_timeout_s)
        except TimeoutError:
            return self._refused(f"no request within {self.read_timeout_s:g}s")
        except ValueError:
            return self._refused(f"a request longer than {MAX_REQUEST_BYTES} bytes")
        if uid not in self.allowed_uids:
            return self._refused(f"the hook socket answers root only, not uid {uid}")
        try:
            pid, grant = parse_request(line)
        except RequestError as e:
            return self._refused(str(e))
        try:
            outcome = await asyncio.wait_for(
                self.applier.apply(pid, grant), timeout=self.request_timeout_s
            )
        except ApplyError as e:
            if e.action == "refused":
                self.applier.book.action("refused", "memory limit refused", pid=pid, reason=e)
            return answer(False, e.reason)
        except TimeoutError:
            reason = f"applying the limits took longer than {self.request_timeout_s:g}s"
            self.applier.book.action("failed", "memory limit failed", pid=pid, reason=reason)
            return answer(False, reason)
        return answer(True, outcome.summary())

    def _refused(self, reason: str) -> bytes:
        self.applier.book.action("refused", "memory-limit hook request refused", reason=reason)
        return answer(False, reason)
