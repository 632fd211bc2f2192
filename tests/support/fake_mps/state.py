"""What the fake control daemon knows: its protocol, the v2 defaults, the v3 servers and
namespaces, the attached clients and the GPUs a killed client wedged; and the answer to each
command. The sockets are the daemon's (tests/support/fake_mps/daemon.py): a namespace or server
created here asks it for one through `Sockets`. Every method is called with `lock` held, but
those that may wait (a terminate), which take it themselves."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tests.support.fake_mps.records import record

NAME = re.compile(r"^[a-z0-9_]{1,64}$")
DEFAULT = "default"
ALL = "*"
_SIZE = re.compile(r"^(\d+)([KMGT]?)$")
_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


class FakeError(Exception):
    """A command refused: the run prints the message on stderr and exits 1."""


class Sockets(Protocol):
    def open(self, path: Path, server: str, namespace: str) -> None: ...

    def close(self, path: Path) -> None: ...


def mib(size: str) -> float:
    match = _SIZE.match(size.strip().upper().removesuffix("B"))
    if match is None:
        raise FakeError(f"Invalid memory size: {size}")
    return int(match.group(1)) * _MIB[match.group(2)]


@dataclass
class Namespace:
    name: str
    threads: int | None = None
    memory: str | None = None
    priority: int | None = None


@dataclass
class Server:
    name: str
    uid: int
    devices: frozenset[str]
    namespaces: dict[str, Namespace] = field(default_factory=dict)


@dataclass
class Client:
    pid: int
    server: str  # "" under v2
    namespace: str
    devices: frozenset[str]
    conn: socket.socket
    work: bool = False
    terminated: bool = False


def _touches(a: frozenset[str], b: frozenset[str] | set[str]) -> bool:
    if not a or not b:
        return False
    return bool(a & b) or ALL in a or ALL in b


def _options(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words and `--key=value` (or bare `--key`) options."""
    args: list[str] = []
    opts: dict[str, str] = {}
    for word in words:
        if word.startswith("--"):
            key, _, value = word[2:].partition("=")
            opts[key] = value
        else:
            args.append(word)
    return args, opts


class FakeState:
    def __init__(self, pipe: Path, root: Path, protocol: int, multiuser: bool) -> None:
        self.pipe = pipe
        self.root = root
        self.protocol = protocol
        self.multiuser = multiuser
        self.lock = threading.Lock()
        self.settings: dict[str, str] = {}
        self.servers: dict[str, Server] = {}
        self.clients: dict[int, Client] = {}
        self.wedged: set[str] = set()
        self.sockets: Sockets | None = None

    # --- v2 ---------------------------------------------------------------------------------

    def answer_v2(self, name: str, args: list[str], command: str) -> str:
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            self.settings[f"mem:{args[0]}"] = args[1]
            return ""
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.settings.get(f"mem:{args[0]}", "0")
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            self.settings["threads"] = args[0]
            return f"{float(args[0]):.1f}"
        if name == "get_default_active_thread_percentage":
            return f"{float(self.settings.get('threads', '100')):.1f}"
        if name == "get_server_list":
            # The fake's MPS servers are threads of the control daemon: its PID stands for them.
            return str(self.server_pid()) if self.clients else ""
        if name == "get_client_list" and len(args) == 1:
            if args[0] != str(self.server_pid()):
                raise FakeError(f"No server with pid {args[0]}")
            return "\n".join(str(pid) for pid in sorted(self.clients))
        if self.protocol == 3:
            raise FakeError(f"Unrecognized command: {command}")
        return f"Unrecognized command: {command}"

    @staticmethod
    def server_pid() -> int:
        return os.getpid()

    # --- v3 ---------------------------------------------------------------------------------

    def answer_v3(self, words: list[str], command: str) -> str:
        module, verb = words[0], words[1] if len(words) > 1 else ""
        args, opts = _options(words[2:])
        handler = {
            ("server", "create"): self._server_create,
            ("server", "set"): self._server_set,
            ("server", "get"): self._server_get,
            ("server", "list"): self._server_list,
            ("server", "delete"): self._server_delete,
            ("namespace", "create"): self._namespace_create,
            ("namespace", "set"): self._namespace_set,
            ("namespace", "get"): self._namespace_get,
            ("namespace", "list"): self._namespace_list,
            ("namespace", "delete"): self._namespace_delete,
            ("client", "list"): self._client_list,
            ("client", "get"): self._client_get,
        }.get((module, verb))
        if handler is None:
            raise FakeError(f"Unrecognized command: {command}")
        return handler(args, opts)

    def _server(self, name: str) -> Server:
        server = self.servers.get(name)
        if server is None:
            raise FakeError(f"Server {name} does not exist")
        return server

    def _server_create(self, args: list[str], opts: dict[str, str]) -> str:
        if len(args) != 1 or not NAME.match(args[0]):
            raise FakeError("server create: a name of lowercase letters, digits and _ expected")
        name = args[0]
        if name in self.servers:
            raise FakeError(f"Server {name} already exists")
        uid = int(opts.get("uid", "0"))
        if self.multiuser and uid != 0:
            raise FakeError("In multiuser mode only --uid=0 is allowed")
        allowed = opts.get("allowed-devices", "")
        devices = frozenset(allowed.split(",")) if allowed else frozenset({ALL})
        server = Server(name, uid, devices, {DEFAULT: Namespace(DEFAULT)})
        assert self.sockets is not None
        self.sockets.open(self.pipe / name / "control", name, DEFAULT)
        self.servers[name] = server
        return ""

    def _limits(self, namespace: Namespace, opts: dict[str, str]) -> None:
        if "active-thread-percentage" in opts:
            threads = int(opts["active-thread-percentage"])
            if not 1 <= threads <= 100:
                raise FakeError("active thread percentage must be within 1-100")
            namespace.threads = threads
        if "pinned-memory-limit" in opts:
            mib(opts["pinned-memory-limit"])
            namespace.memory = opts["pinned-memory-limit"]
        if "client-priority" in opts:
            namespace.priority = int(opts["client-priority"])

    def _attached(self, server: str, namespace: str | None) -> list[Client]:
        return [
            c
            for c in self.clients.values()
            if c.server == server and namespace in (None, c.namespace)
        ]

    def _server_set(self, args: list[str], opts: dict[str, str]) -> str:
        if len(args) != 1:
            raise FakeError("server set: a server name expected")
        self._limits(self._server(args[0]).namespaces[DEFAULT], opts)
        return ""

    def _show(self, namespace: Namespace, server: Server, field_name: str | None) -> str:
        directory = self.pipe / server.name
        if namespace.name != DEFAULT:
            directory = directory / namespace.name
        fields = {
            "active-thread-percentage": str(namespace.threads or ""),
            "pinned-memory-limit": namespace.memory or "",
            "client-priority": "" if namespace.priority is None else str(namespace.priority),
            "clients": str(len(self._attached(server.name, namespace.name))),
            "pipe-directory": str(directory),
        }
        if field_name is not None:
            if field_name not in fields:
                raise FakeError(f"Unknown field {field_name}")
            return fields[field_name]
        return "\n".join(f"{k}={v}" for k, v in fields.items())

    def _server_get(self, args: list[str], opts: dict[str, str]) -> str:
        if not args:
            raise FakeError("server get: a server name expected")
        server = self._server(args[0])
        return self._show(server.namespaces[DEFAULT], server, args[1] if len(args) > 1 else None)

    def _server_list(self, args: list[str], opts: dict[str, str]) -> str:
        return "\n".join(sorted(self.servers))

    def _server_delete(self, args: list[str], opts: dict[str, str]) -> str:
        if len(args) != 1:
            raise FakeError("server delete: a server name expected")
        server = self._server(args[0])
        attached = self._attached(server.name, None)
        if attached and "force" not in opts:
            raise FakeError(f"Server {server.name} has {len(attached)} active clients")
        for client in attached:
            self.drained(client)
        assert self.sockets is not None
        for name in list(server.namespaces):
            directory = self.pipe / server.name
            self.sockets.close((directory if name == DEFAULT else directory / name) / "control")
        del self.servers[server.name]
        return ""

    def _namespace_args(self, verb: str, args: list[str], opts: dict[str, str]) -> Server:
        if not args or "server" not in opts:
            raise FakeError(f"namespace {verb}: a name and --server=<server> expected")
        return self._server(opts["server"])

    def _namespace_create(self, args: list[str], opts: dict[str, str]) -> str:
        server = self._namespace_args("create", args, opts)
        name = args[0]
        if not NAME.match(name) or name == DEFAULT:
            raise FakeError("namespace create: a name of lowercase letters, digits and _ expected")
        if name in server.namespaces:
            raise FakeError(f"Namespace {name} already exists on server {server.name}")
        assert self.sockets is not None
        self.sockets.open(self.pipe / server.name / name / "control", server.name, name)
        server.namespaces[name] = Namespace(name)
        return ""

    def _namespace(self, server: Server, name: str) -> Namespace:
        namespace = server.namespaces.get(name)
        if namespace is None:
            raise FakeError(f"Namespace {name} does not exist on server {server.name}")
        return namespace

    def _namespace_set(self, args: list[str], opts: dict[str, str]) -> str:
        server = self._namespace_args("set", args, opts)
        namespace = self._namespace(server, args[0])
        if self._attached(server.name, namespace.name):
            raise FakeError(f"Cannot set namespace {namespace.name}: clients are attached to it")
        self._limits(namespace, opts)
        return ""

    def _namespace_get(self, args: list[str], opts: dict[str, str]) -> str:
        server = self._namespace_args("get", args, opts)
        namespace = self._namespace(server, args[0])
        return self._show(namespace, server, args[1] if len(args) > 1 else None)

    def _namespace_list(self, args: list[str], opts: dict[str, str]) -> str:
        if "server" not in opts:
            raise FakeError("namespace list: --server=<server> expected")
        server = self._server(opts["server"])
        return "\n".join(sorted(n for n in server.namespaces if n != DEFAULT))

    def _namespace_delete(self, args: list[str], opts: dict[str, str]) -> str:
        server = self._namespace_args("delete", args, opts)
        namespace = self._namespace(server, args[0])
        attached = self._attached(server.name, namespace.name)
        if attached and "force" not in opts:
            raise FakeError(
                f"Cannot delete namespace {namespace.name}: {len(attached)} clients are attached"
            )
        for client in attached:
            self.drained(client)
        assert self.sockets is not None
        self.sockets.close(self.pipe / server.name / namespace.name / "control")
        del server.namespaces[namespace.name]
        return ""

    def _client_list(self, args: list[str], opts: dict[str, str]) -> str:
        server = opts.get("server")
        return "\n".join(
            str(c.pid)
            for c in sorted(self.clients.values(), key=lambda c: c.pid)
            if server in (None, "", c.server) or "all" in opts
        )

    def _client_get(self, args: list[str], opts: dict[str, str]) -> str:
        if len(args) != 2 or not args[0].isdigit():
            raise FakeError("client get: <pid> <field> expected")
        client = self.clients.get(int(args[0]))
        if client is None:
            raise FakeError(f"No client with pid {args[0]}")
        values = {
            "pid": str(client.pid),
            "server": client.server,
            "namespace": client.namespace,
            "device": ",".join(sorted(client.devices)),
        }
        if args[1] not in values:
            raise FakeError(f"Unknown field {args[1]}")
        return values[args[1]]

    # --- clients ----------------------------------------------------------------------------

    def attach(
        self, conn: socket.socket, pid: int, server: str, namespace: str, asked: dict[str, str]
    ) -> str:
        """A client attaches; the limits it gets, as `ok threads=<n> memory=<size>`."""
        if server and server not in self.servers:
            raise FakeError(f"Server {server} does not exist")
        if self.protocol == 3 and not server:
            raise FakeError("this control daemon routes clients by their server's directory")
        devices = self.servers[server].devices if server else frozenset(
            asked.get("devices", ALL).split(",")
        )  # fmt: skip
        if server:
            limits = self.servers[server].namespaces[namespace]
            threads, memory = limits.threads or 100, limits.memory
        else:
            threads = int(float(self.settings.get("threads", "100")))
            memory = self.settings.get(f"mem:{min(devices)}")
        if asked.get("threads", "-") != "-":
            threads = min(threads, int(asked["threads"]))  # a client can only lower its cap
        lower = asked.get("memory", "-")
        if lower != "-" and (memory is None or mib(lower) < mib(memory)):
            memory = lower
        self.clients[pid] = Client(pid, server, namespace, devices, conn)
        record({"event": "attached", "client": pid, "server": server, "namespace": namespace})
        return f"ok threads={threads} memory={memory or 'none'}"

    def is_wedged(self, devices: frozenset[str]) -> bool:
        return _touches(devices, self.wedged)

    def devices_of(self, server: str, asked: dict[str, str]) -> frozenset[str]:
        if server:
            return self.servers[server].devices if server in self.servers else frozenset()
        return frozenset(asked.get("devices", ALL).split(","))

    def lost(self, client: Client, detached: bool) -> None:
        """The client's connection closed: after `detach`, or because the process died."""
        self.clients.pop(client.pid, None)
        if detached:
            record({"event": "detached", "client": client.pid})
            return
        wedges = client.work and not client.terminated
        record(
            {
                "event": "client-lost",
                "client": client.pid,
                "terminated": client.terminated,
                "work_in_flight": client.work,
                "wedged": wedges,
            }
        )
        if wedges:
            self.wedged |= client.devices

    def drained(self, client: Client) -> None:
        """`client terminate`: no new submissions, its outstanding work drained."""
        client.terminated = True
        client.work = False
        with contextlib.suppress(OSError):
            client.conn.sendall(b"terminated\n")

    def terminate(self, pid: int, hangs: Callable[[], bool], stopped: Callable[[int], bool]) -> str:
        """`client terminate <pid>` (v3) or `terminate_client <server> <pid>` (v2). Waits while
        the client is stopped (a stopped process cannot take the terminate), forever when
        `hangs()` (a wedged GPU). Takes the lock itself."""
        with self.lock:
            if pid not in self.clients:
                raise FakeError(f"No client with pid {pid}")
        was_stopped = stopped(pid)
        record({"event": "terminate", "client": pid, "stopped": was_stopped})
        if hangs():
            record({"event": "terminate-hangs", "client": pid})
            threading.Event().wait()
        while stopped(pid):
            time.sleep(0.02)
        with self.lock:
            client = self.clients.get(pid)
            if client is None:
                raise FakeError(f"No client with pid {pid}")
            self.drained(client)
        record({"event": "terminated", "client": pid})
        return ""
