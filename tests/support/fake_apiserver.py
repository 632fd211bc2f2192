"""A small fake Kubernetes API server: what the DRA driver asks of one (ResourceSlices, claims,
its Node), over plain HTTP on 127.0.0.1, in a thread. Requests are recorded for the tests.

The daemon under test usually runs on the test's own event loop, and the test reads this
server's state from that loop: so a handler never holds the state's lock while it reads from or
writes to its socket (a client that has sent its headers but not yet its body would otherwise
stall every caller of the lock, the loop included, forever), and every socket read has a
timeout (`SOCKET_TIMEOUT_S`), after which the handler gives up on that request, saying so."""

from __future__ import annotations

import itertools
import json
import queue
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SOCKET_TIMEOUT_S = 10.0
# How long the test's own accessors wait for the state's lock before failing, naming it.
LOCK_TIMEOUT_S = 10.0
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"


class FakeApiServer:
    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_writes = False
        # A slice written (created or replaced) is refused with 422 Invalid and this message,
        # as the API server refuses a slice that breaks its validation rules; "": taken.
        self.refuse_slices = ""
        # Claims (namespace, name) whose GET is never answered: a stalled API server.
        self.stall_claims: set[tuple[str, str]] = set()
        # Claims whose GET waits until the test sets the event, then is answered as usual.
        self.hold_claims: dict[tuple[str, str], threading.Event] = {}
        # Claims whose GET is answered 200 with these bytes: a garbled answer.
        self.raw_claims: dict[tuple[str, str], bytes] = {}
        self._closed = threading.Event()
        # Requests a handler gave up on (a socket read that timed out), for the test to see.
        self.errors: list[str] = []
        self._watchers: list[queue.Queue[dict[str, Any] | None]] = []
        self.watches = 0
        self._lock = threading.Lock()
        self._versions = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        for held in list(self.hold_claims.values()):
            held.set()
        with self._lock:
            for watcher in self._watchers:
                watcher.put(None)
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": self.url}}],
                    "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        return path

    def locked(self) -> _Held:
        """The state's lock, for the test's side: an AssertionError, not a hang, when a handler
        holds it too long."""
        return _Held(self._lock)

    def put_claim(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        with self.locked():
            self.claims[(meta["namespace"], meta["name"])] = claim

    def delete_slice(self, name: str) -> None:
        """Delete a slice as someone else would (a kubelet that starts, an operator)."""
        with self.locked():
            obj = self.slices.pop(name)
            for watcher in self._watchers:
                watcher.put({"type": "DELETED", "object": obj})

    def slice_list(self) -> list[dict[str, Any]]:
        with self.locked():
            return [json.loads(json.dumps(s)) for s in self.slices.values()]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            # Every read from the client's socket: a stalled client fails the request, not
            # the server.
            timeout = SOCKET_TIMEOUT_S
            _reply: tuple[int, dict[str, Any]] | None = None
            _body_read: dict[str, Any] = {}  # noqa: RUF012 (replaced per request)

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _send(self, code: int, body: dict[str, Any]) -> None:
                """The answer to the request: written by `_route` once the lock is released."""
                self._reply = (code, json.loads(json.dumps(body)))

            def _write(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": code,
                        "reason": reason,
                        "message": message,
                    },
                )

            def _watch(self) -> None:
                events: queue.Queue[dict[str, Any] | None] = queue.Queue()
                with fake._lock:
                    fake._watchers.append(events)
                    fake.watches += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while (event := events.get()) is not None:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass
                finally:
                    with fake._lock:
                        fake._watchers.remove(events)

            def _read_body(self) -> dict[str, Any]:
                """The request's JSON body, read before the state's lock is taken. Raises
                TimeoutError (a socket read timed out) or ValueError (not JSON)."""
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else b""
                if len(data) != length:
                    raise ValueError(f"body cut short: {len(data)} of {length} bytes")
                body: dict[str, Any] = json.loads(data or b"{}")
                return body

            def _route(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                path = url.path
                with fake._lock:
                    fake.requests.append((method, path))
                if method == "GET" and path == SLICES and "watch=true" in url.query:
                    self._watch()
                    return
                if method == "GET" and self._stalled(path):
                    return
                if method == "GET" and self._raw(path):
                    return
                try:
                    body = self._read_body() if method in ("POST", "PUT") else {}
                except (TimeoutError, ValueError) as e:
                    with fake._lock:
                        fake.errors.append(f"{method} {path}: request body not read: {e!r}")
                    self.close_connection = True
                    return
                self._body_read = body
                self._reply = None
                if method != "GET" and fake.fail_writes:
                    self._status(503, "ServiceUnavailable", "writes refused by the test")
                elif method in ("POST", "PUT") and path.startswith(SLICES) and fake.refuse_slices:
                    self._status(422, "Invalid", fake.refuse_slices)
                else:
                    with fake._lock:
                        self._dispatch(method, path, urllib.parse.parse_qs(url.query))
                if self._reply is not None:
                    self._write(*self._reply)

            def _stalled(self, path: str) -> bool:
                """A GET of a claim the test stalls: never answered, until the server closes.
                One it holds waits for the test's event (or the server's close), then goes on."""
                key = _claim_key(path)
                held = fake.hold_claims.get(key) if key else None
                if held is not None:
                    held.wait()  # set by the test, or by close()
                if key is None or key not in fake.stall_claims:
                    return False
                fake._closed.wait()
                self.close_connection = True
                return True

            def _raw(self, path: str) -> bool:
                """A GET of a claim the test answers with bytes of its own."""
                key = _claim_key(path)
                data = fake.raw_claims.get(key) if key else None
                if data is None:
                    return False
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return True

            def _body(self) -> dict[str, Any]:
                return self._body_read

            def _dispatch(self, method: str, path: str, query: dict[str, list[str]]) -> None:
                parts = path.strip("/").split("/")
                if path.startswith("/api/v1/nodes/") and method == "GET":
                    node = fake.nodes.get(parts[-1])
                    if node is None:
                        self._status(404, "NotFound", f"node {parts[-1]} not found")
                    else:
                        self._send(200, node)
                    return
                if path.startswith("/apis/resource.k8s.io/v1/namespaces/") and method == "GET":
                    claim = fake.claims.get((parts[4], parts[6]))
                    if claim is None:
                        self._status(404, "NotFound", f"claim {parts[6]} not found")
                    else:
                        self._send(200, claim)
                    return
                if path == SLICES and method == "GET":
                    wanted = dict(
                        kv.split("=", 1)
                        for sel in query.get("fieldSelector", [])
                        for kv in sel.split(",")
                    )
                    items = [
                        s
                        for s in fake.slices.values()
                        if all(
                            (
                                s["spec"].get("nodeName")
                                if k == "spec.nodeName"
                                else s["spec"].get("driver")
                            )
                            == v
                            for k, v in wanted.items()
                        )
                    ]
                    self._send(
                        200,
                        {
                            "kind": "ResourceSliceList",
                            "apiVersion": "resource.k8s.io/v1",
                            "metadata": {"resourceVersion": str(next(fake._versions))},
                            "items": items,
                        },
                    )
                    return
                if path == SLICES and method == "POST":
                    body = self._body()
                    name = body["metadata"]["name"]
                    if name in fake.slices:
                        self._status(409, "AlreadyExists", f"{name} exists")
                        return
                    body["metadata"]["resourceVersion"] = str(next(fake._versions))
                    body["metadata"]["uid"] = f"uid-{name}"
                    fake.slices[name] = body
                    self._send(201, body)
                    return
                if path.startswith(SLICES + "/"):
                    name = parts[-1]
                    if method == "PUT":
                        body = self._body()
                        old = fake.slices.get(name)
                        if old is None:
                            self._status(404, "NotFound", f"{name} not found")
                            return
                        if body["metadata"].get("resourceVersion") not in (
                            None,
                            old["metadata"]["resourceVersion"],
                        ):
                            self._status(409, "Conflict", "resourceVersion changed")
                            return
                        body["metadata"]["resourceVersion"] = str(next(fake._versions))
                        fake.slices[name] = body
                        self._send(200, body)
                        return
                    if method == "DELETE":
                        fake.slices.pop(name, None)
                        self._send(200, {"kind": "Status", "status": "Success"})
                        return
                self._status(405, "MethodNotAllowed", f"{method} {path}")

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler


def _claim_key(path: str) -> tuple[str, str] | None:
    """(namespace, name) of a claim's path, None for any other path."""
    parts = path.strip("/").split("/")
    if len(parts) != 7 or parts[:3] != ["apis", "resource.k8s.io", "v1"]:
        return None
    if (parts[3], parts[5]) != ("namespaces", "resourceclaims"):
        return None
    return parts[4], parts[6]


class _Held:
    """A lock taken with a deadline: AssertionError naming the fake API server on timeout."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise AssertionError(
                f"the fake API server's state was locked for over {LOCK_TIMEOUT_S:g}s: "
                "a request handler is stuck"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def allocated_claim(
    name: str,
    uid: str,
    node: str,
    results: list[dict[str, Any]],
    *,
    namespace: str = "default",
    pod: str = "pod-1",
) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: allocated and reserved for one pod."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {
            "allocation": {
                "devices": {"results": [{"driver": "vgpu.dev", "pool": node, **r} for r in results]}
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}],
        },
    }
