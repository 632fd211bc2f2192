"""Serving the plugin socket and staying registered with the kubelet, as the kubelet behaves.

- Serve on <device-plugin-dir>/<endpoint> (owner-only), then call Register on kubelet.sock.
- The kubelet not there yet: retry with backoff, waking early when kubelet.sock appears.
- A kubelet restart deletes every socket in the directory and re-creates kubelet.sock; the
  kubelet never re-opens a broken ListAndWatch stream. Either way: restart the server and
  register again. A watch of the directory (inotify; a stat poll every `watch_interval_s` where
  inotify is unavailable) wakes the life cycle, which then compares both sockets' inodes: it
  notices within milliseconds, which matters: pods admitted before re-registration are rejected
  for good, and costs nothing while nothing changes.
- A Register call in flight is given up as soon as the plugin's socket is removed or replaced
  (a restarting kubelet's start-up cleanup can remove it just as the call reaches the new
  kubelet, which then dials the missing socket for 10 s): serve again, register again. Each call
  also has a short timeout (1 s, doubling to 5 s after calls that timed out).
- A stream that ends while the kubelet's socket still takes connections counts as a failure
  (backoff, unhealthy until a stream is held 10 s), unless the next registration is accepted by
  a new kubelet (another kubelet.sock): a kubelet killed outright can end its streams a moment
  before its socket stops answering. The kubelet that accepted is told by the kubelet.sock found
  after the call: one found before it may be the file the killed kubelet left behind.
- On stop: close the server and remove the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from deviceplugin.kubelet.dirwatch import DEFAULT_FALLBACK_INTERVAL_S, DirectoryWatch
from deviceplugin.kubelet.proto import DEVICE_PLUGIN_VERSION, KUBELET_SOCKET, dp, dp_grpc
from deviceplugin.kubelet.sockets import remove_socket, serve_unix
from deviceplugin.localgrpc import local_channel
from deviceplugin.plugin.server import DevicePluginService

log = logging.getLogger(__name__)

# A Register call waits this long at first, doubling after each call that timed out, up to
# REGISTER_TIMEOUT_S: a kubelet answers in milliseconds when it can dial the plugin back, and one
# that cannot (it dials a socket its start-up cleanup removed, for 10 s) must not hold us.
REGISTER_TIMEOUT_FIRST_S = 1.0
REGISTER_TIMEOUT_S = 5.0
BACKOFF_FIRST_S = 0.01
BACKOFF_MAX_S = 5.0
WAITING_REPORT_EVERY_S = 30.0
# The kubelet opens ListAndWatch right after it accepts a registration; if it has not within
# this long, its dial-back failed quietly and it holds no devices of ours: register again.
STREAM_OPEN_TIMEOUT_S = 10.0
# A registration whose stream ends (or never opens) sooner than this after it was made is a
# failure: the next one waits, twice as long each time (from the first delay, at most
# BACKOFF_MAX_S), so that nothing that breaks ListAndWatch makes a registration storm; and until a
# stream has been held this long again, the plugin counts as not registered (for /healthz).
STABLE_STREAM_S = 10.0
RESTREAM_BACKOFF_FIRST_S = 0.1
_STREAM_FAILURES = ("ListAndWatch stream ended", "the kubelet opened no ListAndWatch stream")

_REGISTERED = "registered"
_STOPPED = "stopped"
_SOCKET_GONE = "socket gone"


def endpoint_name(resource_name: str) -> str:
    """The plugin socket's basename, e.g. vgpu-nvidia.com-vgpu.sock."""
    return "vgpu-" + resource_name.replace("/", "-") + ".sock"


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """A socket file's inode and change time: a file created anew has another even where the
    file system hands out the inode number just freed."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket `path` (a kubelet that has
    exited leaves its socket file behind, refusing connections)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:
            return True  # its backlog is full: it is there
        except OSError:
            return False
    return True


@dataclass
class LifecycleStats:
    registrations: int = 0
    registration_failures: int = 0
    last_registered_at_s: float = 0.0
    last_restart_reason: str = ""


class PluginLifecycle:
    """Owns the gRPC server's life and the registration loop. `run` returns when `stop` is set."""

    def __init__(
        self,
        service: DevicePluginService,
        *,
        plugin_dir: Path,
        resource_name: str,
        watch_interval_s: float = DEFAULT_FALLBACK_INTERVAL_S,
        use_inotify: bool = True,
        stream_open_timeout_s: float = STREAM_OPEN_TIMEOUT_S,
        on_registered: Callable[[], None] = lambda: None,
    ) -> None:
        self._service = service
        self._dir = plugin_dir
        self._resource = resource_name
        self._endpoint = endpoint_name(resource_name)
        self._socket = plugin_dir / self._endpoint
        self._kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._dir_watch = DirectoryWatch(
            plugin_dir, fallback_interval_s=watch_interval_s, use_inotify=use_inotify
        )
        self.stream_open_timeout_s = stream_open_timeout_s
        self._on_registered = on_registered
        self._generation = 0
        self._kubelet_inode: tuple[int, int] | None = None
        # The kubelet socket's identity at the last accepted registration.
        self._kubelet_identity: tuple[int, int, int] | None = None
        self._own_inode: tuple[int, int] | None = None
        self._stream_ended = asyncio.Event()
        self.stats = LifecycleStats()
        self._registered = False
        # Monotonic time since which the plugin has not been registered; 0 while registered.
        self.unregistered_since_s = time.monotonic()
        # Monotonic time since which registrations have not held a stream; 0 while one does.
        self.unstable_since_s = 0.0
        self._stream_failures = 0
        self._registered_at = 0.0

    @property
    def registered(self) -> bool:
        return self._registered

    @registered.setter
    def registered(self, value: bool) -> None:
        if value != self._registered:
            self.unregistered_since_s = 0.0 if value else time.monotonic()
        self._registered = value

    @property
    def socket_path(self) -> Path:
        return self._socket

    def generation(self) -> int:
        """The registration a newly opened ListAndWatch stream belongs to."""
        return self._generation

    def stream_ended(self, generation: int) -> None:
        """Called by the service when a stream ends; only the current registration's counts."""
        if generation == self._generation:
            self._stream_ended.set()

    @property
    def watch_mode(self) -> str:
        """How the directory is watched: inotify, or poll where inotify is unavailable."""
        return self._dir_watch.mode

    async def run(self, stop: asyncio.Event) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        self._dir_watch.start()
        try:
            while not stop.is_set():
                server = await self._serve()
                try:
                    outcome = await self._register(stop)
                    if outcome == _STOPPED:
                        return
                    if outcome == _SOCKET_GONE:
                        # A starting kubelet cleans the directory before it creates kubelet.sock.
                        log.info("plugin socket removed before registration; serving again")
                        continue
                    reason = await self._watch(stop)
                    if reason:
                        self.stats.last_restart_reason = reason
                        # A kubelet restart asks for it: expected, not a warning.
                        expected = "kubelet restart" in reason
                        log.log(
                            logging.INFO if expected else logging.WARNING,
                            "re-registering with the kubelet reason=%r",
                            reason,
                        )
                finally:
                    self.registered = False
                    await self._close(server)
                if (
                    reason.startswith(_STREAM_FAILURES)
                    and "kubelet restart" not in reason
                    and time.monotonic() - self._registered_at < STABLE_STREAM_S
                ):
                    await self._back_off(stop)
        finally:
            self._service.stopping = True
            self._remove_socket()
            await self._dir_watch.close()

    async def _back_off(self, stop: asyncio.Event) -> None:
        """After a registration that held no stream: count it, and wait before the next one
        (waking early on stop or a new kubelet.sock)."""
        self._stream_failures += 1
        if not self.unstable_since_s:
            self.unstable_since_s = time.monotonic()
        delay = min(RESTREAM_BACKOFF_FIRST_S * 2 ** (self._stream_failures - 1), BACKOFF_MAX_S)
        log.info(
            "waiting before registering again delay_s=%.2f consecutive_failures=%d",
            delay,
            self._stream_failures,
        )
        await self._sleep_or_change(stop, delay, self._kubelet_inode, _inode(self._socket))

    async def _serve(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self._service, server)
        self._service.stopping = False
        if await serve_unix(server, self._socket):
            log.info("serving device plugin socket=%s", self._socket)
        else:
            # A restarting kubelet cleaned the directory between the bind and here; registration
            # notices that the socket is gone and serves again.
            log.info("plugin socket removed right after it was created socket=%s", self._socket)
        return server

    async def _close(self, server: grpc.aio.Server) -> None:
        # No grace: a ListAndWatch stream never finishes by itself, and every millisecond spent
        # here is a millisecond the kubelet goes without a registered plugin.
        self._service.stopping = True
        await server.stop(grace=None)

    def _remove_socket(self) -> None:
        try:
            remove_socket(self._socket)
        except OSError as e:
            log.error("plugin socket not removed socket=%s error=%s", self._socket, e)

    async def _register(self, stop: asyncio.Event) -> str:
        """Register, retrying with backoff until accepted. Returns _REGISTERED, _STOPPED, or
        _SOCKET_GONE when our socket disappeared and must be served again first."""
        own = _inode(self._socket)
        if own is None:
            return _SOCKET_GONE
        delay = BACKOFF_FIRST_S
        started = time.monotonic()
        last_report = started
        failures = 0
        timeout_s = REGISTER_TIMEOUT_FIRST_S
        while not stop.is_set():
            if _inode(self._socket) != own:
                return _SOCKET_GONE
            self._generation += 1
            self._stream_ended.clear()
            kubelet_inode = _inode(self._kubelet_socket)
            if kubelet_inode is None:
                error: str | None = "kubelet.sock does not exist"
            else:
                error = await self._register_watching(own, timeout_s)
                if error == _SOCKET_GONE:
                    log.info(
                        "plugin socket removed while registering (kubelet start-up cleanup); "
                        "serving again waited_ms=%.1f",
                        (time.monotonic() - started) * 1000,
                    )
                    return _SOCKET_GONE
                if error is not None and error.startswith("DEADLINE_EXCEEDED"):
                    timeout_s = min(timeout_s * 2, REGISTER_TIMEOUT_S)
            if error is None:
                # The kubelet that accepted is the one whose socket is there now. Not the one
                # seen before the call: a restarting kubelet replaces the socket file a killed
                # one left behind at any moment (often under the same inode number), so that
                # look can have seen the old kubelet's file while the call reached the new one.
                kubelet_identity = _identity(self._kubelet_socket)
                kubelet_inode = None if kubelet_identity is None else kubelet_identity[:2]
                if (
                    self._stream_failures or self.unstable_since_s
                ) and kubelet_identity != self._kubelet_identity:
                    # The stream that ended was the old kubelet's: one killed outright can end
                    # it while its socket still takes connections for a moment. A restart, not
                    # a failing stream.
                    log.info("registered with a new kubelet; the stream that ended was the old's")
                    self._stream_failures = 0
                    self.unstable_since_s = 0.0
                self._kubelet_inode = kubelet_inode
                self._kubelet_identity = kubelet_identity
                self._own_inode = own
                self.registered = True
                self.stats.registrations += 1
                self.stats.last_registered_at_s = time.monotonic()
                log.info(
                    "registered with the kubelet resource=%s endpoint=%s waited_ms=%.1f",
                    self._resource,
                    self._endpoint,
                    (time.monotonic() - started) * 1000,
                )
                self._on_registered()
                return _REGISTERED
            failures += 1
            self.stats.registration_failures += 1
            now = time.monotonic()
            if failures == 1 or now - last_report >= WAITING_REPORT_EVERY_S:
                last_report = now
                log.warning(
                    "kubelet not accepting registration yet; retrying with backoff "
                    "kubelet_socket=%s error=%r waited_s=%.1f",
                    self._kubelet_socket,
                    error,
                    now - started,
                )
            else:
                log.debug("registration attempt failed error=%r", error)
            await self._sleep_or_change(stop, delay, kubelet_inode, own)
            delay = min(delay * 2, BACKOFF_MAX_S)
        return _STOPPED

    async def _register_watching(self, own: tuple[int, int], timeout_s: float) -> str | None:
        """One Register call, given up (returning _SOCKET_GONE) as soon as the plugin's socket is
        no longer `own`; otherwise the call's error, or None when accepted."""
        call = asyncio.ensure_future(self._register_once(timeout_s))
        changed = self._dir_watch.changed
        try:
            while not call.done():
                changed.clear()
                if _inode(self._socket) != own:
                    return _SOCKET_GONE
                change_wait = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait({call, change_wait}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change_wait.cancel()
            return call.result()
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call

    async def _register_once(self, timeout_s: float = REGISTER_TIMEOUT_S) -> str | None:
        request = dp.RegisterRequest(
            version=DEVICE_PLUGIN_VERSION,
            endpoint=self._endpoint,
            resource_name=self._resource,
            options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        try:
            async with local_channel(self._kubelet_socket) as channel:
                await dp_grpc.RegistrationStub(channel).Register(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        return None

    async def _sleep_or_change(
        self,
        stop: asyncio.Event,
        delay_s: float,
        kubelet_inode: tuple[int, int] | None,
        own_inode: tuple[int, int] | None,
    ) -> None:
        """Sleep for the backoff, waking early when either socket changes."""
        deadline = time.monotonic() + delay_s
        changed = self._dir_watch.changed
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set() and (left_s := deadline - time.monotonic()) > 0:
                changed.clear()
                if (
                    _inode(self._kubelet_socket) != kubelet_inode
                    or _inode(self._socket) != own_inode
                ):
                    return
                change_wait = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait(
                        {stop_wait, change_wait},
                        timeout=left_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    change_wait.cancel()
        finally:
            stop_wait.cancel()

    async def _watch(self, stop: asyncio.Event) -> str:
        """Wait until something calls for a new registration; '' when stopping."""
        own = self._own_inode  # the socket the kubelet was told to dial, not whatever is there now
        registered_at = self._registered_at = time.monotonic()
        changed = self._dir_watch.changed
        stop_wait = asyncio.ensure_future(stop.wait())
        stream_wait = asyncio.ensure_future(self._stream_ended.wait())
        try:
            while True:
                changed.clear()
                if stop.is_set():
                    return ""
                if (
                    self._stream_failures
                    and self._service.opened_generation == self._generation
                    and time.monotonic() - registered_at > STABLE_STREAM_S
                ):
                    log.info("holding a ListAndWatch stream again")
                    self._stream_failures = 0
                    self.unstable_since_s = 0.0
                if _inode(self._socket) != own:
                    return "plugin socket removed (kubelet restart)"
                if _inode(self._kubelet_socket) != self._kubelet_inode:
                    return "kubelet.sock re-created (kubelet restart)"
                if self._stream_ended.is_set():
                    if not _listening(self._kubelet_socket):
                        return "ListAndWatch stream ended, kubelet gone (kubelet restart)"
                    return "ListAndWatch stream ended"
                # A timer only while the kubelet still owes us its stream, or while a stream
                # after failures has yet to be held long enough to count as stable again.
                timeout_s: float | None = None
                if self._service.opened_generation != self._generation:
                    timeout_s = registered_at + self.stream_open_timeout_s - time.monotonic()
                    if timeout_s < 0:
                        return "the kubelet opened no ListAndWatch stream after registration"
                elif self._stream_failures:
                    timeout_s = max(registered_at + STABLE_STREAM_S - time.monotonic(), 0.0)
                    timeout_s += 0.001  # past the deadline, so the check above holds
                change_wait = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait(
                        {stop_wait, stream_wait, change_wait},
                        timeout=timeout_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    change_wait.cancel()
        finally:
            stop_wait.cancel()
            stream_wait.cancel()
