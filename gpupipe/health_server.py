"""Every service's own `/metrics` (prometheus_client registry) and `/healthz`.

Tiny on purpose: a ThreadingHTTPServer in a daemon thread. The metrics consumer
has its own, faster server for the GPU exposition; this one serves the service's
self-metrics for producers, chargeback and alerts. It takes the same exporter-toolkit
web-config file (`--web-config-file`: TLS, basic auth, headers) as the metrics service, parsed
by the same code (consumers.metrics.http), so every /metrics of the pipeline is secured alike;
`/healthz` (liveness) and `/readyz` (readiness; the same check unless the service gives its own,
e.g. the node agent while it has released NVML on request) stay open for probes.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpupipe.errors import ConfigError

if TYPE_CHECKING:
    from consumers.metrics.http import WebConfig

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``; an IPv6 host in brackets (``[::]:9400``, as Go writes it) loses them; an empty
    host (``:9400``) is every IPv4 address."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen expects HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


def server_class(
    host: str, base: type[ThreadingHTTPServer] = ThreadingHTTPServer
) -> type[ThreadingHTTPServer]:
    """``base``, or its IPv6 variant for an IPv6 host (the stdlib server is IPv4 unless told)."""
    if ":" not in host:
        return base
    return type(base.__name__ + "6", (base,), {"address_family": socket.AF_INET6})


class _Server(ThreadingHTTPServer):
    """Wraps accepted sockets in TLS when the web config asks for it (handshake in the request thread)."""

    ssl_context: ssl.SSLContext | None = None

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a failed TLS handshake or a dropped scrape is the client's problem


class ServiceHttp:
    def __init__(
        self,
        listen: str,
        registry: CollectorRegistry,
        health: HealthFn,
        web_config: str | Path | WebConfig | None = None,
        *,
        ready: HealthFn | None = None,
    ) -> None:
        from consumers.metrics.http import WebConfig, _Auth, load_web_config

        host, port = parse_listen(listen)
        reg, hfn = registry, health
        rfn = ready or health
        wc = load_web_config(web_config) if isinstance(web_config, str | Path) else web_config or WebConfig()
        auth = _Auth(wc.users) if wc.users else None

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                self.request.settimeout(30)
                if isinstance(self.request, ssl.SSLSocket):
                    self.request.do_handshake()
                super().setup()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if (
                    auth is not None
                    and path not in ("/healthz", "/health", "/readyz")
                    and not auth.check(self.headers.get("Authorization"))
                ):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="gpupipe", charset="UTF-8"')
                    self.send_header("Content-Length", "13")
                    self.end_headers()
                    self.wfile.write(b"Unauthorized\n")
                    return
                if path == "/metrics":
                    body, ctype, code = generate_latest(reg), CONTENT_TYPE_LATEST, 200
                elif path in ("/healthz", "/health", "/", "/readyz"):
                    ok, detail = (rfn if path == "/readyz" else hfn)()
                    body = json.dumps({"status": "ok" if ok else "unhealthy", **detail}).encode()
                    ctype, code = "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in wc.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        try:
            self._server = server_class(host, _Server)((host, port), Handler)  # type: ignore[assignment]
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc.strerror}") from exc
        self._server.daemon_threads = True
        self._server.ssl_context = wc.ssl_context
        self.scheme = "https" if wc.ssl_context else "http"
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
