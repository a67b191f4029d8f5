"""A webhook receiver for a real Alertmanager: it records every notification, as a pager would get it.

Alertmanager posts one JSON body per notification of an aggregation group (``status``, ``receiver``,
``alerts`` with their own ``status`` and ``labels``). The receiver keeps them in arrival order, with
the path it was posted to, so a test asserts what each receiver was told and when: a page, a second
page, a RESOLVED.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Notification:
    path: str
    received_s: float  # time.monotonic() on arrival
    body: dict[str, Any]

    def alerts(self, status: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.body.get("alerts", ()) if status is None or a["status"] == status]


class WebhookReceiver:
    """HTTP server on 127.0.0.1 that records Alertmanager's webhook posts; a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._got: list[Notification] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                with receiver._lock:
                    receiver._got.append(Notification(self.path, time.monotonic(), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="am-webhook", daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def notifications(self, path: str | None = None) -> list[Notification]:
        with self._lock:
            return [n for n in self._got if path is None or n.path == path]

    def wait_for(
        self, pred: Callable[[list[Notification]], bool], timeout_s: float, what: str
    ) -> list[Notification]:
        """Wait until ``pred`` holds for the notifications so far; return them."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.notifications()
            if pred(got):
                return got
            if time.monotonic() > deadline:
                lines = "\n".join(f"  {n.path} {n.body.get('status')} {_brief(n)}" for n in got)
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; received:\n{lines}")
            time.sleep(0.05)


def _brief(n: Notification) -> str:
    parts = []
    for a in n.alerts():
        lab = a["labels"]
        parts.append(f"{a['status']}:{lab.get('alertname')}/{lab.get('severity')}/{lab.get('xid', '')}")
    return ", ".join(parts)
