"""A test double of the Kubernetes API server's node endpoint: a real HTTP server on loopback.

Serves ``GET /api/v1/nodes`` (a ``NodeList``) and ``GET``/``PATCH`` on ``/api/v1/nodes/{name}`` for the
nodes it is given, records every request, and applies merge patches (strategic-merge and JSON-merge
patches of plain maps behave alike for the fields cordoning touches) to its node objects. Options and
failure modes, all settable while it runs::

    with FakeKubeApi(nodes=["node-a", "node-b"], token="s3cret") as api:
        api.url                       # http://127.0.0.1:PORT
        api.requests                  # [Request(method, path, headers, body), ...]
        api.patches("node-a")         # decoded PATCH bodies for one node
        api.node("node-a")            # current object: {"metadata": {...}, "spec": {...}}
        api.fail_next(500, times=2)   # the next 2 requests answer 500 with a Status body
        api.set_delay(1.5)            # every request sleeps first
        api.set_late_answer(1.5)      # every PATCH is applied, then answered that much later
        api.refuse_patches(422)       # every PATCH is answered 422 and not applied
        api.set_unschedulable("node-b")

A wrong or missing bearer token answers 401 (when ``token`` is set); an unknown node 404; a PATCH with a
content type other than the three patch types 415 -- as the real API server does.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATCH_TYPES = (
    "application/strategic-merge-patch+json",
    "application/merge-patch+json",
    "application/json-patch+json",
)


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = v


def _status(code: int, reason: str, message: str) -> bytes:
    return json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
    ).encode()


class FakeKubeApi:
    def __init__(self, nodes: list[str] | None = None, token: str | None = None) -> None:
        self.token = token
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, Any]] = {}
        for n in nodes or []:
            self.add_node(n)
        self.requests: list[Request] = []
        self._fail: list[int] = []
        self._delay = 0.0
        self._late_patch = 0.0
        self._refuse_patch: int | None = None
        self._stop_delay = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self, code: int, body: bytes) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client timed out (set_delay): nothing to answer to
                    pass

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                req = Request(method, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with fake._lock:
                    fake.requests.append(req)
                    delay = fake._delay
                    fail = fake._fail.pop(0) if fake._fail else None
                    if fail is None and method == "PATCH":
                        fail = fake._refuse_patch
                if delay:
                    fake._stop_delay.wait(delay)
                if fail is not None:
                    self._reply(fail, _status(fail, "InternalError", f"injected failure {fail}"))
                    return
                code, out = fake._serve(req)
                with fake._lock:
                    late = fake._late_patch if method == "PATCH" else 0.0
                if late:  # applied already: only the answer is late (an overloaded API server)
                    fake._stop_delay.wait(late)
                self._reply(code, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-kube-api",
            daemon=True,
        )

    # ---------------------------------------------------------------------------------- control

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_node(self, name: str) -> None:
        with self._lock:
            self._nodes[name] = {
                "kind": "Node",
                "apiVersion": "v1",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}, "annotations": {}},
                "spec": {},
            }

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._nodes[name]))

    def set_unschedulable(self, name: str, value: bool = True) -> None:
        with self._lock:
            self._nodes[name]["spec"]["unschedulable"] = value

    def fail_next(self, status: int, times: int = 1) -> None:
        with self._lock:
            self._fail.extend([status] * times)

    def refuse_patches(self, status: int | None) -> None:
        with self._lock:
            self._refuse_patch = status

    def set_late_answer(self, seconds: float) -> None:
        with self._lock:
            self._late_patch = seconds

    def set_delay(self, seconds: float) -> None:
        with self._lock:
            self._delay = seconds

    def patches(self, name: str | None = None) -> list[Any]:
        with self._lock:
            reqs = list(self.requests)
        return [
            r.json()
            for r in reqs
            if r.method == "PATCH" and (name is None or r.path == f"/api/v1/nodes/{name}")
        ]

    def wait_for(self, predicate: Any, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())

    # ------------------------------------------------------------------------------------ serve

    def _serve(self, req: Request) -> tuple[int, bytes]:
        if self.token is not None and req.headers.get("authorization") != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        if req.path.split("?")[0] == "/api/v1/nodes" and req.method == "GET":
            with self._lock:
                items = [json.loads(json.dumps(n)) for n in self._nodes.values()]
            body = {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": items,
            }
            return 200, json.dumps(body).encode()
        prefix = "/api/v1/nodes/"
        if not req.path.startswith(prefix):
            return 404, _status(
                404, "NotFound", f"the server could not find the requested resource {req.path}"
            )
        name = req.path[len(prefix) :]
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return 404, _status(404, "NotFound", f'nodes "{name}" not found')
            if req.method == "GET":
                return 200, json.dumps(node).encode()
            if req.method == "PATCH":
                ctype = req.headers.get("content-type", "").split(";")[0].strip()
                if ctype not in PATCH_TYPES:
                    return 415, _status(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted media types include: "
                        + ", ".join(PATCH_TYPES),
                    )
                try:
                    patch = json.loads(req.body)
                except ValueError:
                    return 400, _status(400, "BadRequest", "invalid JSON")
                if not isinstance(patch, dict):
                    return 422, _status(422, "Invalid", "patch must be an object")
                _merge(node, patch)
                return 200, json.dumps(node).encode()
        return 405, _status(405, "MethodNotAllowed", req.method)

    # -------------------------------------------------------------------------------- lifecycle

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop_delay.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
