"""A test double of the Kubernetes API server's pod list/watch and owner objects: real HTTP on loopback.

Faithful where the node agent depends on it (shapes from the API reference, v1.31):

* ``GET /api/v1/pods?fieldSelector=spec.nodeName=N`` answers a ``PodList`` with
  ``metadata.resourceVersion``; only pods bound to N;
* ``...&watch=true&resourceVersion=RV`` streams newline-delimited ``WatchEvent`` JSON
  (``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}``) over chunked transfer
  encoding, every change after RV for the selected pods, a ``BOOKMARK`` when
  ``allowWatchBookmarks=true`` and the stream ends (``timeoutSeconds``), and ends the stream then;
* a ``resourceVersion`` older than the compaction point gets an ``ERROR`` event with a ``Status`` of
  code 410, reason ``Expired`` ("too old resource version"), as the API server sends for a watch;
  ``gone_as_http=True`` answers HTTP 410 instead (what it does for some list requests);
* ``GET /api/v1/namespaces/NS/pods/NAME`` and ``/apis/GROUP/VERSION/namespaces/NS/PLURAL/NAME`` for
  owner objects (ReplicaSet, Deployment, Job, CronJob, StatefulSet, custom resources), 404 with a
  ``Status`` for unknown ones, 403 for kinds marked forbidden;
* bearer-token check (401) when ``token`` is set.

Controls: ``add_pod``, ``add_owner``, ``delete_pod``, ``set_labels``, ``compact``, ``end_watches``,
``stop``/``restart`` (the same port: the API server going away and coming back), and ``requests``
(every request's verb) for load figures.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def owner_ref(api_version: str, kind: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _plural(kind: str) -> str:
    k = kind.lower()
    return k[:-1] + "ies" if k.endswith("y") else (k + "es" if k.endswith("s") else k + "s")


class FakePodApi:
    def __init__(self, token: str | None = None, gone_as_http: bool = False) -> None:
        self.token = token
        self.gone_as_http = gone_as_http
        self._cond = threading.Condition()
        self._rv = 1000
        self._compacted = 0
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._objects: dict[str, dict[str, Any]] = {}  # path -> object
        self._forbidden: set[str] = set()  # plurals answered 403
        self._events: list[tuple[int, str, dict[str, Any]]] = []
        self._epoch = 0  # end_watches() bumps it: open streams end
        self._down = False  # stop() until restart(): a stream accepted just before stop ends too
        self.requests: list[str] = []  # "list" | "watch" | "get" per request
        self._port = 0
        self._server: ThreadingHTTPServer | None = None

    # -- objects -----------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_owner(
        self, api_version: str, kind: str, namespace: str, name: str, owner: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Create a controller object; returns an ownerReference to it."""
        uid = f"uid-{kind.lower()}-{namespace}-{name}"
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        with self._cond:
            self._objects[f"{base}/namespaces/{namespace}/{_plural(kind)}/{name}"] = {
                "apiVersion": api_version,
                "kind": kind,
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": self._next_rv(),
                    "ownerReferences": [owner] if owner else [],
                },
            }
        return owner_ref(api_version, kind, name, uid)

    def forbid(self, kind: str) -> None:
        with self._cond:
            self._forbidden.add(_plural(kind))

    def add_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        *,
        labels: dict[str, str] | None = None,
        owner: dict[str, Any] | None = None,
        priority_class: str | None = None,
    ) -> None:
        with self._cond:
            pod = {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": f"uid-pod-{namespace}-{name}",
                    "resourceVersion": self._next_rv(),
                    "creationTimestamp": "2026-11-30T00:00:00Z",
                    "labels": dict(labels or {}),
                    "ownerReferences": [owner] if owner else [],
                },
                "spec": {
                    "nodeName": node,
                    "containers": [{"name": "main", "image": "nvcr.io/nvidia/pytorch:25.01-py3"}],
                    **({"priorityClassName": priority_class} if priority_class else {}),
                },
                "status": {"phase": "Running"},
            }
            self._pods[(namespace, name)] = pod
            self._events.append((self._rv, "ADDED", json.loads(json.dumps(pod))))
            self._cond.notify_all()

    def set_labels(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        with self._cond:
            pod = self._pods[(namespace, name)]
            pod["metadata"]["labels"] = dict(labels)
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self._events.append((self._rv, "MODIFIED", json.loads(json.dumps(pod))))
            self._cond.notify_all()

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._cond:
            pod = self._pods.pop((namespace, name))
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self._events.append((self._rv, "DELETED", pod))
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget history: a watch from any version before now gets 410 Gone."""
        with self._cond:
            self._compacted = self._rv
            self._events.clear()

    def end_watches(self) -> None:
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def count(self, verb: str) -> int:
        with self._cond:
            return self.requests.count(verb)

    # -- serving -----------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _json(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _chunk(self, obj: Any) -> None:
                data = json.dumps(obj).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def do_GET(self) -> None:
                u = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(u.query))
                if fake.token is not None and self.headers.get("Authorization") != f"Bearer {fake.token}":
                    self._json(401, _status(401, "Unauthorized", "Unauthorized"))
                    return
                if u.path == "/api/v1/pods":
                    field = q.get("fieldSelector", "")
                    node = field.split("=", 1)[1] if field.startswith("spec.nodeName=") else None
                    if q.get("watch") in ("true", "1"):
                        self._watch(node, q)
                    else:
                        self._list(node)
                    return
                with fake._cond:
                    fake.requests.append("get")
                    parts = u.path.split("/")
                    if len(parts) > 2 and parts[-2] in fake._forbidden:
                        obj, code = _status(403, "Forbidden", f"{parts[-2]} is forbidden"), 403
                    elif u.path in fake._objects:
                        obj, code = fake._objects[u.path], 200
                    else:
                        obj, code = _status(404, "NotFound", f'"{parts[-1]}" not found'), 404
                self._json(code, obj)

            def _list(self, node: str | None) -> None:
                with fake._cond:
                    fake.requests.append("list")
                    items = [p for p in fake._pods.values() if node is None or p["spec"]["nodeName"] == node]
                    body = {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(fake._rv)},
                        "items": json.loads(json.dumps(items)),
                    }
                self._json(200, body)

            def _watch(self, node: str | None, q: dict[str, str]) -> None:
                with fake._cond:
                    fake.requests.append("watch")
                    since = int(q.get("resourceVersion") or 0)
                    epoch = fake._epoch
                    gone = since and since < fake._compacted
                if gone and fake.gone_as_http:
                    self._json(
                        410, _status(410, "Gone", f"too old resource version: {since} ({fake._compacted})")
                    )
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if gone:
                    self._chunk(
                        {
                            "type": "ERROR",
                            "object": _status(
                                410, "Expired", f"too old resource version: {since} ({fake._compacted})"
                            ),
                        }
                    )
                    self.wfile.write(b"0\r\n\r\n")
                    return
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
                sent = since
                try:
                    while True:
                        with fake._cond:
                            todo = [e for e in fake._events if e[0] > sent]
                            while (
                                not todo
                                and fake._epoch == epoch
                                and not fake._down
                                and time.monotonic() < deadline
                            ):
                                fake._cond.wait(0.05)
                                todo = [e for e in fake._events if e[0] > sent]
                            ended = fake._epoch != epoch or fake._down or time.monotonic() >= deadline
                            rv_now = fake._rv
                        for rv, etype, obj in todo:
                            sent = rv
                            if node is None or obj["spec"]["nodeName"] == node:
                                self._chunk({"type": etype, "object": obj})
                        if ended and not todo:
                            if q.get("allowWatchBookmarks") == "true":
                                self._chunk(
                                    {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                     "metadata": {"resourceVersion": str(rv_now)}}}
                                )  # fmt: skip
                            self.wfile.write(b"0\r\n\r\n")
                            return
                except OSError:
                    return  # the client went away

            def log_message(self, format: str, *args: Any) -> None:
                return

        return Handler

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> FakePodApi:
        with self._cond:
            self._down = False
        server = ThreadingHTTPServer(("127.0.0.1", self._port), self._handler())
        server.daemon_threads = True
        self._port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """The API server goes away: open watches end, new connections are refused."""
        if self._server is not None:
            with self._cond:
                self._down = True  # also a handler that read the epoch after end_watches() below
            self._server.shutdown()
            self._server.server_close()  # the listener is closed before streams end: reconnects are refused
            self._server = None
            self.end_watches()

    def restart(self) -> None:
        self.start()

    def __enter__(self) -> FakePodApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
