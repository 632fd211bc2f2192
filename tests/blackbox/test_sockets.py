"""The one unix-socket server the daemon (both frontends) and the kubelet simulator serve on."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import grpc
import pytest

from deviceplugin.kubelet.sockets import NotASocketError, remove_socket, serve_unix


def _stale_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # left behind, as by a daemon killed outright


async def test_a_stale_socket_is_replaced_and_the_new_one_is_owner_only(short_tmp: Path) -> None:
    path = short_tmp / "new" / "plugin.sock"
    path.parent.mkdir()
    _stale_socket(path)
    server = grpc.aio.server()
    try:
        assert await serve_unix(server, path)
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))  # the stale one refuses connections; this one answers
        assert stat.S_IMODE(st.st_mode) == 0o600
    finally:
        await server.stop(None)
    assert remove_socket(path) in (True, False)  # gRPC may have removed it already
    assert not path.exists()


async def test_a_missing_directory_is_made_group_readable_at_most(short_tmp: Path) -> None:
    path = short_tmp / "made" / "plugin.sock"
    server = grpc.aio.server()
    try:
        assert await serve_unix(server, path)
    finally:
        await server.stop(None)
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o027 == 0


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
async def test_anything_but_a_socket_at_the_path_is_refused_and_left_alone(
    short_tmp: Path, kind: str
) -> None:
    path = short_tmp / "plugin.sock"
    target = short_tmp / "target"
    target.write_text("keep")
    if kind == "file":
        path.write_text("keep")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(target)
    server = grpc.aio.server()
    try:
        with pytest.raises(NotASocketError, match="is not a socket"):
            await serve_unix(server, path)
        with pytest.raises(NotASocketError):
            remove_socket(path)
    finally:
        await server.stop(None)
    assert path.is_symlink() if kind == "symlink" else path.exists()
    assert target.read_text() == "keep"
