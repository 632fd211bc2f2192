"""gRPC servers on unix sockets, for every socket the daemon serves to the kubelet (a device
plugin's, the DRA driver's service and registration sockets) and for the kubelet simulator's.

One set of checks for all of them:
- the directory is made (0750) when missing;
- what is at the socket's path is replaced only when it is a socket (one a daemon killed
  outright left behind); anything else there (a regular file, a directory, a symbolic link) is
  refused, never removed, with an error naming it;
- the socket is made owner-only as soon as it is bound, before the server starts answering;
- on the way out only a socket is removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import grpc


class NotASocketError(OSError):
    """Something other than a socket is at a socket's path: it is not removed."""


def remove_socket(path: Path) -> bool:
    """Remove the socket at `path`; whether one was there. NotASocketError when something else
    is (a symbolic link included: never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise NotASocketError(
            f"{path} exists and is not a socket ({stat.filemode(st.st_mode)}); remove it, or "
            "point the daemon at another directory"
        )
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True


async def serve_unix(server: grpc.aio.Server, path: Path) -> bool:
    """Serve `server` on the unix socket `path` (see the module's docstring). Returns False when
    the socket was removed right after it was made (a kubelet cleaning its directory as it
    starts): the server runs, and the caller notices the missing socket and serves again.
    Raises NotASocketError (what is at `path`) or another OSError."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    remove_socket(path)
    server.add_insecure_port(f"unix://{path}")
    try:
        os.chmod(path, 0o600)
    except FileNotFoundError:
        await server.start()
        return False
    await server.start()
    return True
