"""The NRI plugin protocol, sans I/O: what an NRI plugin and the container runtime exchange over
the runtime's NRI socket (`/var/run/nri/nri.sock`), built here without a Go stub. Not wired into
the daemon; docs/enforcement.md says why (on containerd, NRI's StopContainer arrives after the
container's processes are gone, so it cannot drain an MPS client before the kubelet's kill) and
what it would serve.

Three layers, each read from the public sources of containerd/nri and containerd/ttrpc:

- the multiplexer (nri `pkg/net/multiplex`): one unix socket carries several connections, each
  frame an 8-byte header (connection ID and payload length, big-endian uint32) and the payload.
  Connection 1 carries the plugin's service (the runtime calls the plugin), connection 2 the
  runtime's (the plugin calls the runtime);
- ttrpc: each frame a 10-byte header (data length and stream ID, big-endian uint32; message type
  1 request, 2 response, 3 data; flags) and at most 4 MiB of data. A request's data is
  `ttrpc.Request` {1 service, 2 method, 3 payload, 4 timeout_nano, 5 metadata}, a response's
  `ttrpc.Response` {1 status {1 code, 2 message}, 2 payload}. A caller's stream IDs are odd;
- NRI's messages (protobuf): `RegisterPluginRequest` {1 plugin_name, 2 plugin_idx} to
  `<package>.Runtime/RegisterPlugin`; `ConfigureRequest` {2 runtime_name, 3 runtime_version,
  4 registration_timeout, 5 request_timeout (ms)} answered by `ConfigureResponse` {2 events: bit
  `event - 1` per subscribed event}; `StopContainerRequest` and `RemoveContainerRequest` {1 pod
  {1 id, 2 name, 3 uid, 4 namespace}, 2 container {1 id, 2 pod_sandbox_id, 3 name, 12 pid}}.

The protobuf wire format is written and read here (varints and length-delimited fields; other
fields are skipped), enough for these messages.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PLUGIN_CONN = 1
RUNTIME_CONN = 2
DEFAULT_PACKAGE = "nri.pkg.api.v1alpha1"
TTRPC_REQUEST = 1
TTRPC_RESPONSE = 2
TTRPC_MAX_DATA = 4 << 20
# NRI's Event enum, for ConfigureResponse.events.
EVENT_STOP_CONTAINER = 10
EVENT_REMOVE_CONTAINER = 11
# gRPC status codes a ttrpc response carries.
CODE_UNIMPLEMENTED = 12
CODE_INTERNAL = 13
_MUX_HEADER = struct.Struct(">II")
_TTRPC_HEADER = struct.Struct(">IIBB")


class NriProtocolError(Exception):
    """The peer sent something this protocol cannot take."""


# --- protobuf wire format ------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_bytes(number: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def field_int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise NriProtocolError("a protobuf varint runs past its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if not byte & 0x80:
            return value, at


def fields(data: bytes) -> dict[int, list[int | bytes]]:
    """Every varint and length-delimited field of a message, by number, in order."""
    found: dict[int, list[int | bytes]] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _read_varint(data, at)
        elif wire == 2:
            length, at = _read_varint(data, at)
            if at + length > len(data):
                raise NriProtocolError("a protobuf field runs past its message")
            value, at = data[at : at + length], at + length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            continue
        else:
            raise NriProtocolError(f"protobuf wire type {wire} is not supported")
        found.setdefault(number, []).append(value)
    return found


def _text(found: dict[int, list[int | bytes]], number: int) -> str:
    value = found.get(number, [b""])[-1]
    return value.decode(errors="replace") if isinstance(value, bytes) else ""


def _int(found: dict[int, list[int | bytes]], number: int) -> int:
    value = found.get(number, [0])[-1]
    return value if isinstance(value, int) else 0


def _message(found: dict[int, list[int | bytes]], number: int) -> dict[int, list[int | bytes]]:
    value = found.get(number, [b""])[-1]
    return fields(value) if isinstance(value, bytes) else {}


# --- frames ----------------------------------------------------------------------------------


def mux_frame(conn: int, payload: bytes) -> bytes:
    return _MUX_HEADER.pack(conn, len(payload)) + payload


def ttrpc_frame(stream: int, kind: int, data: bytes, flags: int = 0) -> bytes:
    if len(data) > TTRPC_MAX_DATA:
        raise NriProtocolError(f"a ttrpc message of {len(data)} bytes is over 4 MiB")
    return _TTRPC_HEADER.pack(len(data), stream, kind, flags) + data


@dataclass(frozen=True, slots=True)
class TtrpcMessage:
    stream: int
    kind: int
    flags: int
    data: bytes


class _Buffer:
    """Bytes received, taken off as whole frames."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> None:
        self._data += data

    def take(
        self, header: struct.Struct, length_at: int, limit: int
    ) -> tuple[tuple[int, ...], bytes] | None:
        if len(self._data) < header.size:
            return None
        head = header.unpack_from(self._data)
        length = head[length_at]
        if length > limit:
            raise NriProtocolError(f"a frame of {length} bytes is over the {limit} allowed")
        end = header.size + length
        if len(self._data) < end:
            return None
        payload = bytes(self._data[header.size : end])
        del self._data[:end]
        return head, payload


class MuxReader:
    """Connection frames from the socket's byte stream, as they complete."""

    def __init__(self) -> None:
        self._buffer = _Buffer()

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        self._buffer.feed(data)
        while (frame := self._buffer.take(_MUX_HEADER, 1, TTRPC_MAX_DATA + 10)) is not None:
            (conn, _), payload = frame
            yield conn, payload


class TtrpcReader:
    """ttrpc messages from one connection's byte stream, as they complete."""

    def __init__(self) -> None:
        self._buffer = _Buffer()

    def feed(self, data: bytes) -> Iterator[TtrpcMessage]:
        self._buffer.feed(data)
        while (frame := self._buffer.take(_TTRPC_HEADER, 0, TTRPC_MAX_DATA)) is not None:
            (_, stream, kind, flags), payload = frame
            yield TtrpcMessage(stream, kind, flags, payload)


# --- ttrpc requests and responses ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TtrpcRequest:
    service: str
    method: str
    payload: bytes
    timeout_ns: int = 0


def encode_request(request: TtrpcRequest) -> bytes:
    data = field_bytes(1, request.service) + field_bytes(2, request.method)
    data += field_bytes(3, request.payload)
    return data + (field_int(4, request.timeout_ns) if request.timeout_ns else b"")


def decode_request(data: bytes) -> TtrpcRequest:
    found = fields(data)
    payload = found.get(3, [b""])[-1]
    return TtrpcRequest(
        _text(found, 1), _text(found, 2), payload if isinstance(payload, bytes) else b"",
        _int(found, 4),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TtrpcResponse:
    payload: bytes = b""
    code: int = 0
    message: str = ""


def encode_response(response: TtrpcResponse) -> bytes:
    status = b""
    if response.code:
        status = field_int(1, response.code) + field_bytes(2, response.message)
    return (field_bytes(1, status) if status else b"") + field_bytes(2, response.payload)


def decode_response(data: bytes) -> TtrpcResponse:
    found = fields(data)
    status = _message(found, 1)
    payload = found.get(2, [b""])[-1]
    return TtrpcResponse(
        payload if isinstance(payload, bytes) else b"", _int(status, 1), _text(status, 2)
    )


# --- NRI -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    """A container NRI tells the plugin about (StopContainer, RemoveContainer)."""

    pod_namespace: str
    pod_name: str
    pod_uid: str
    container_id: str
    container_name: str
    pid: int


def decode_container_event(data: bytes) -> ContainerEvent:
    found = fields(data)
    pod, container = _message(found, 1), _message(found, 2)
    return ContainerEvent(
        _text(pod, 4), _text(pod, 2), _text(pod, 3), _text(container, 1), _text(container, 3),
        _int(container, 12),
    )  # fmt: skip


def event_mask(events: list[int]) -> int:
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


Handler = Callable[[str, ContainerEvent], None]


class PluginSession:
    """One plugin's session with the runtime, sans I/O: `start()` gives the bytes that register
    it; `receive(bytes)` gives the bytes to send back (the plugin's answers) and calls `handler`
    with each StopContainer or RemoveContainer. The runtime's RegisterPlugin answer sets
    `registered` (or `error`)."""

    def __init__(self, name: str, index: str, handler: Handler, package: str = DEFAULT_PACKAGE):
        self.name = name
        self.index = index
        self.package = package
        self.handler = handler
        self.registered = False
        self.error = ""
        self.runtime = ""
        self._mux = MuxReader()
        self._readers = {PLUGIN_CONN: TtrpcReader(), RUNTIME_CONN: TtrpcReader()}

    def start(self) -> bytes:
        payload = field_bytes(1, self.name) + field_bytes(2, self.index)
        request = TtrpcRequest(f"{self.package}.Runtime", "RegisterPlugin", payload)
        frame = ttrpc_frame(1, TTRPC_REQUEST, encode_request(request))
        return mux_frame(RUNTIME_CONN, frame)

    def receive(self, data: bytes) -> bytes:
        out = bytearray()
        for conn, payload in self._mux.feed(data):
            reader = self._readers.get(conn)
            if reader is None:
                continue  # a connection this plugin does not use
            for message in reader.feed(payload):
                if conn == RUNTIME_CONN and message.kind == TTRPC_RESPONSE:
                    answer = decode_response(message.data)
                    self.registered = answer.code == 0
                    self.error = answer.message
                elif conn == PLUGIN_CONN and message.kind == TTRPC_REQUEST:
                    response = self._serve(decode_request(message.data))
                    frame = ttrpc_frame(message.stream, TTRPC_RESPONSE, encode_response(response))
                    out += mux_frame(PLUGIN_CONN, frame)
        return bytes(out)

    def _serve(self, request: TtrpcRequest) -> TtrpcResponse:
        if request.service != f"{self.package}.Plugin":
            return TtrpcResponse(code=CODE_UNIMPLEMENTED, message=f"no service {request.service}")
        if request.method == "Configure":
            self.runtime = " ".join(
                _text(fields(request.payload), n) for n in (2, 3)
            ).strip()  # fmt: skip
            mask = event_mask([EVENT_STOP_CONTAINER, EVENT_REMOVE_CONTAINER])
            return TtrpcResponse(field_int(2, mask))
        if request.method in ("StopContainer", "RemoveContainer"):
            try:
                self.handler(request.method, decode_container_event(request.payload))
            except Exception as e:  # noqa: BLE001 (the runtime is told, the session goes on)
                return TtrpcResponse(code=CODE_INTERNAL, message=str(e)[:200])
            return TtrpcResponse()
        if request.method == "Synchronize":
            # Nothing to change; `more` echoed, as NRI's own stub does, while the runtime
            # sends its pods and containers in parts.
            more = _int(fields(request.payload), 3)
            return TtrpcResponse(field_int(2, 1) if more else b"")
        if request.method in ("Shutdown", "StateChange"):
            return TtrpcResponse()
        return TtrpcResponse(code=CODE_UNIMPLEMENTED, message=f"{request.method} is not handled")
