"""Every service's own `/metrics` (prometheus_client registry) and `/healthz`.

Tiny on purpose: a ThreadingHTTPServer in a daemon thread. The metrics consumer
has its own, faster server for the GPU exposition; this one serves the service's
self-metrics for producers, chargeback and alerts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpupipe.errors import ConfigError

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen expects HOST:PORT, got {text!r}")
    return host or "0.0.0.0", int(port)


class ServiceHttp:
    def __init__(self, listen: str, registry: CollectorRegistry, health: HealthFn) -> None:
        host, port = parse_listen(listen)
        reg, hfn = registry, health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path in ("/healthz", "/health", "/"):
                    ok, detail = hfn()
                    body = json.dumps({"status": "ok" if ok else "unhealthy", **detail}).encode()
                    ctype, code = "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc.strerror}") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> ServiceHttp:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
