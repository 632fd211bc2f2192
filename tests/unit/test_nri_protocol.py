"""The NRI plugin protocol (deviceplugin/nri/protocol.py) against a synthetic exchange with a
runtime: the runtime's side is built here from the message layouts of containerd/ttrpc's
request.proto and containerd/nri's api.proto, encoded by protobuf's own library (messages made
from descriptors at run time), so the hand-written wire format is checked against an
independent encoder."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from deviceplugin.nri.protocol import (
    CODE_UNIMPLEMENTED,
    EVENT_REMOVE_CONTAINER,
    EVENT_STOP_CONTAINER,
    PLUGIN_CONN,
    RUNTIME_CONN,
    TTRPC_REQUEST,
    TTRPC_RESPONSE,
    ContainerEvent,
    MuxReader,
    NriProtocolError,
    PluginSession,
    TtrpcReader,
    fields,
    mux_frame,
    ttrpc_frame,
)

F = descriptor_pb2.FieldDescriptorProto
STRING, BYTES, INT64, INT32, UINT32, MESSAGE, BOOL = (
    F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_INT64, F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_MESSAGE,
    F.TYPE_BOOL,
)  # fmt: skip
LAYOUTS: dict[str, list[tuple[str, int, int, str]]] = {
    "Status": [("code", 1, INT32, ""), ("message", 2, STRING, "")],
    "Request": [
        ("service", 1, STRING, ""), ("method", 2, STRING, ""), ("payload", 3, BYTES, ""),
        ("timeout_nano", 4, INT64, ""),
    ],
    "Response": [("status", 1, MESSAGE, ".t.Status"), ("payload", 2, BYTES, "")],
    "RegisterPluginRequest": [("plugin_name", 1, STRING, ""), ("plugin_idx", 2, STRING, "")],
    "ConfigureRequest": [
        ("config", 1, STRING, ""), ("runtime_name", 2, STRING, ""),
        ("runtime_version", 3, STRING, ""), ("registration_timeout", 4, INT64, ""),
        ("request_timeout", 5, INT64, ""),
    ],
    "ConfigureResponse": [("events", 2, INT32, ""), ("request_timeout", 3, INT64, "")],
    "SynchronizeRequest": [("more", 3, BOOL, "")],
    "SynchronizeResponse": [("more", 2, BOOL, "")],
    "PodSandbox": [
        ("id", 1, STRING, ""), ("name", 2, STRING, ""), ("uid", 3, STRING, ""),
        ("namespace", 4, STRING, ""),
    ],
    "Container": [
        ("id", 1, STRING, ""), ("pod_sandbox_id", 2, STRING, ""), ("name", 3, STRING, ""),
        ("args", 7, STRING, ""), ("pid", 12, UINT32, ""),
    ],
    "StopContainerRequest": [
        ("pod", 1, MESSAGE, ".t.PodSandbox"), ("container", 2, MESSAGE, ".t.Container"),
    ],
}  # fmt: skip


def message_classes() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(name="t.proto", package="t", syntax="proto3")
    for name, layout in LAYOUTS.items():
        message = file.message_type.add(name=name)
        for field_name, number, kind, type_name in layout:
            label = F.LABEL_REPEATED if field_name == "args" else F.LABEL_OPTIONAL
            field = message.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"t.{name}"))
        for name in LAYOUTS
    }


PB = message_classes()
PACKAGE = "nri.pkg.api.v1alpha1"


def runtime_request(stream: int, method: str, payload: Any) -> bytes:
    """What the runtime sends to call the plugin's `method`."""
    request = PB["Request"](
        service=f"{PACKAGE}.Plugin", method=method, payload=payload.SerializeToString()
    )
    return mux_frame(PLUGIN_CONN, ttrpc_frame(stream, TTRPC_REQUEST, request.SerializeToString()))


def plugin_answers(data: bytes) -> list[tuple[int, int, Any]]:
    """(connection, stream, ttrpc Response) of each answer the plugin sent."""
    found = []
    for conn, payload in MuxReader().feed(data):
        for message in TtrpcReader().feed(payload):
            assert message.kind == TTRPC_RESPONSE
            found.append((conn, message.stream, PB["Response"].FromString(message.data)))
    return found


def session(seen: list[tuple[str, ContainerEvent]]) -> PluginSession:
    return PluginSession("vgpu-mps", "10", lambda method, c: seen.append((method, c)))


def test_registration_is_a_ttrpc_request_to_the_runtime_service() -> None:
    plugin = session([])
    ((conn, payload),) = list(MuxReader().feed(plugin.start()))
    assert conn == RUNTIME_CONN
    (message,) = list(TtrpcReader().feed(payload))
    assert (message.stream % 2, message.kind, message.flags) == (1, TTRPC_REQUEST, 0)
    request = PB["Request"].FromString(message.data)
    assert (request.service, request.method) == (f"{PACKAGE}.Runtime", "RegisterPlugin")
    register = PB["RegisterPluginRequest"].FromString(request.payload)
    assert (register.plugin_name, register.plugin_idx) == ("vgpu-mps", "10")
    # The runtime's answer (google.rpc.Status code 0, empty payload) registers it.
    answer = PB["Response"](payload=b"").SerializeToString()
    assert plugin.receive(mux_frame(RUNTIME_CONN, ttrpc_frame(1, TTRPC_RESPONSE, answer))) == b""
    assert plugin.registered
    refused = PB["Response"](status=PB["Status"](code=9, message="plugin already registered"))
    frame = ttrpc_frame(1, TTRPC_RESPONSE, refused.SerializeToString())
    plugin.receive(mux_frame(RUNTIME_CONN, frame))
    assert (plugin.registered, plugin.error) == (False, "plugin already registered")


def test_configure_subscribes_to_stop_and_remove_container() -> None:
    plugin = session([])
    configure = PB["ConfigureRequest"](
        runtime_name="containerd", runtime_version="v2.3.4", request_timeout=2000
    )
    ((conn, stream, response),) = plugin_answers(
        plugin.receive(runtime_request(1, "Configure", configure))
    )
    assert (conn, stream, response.status.code) == (PLUGIN_CONN, 1, 0)
    events = PB["ConfigureResponse"].FromString(response.payload).events
    assert events == (1 << (EVENT_STOP_CONTAINER - 1)) | (1 << (EVENT_REMOVE_CONTAINER - 1))
    assert plugin.runtime == "containerd v2.3.4"


def test_stop_container_reaches_the_handler_with_the_pod_and_container() -> None:
    seen: list[tuple[str, ContainerEvent]] = []
    plugin = session(seen)
    stop = PB["StopContainerRequest"](
        pod=PB["PodSandbox"](id="sb1", name="trainer-0", uid="u-1", namespace="team-a"),
        container=PB["Container"](
            id="c0ffee", pod_sandbox_id="sb1", name="main", args=["python", "-m", "x"], pid=4242
        ),
    )
    # Split anywhere: frames are taken whole.
    data = runtime_request(3, "StopContainer", stop) + runtime_request(5, "RemoveContainer", stop)
    out = b"".join(plugin.receive(data[i : i + 7]) for i in range(0, len(data), 7))
    assert [(s, r.status.code) for _, s, r in plugin_answers(out)] == [(3, 0), (5, 0)]
    event = ContainerEvent("team-a", "trainer-0", "u-1", "c0ffee", "main", 4242)
    assert seen == [("StopContainer", event), ("RemoveContainer", event)]


def test_synchronize_echoes_more_and_unknown_calls_are_refused() -> None:
    plugin = session([])
    sync = plugin_answers(
        plugin.receive(runtime_request(1, "Synchronize", PB["SynchronizeRequest"](more=True)))
    )
    assert PB["SynchronizeResponse"].FromString(sync[0][2].payload).more is True
    unknown = plugin_answers(plugin.receive(runtime_request(3, "Bogus", PB["Status"]())))
    assert unknown[0][2].status.code == CODE_UNIMPLEMENTED


def test_a_failing_handler_is_reported_to_the_runtime() -> None:
    def fail(method: str, event: ContainerEvent) -> None:
        raise RuntimeError("drain failed")

    plugin = PluginSession("vgpu-mps", "10", fail)
    stop = PB["StopContainerRequest"](container=PB["Container"](id="c"))
    ((_, _, response),) = plugin_answers(plugin.receive(runtime_request(1, "StopContainer", stop)))
    assert response.status.message == "drain failed"


def test_bad_input_is_refused() -> None:
    with pytest.raises(NriProtocolError, match="over"):
        list(MuxReader().feed(struct.pack(">II", 1, 64 << 20)))
    with pytest.raises(NriProtocolError, match="runs past"):
        fields(b"\x0a\x05ab")
    with pytest.raises(NriProtocolError, match="wire type"):
        fields(b"\x0b")
    # Fixed-width fields are skipped, not misread.
    assert fields(b"\x09" + bytes(8) + b"\x10\x07") == {2: [7]}
