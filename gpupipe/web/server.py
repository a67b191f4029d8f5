"""The one HTTP server every service listens with: TLS, auth, limits and probes said once.

node_exporter serves every endpoint through one ``web.ListenAndServe``, so TLS, client-certificate
SANs, rate limit and basic auth cannot differ between endpoints; this is that for gpupipe. A
service registers its routes (paths to callables); the server owns the rest:

* the exporter-toolkit web config (:mod:`gpupipe.web.config`), re-read when its files change;
* ``/healthz`` (liveness, JSON), ``/readyz`` (readiness, JSON, the liveness check unless the
  service gives its own), ``/health`` (``OK``, as dcgm-exporter answers it) and ``/``, all open to
  probes without a password unless ``open_paths`` says otherwise (``/`` lists the routes and asks
  for the password like them);
* a start-up mode: while the service waits for Kafka every path answers 503
  ``{"status": "starting", ...}`` on the same port, with the same TLS and auth;
* HEAD for every GET path; 429 past the rate limit; 401 without the password;
* at most ``max_connections`` connections served at once (each one a thread); more are closed at
  once instead of queueing threads without bound;
* a request's line and headers must arrive within ``HEADER_DEADLINE_S`` in all (a client sending a
  byte every few seconds holds a slot that long, not for ever) and weigh at most
  ``MAX_HEADER_BYTES`` (431 past it); no endpoint takes a body (413).
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from gpupipe.errors import ConfigError
from gpupipe.web.auth import BasicAuth
from gpupipe.web.config import WebConfig, WebConfigSource

log = logging.getLogger("gpupipe.web")

#: Probes have no password (a kubelet probe cannot send one).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_REQUEST_TIMEOUT_S = 30.0
#: Go's http.Server reads headers under ReadHeaderTimeout; the whole head, not each read.
HEADER_DEADLINE_S = 10.0
MAX_HEADER_BYTES = 64 * 1024
_WRITE_SLICE = 1 << 20


class _HeadTooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, under one deadline and byte budget per request head (see
    :meth:`arm`); a read past the deadline times out, one past the budget raises."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._budget = 0

    def arm(self, deadline_s: float, budget: int) -> None:
        self._deadline = time.monotonic() + deadline_s
        self._budget = budget

    def disarm(self) -> None:
        self._deadline = None
        self._sock.settimeout(self._timeout_s)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request head not received in time")
            self._sock.settimeout(min(left, self._timeout_s))
        n = self._sock.recv_into(b)
        if self._deadline is not None:
            self._budget -= n
            if self._budget < 0:
                raise _HeadTooLarge
        return n


HealthCheck = Callable[[], "bool | tuple[bool, Mapping[str, Any]]"]


@dataclass
class Response:
    code: int
    body: bytes | list[bytes]
    content_type: str
    headers: Mapping[str, str] = field(default_factory=dict)


class Route(Protocol):
    def __call__(self, headers: Message) -> Response: ...


class Starting(Protocol):
    """What a service waits for while it starts (:class:`gpupipe.startup.StartupState`)."""

    def as_dict(self) -> dict[str, Any]: ...


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as Go reads it: ``:9400`` (all addresses), ``[::]:9400``, ``[::1]:9400``,
    ``0.0.0.0:9400``. Returns ``("", port)`` for "all addresses" (dual-stack when possible)."""
    s = text.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"--listen expects [IPV6]:PORT, got {text!r}")
        port = rest[1:]
    else:
        host, sep, port = s.rpartition(":")
        if not sep:
            raise ConfigError(f"--listen expects HOST:PORT, got {text!r}")
        if ":" in host:
            raise ConfigError(f"--listen: put an IPv6 address in brackets, e.g. [::]:9400, got {text!r}")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen: bad port in {text!r}")
    return host, int(port)


def san_allowed(cert: Mapping[str, Any] | None, allowed: frozenset[str]) -> bool:
    """A verified client certificate with a subjectAltName value in ``allowed`` (any SAN type). IP
    SANs compare in Go's ``net.IP.String()`` form (``2001:db8::1``; Python prints them expanded)."""
    for kind, v in (cert or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            with contextlib.suppress(ValueError):
                v = str(ipaddress.ip_address(v.strip()))
        if v in allowed:
            return True
    return False


def _run_check(check: HealthCheck | None) -> tuple[bool, Mapping[str, Any]]:
    try:
        result = True if check is None else check()
        return result if isinstance(result, tuple) else (bool(result), {})
    except Exception as exc:  # a failing check is an unhealthy service, not a crashed server
        return False, {"error": f"{type(exc).__name__}: {exc}"}


def registry_route(registry: Any) -> Route:
    """``/metrics`` of a prometheus_client registry (a service's own metrics)."""
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    def route(headers: Message) -> Response:
        return Response(200, generate_latest(registry), CONTENT_TYPE_LATEST)

    return route


def json_response(code: int, doc: Mapping[str, Any]) -> Response:
    body = (json.dumps(doc, default=str, sort_keys=True) + "\n").encode()
    return Response(code, body, "application/json")


class HttpServer(ThreadingHTTPServer):
    """Serve in a daemon thread (``start()``); ``close()`` releases the port."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        listen: str | tuple[str, int],
        web: WebConfigSource | WebConfig | str | Path | None = None,
        *,
        service: str = "gpupipe",
        routes: Mapping[str, Route] | None = None,
        health: HealthCheck | None = None,
        ready: HealthCheck | None = None,
        starting: Starting | None = None,
        open_paths: frozenset[str] = OPEN_PATHS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        host, port = parse_listen(listen) if isinstance(listen, str) else listen
        self.web = WebConfigSource.of(web)
        self.service = service
        self.routes: dict[str, Route] = dict(routes or {})
        self.health = health
        self.ready = ready
        self.starting = starting
        self.open_paths = open_paths
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused_connections = 0
        self._auth: tuple[WebConfig, BasicAuth | None] | None = None
        self._thread: threading.Thread | None = None
        try:
            self._bind(host, port)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc

    def _bind(self, host: str, port: int) -> None:
        if host == "":  # Go's ":9400": every address, IPv6 and IPv4 (dual-stack) when possible
            try:
                self.address_family = socket.AF_INET6
                super().__init__(("::", port), _Handler)
                return
            except OSError:
                host = "0.0.0.0"
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] in ("::", ""):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # also IPv4, as Go
        super().server_bind()

    # -- what a service changes while it runs ---------------------------------------------------
    def serve(
        self,
        routes: Mapping[str, Route] | None = None,
        *,
        health: HealthCheck | None = None,
        ready: HealthCheck | None = None,
    ) -> None:
        """Leave the start-up mode: from now on the service's own routes and checks answer."""
        if routes is not None:
            self.routes.update(routes)
        if health is not None:
            self.health = health
        if ready is not None:
            self.ready = ready
        self.starting = None

    def auth(self) -> tuple[WebConfig, BasicAuth | None]:
        cfg = self.web.current()
        pair = self._auth
        if pair is None or pair[0] is not cfg:
            pair = (cfg, BasicAuth(cfg.users) if cfg.users else None)
            self._auth = pair
        return pair

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def scheme(self) -> str:
        return "https" if self.web.current().ssl_context else "http"

    # -- socket plumbing ------------------------------------------------------------------------
    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        ctx = self.web.current().ssl_context
        if ctx is not None:  # the handshake happens in the request thread, never in the accept loop
            sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("HTTP: connection from %s failed", client_address, exc_info=True)

    def start(self, poll_interval_s: float = 0.1) -> HttpServer:
        self._thread = threading.Thread(
            target=self.serve_forever, args=(poll_interval_s,), name=f"{self.service}-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()

    stop = close


class _Handler(BaseHTTPRequestHandler):
    server: HttpServer
    protocol_version = "HTTP/1.1"
    server_version = "gpupipe"

    def setup(self) -> None:
        self.request.settimeout(self.server.request_timeout_s)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
            sans = self.server.web.current().allowed_sans
            if sans and not san_allowed(self.request.getpeercert(), sans):
                raise ssl.SSLError("client certificate SAN not in client_allowed_sans")
        super().setup()
        self._reader = _DeadlineReader(self.request, self.server.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.arm(HEADER_DEADLINE_S, MAX_HEADER_BYTES)
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self.close_connection = True
            self.request_version, self.requestline = "HTTP/1.1", "(head too large)"
            with contextlib.suppress(OSError):
                self._send(
                    Response(431, b"Request Header Fields Too Large\n", "text/plain; charset=utf-8"),
                    head=False,
                )

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._reader.disarm()  # the head is in: answering is bounded by the write timeout
        length = (self.headers.get("Content-Length") or "0").strip() if ok else "0"
        if ok and (length != "0" or self.headers.get("Transfer-Encoding")):
            self.close_connection = True
            self._send(
                Response(413, b"No endpoint takes a request body\n", "text/plain; charset=utf-8"), head=False
            )
            return False
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("HTTP %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._send(self._answer(), head=False)

    def do_HEAD(self) -> None:
        self._send(self._answer(), head=True)

    def _answer(self) -> Response:
        srv = self.server
        path = urlsplit(self.path).path
        cfg, auth = srv.auth()
        if cfg.rate_limit is not None and not cfg.rate_limit.allow():
            return Response(429, b"Too Many Requests\n", "text/plain; charset=utf-8")
        if (
            auth is not None
            and path not in srv.open_paths
            and not auth.check(self.headers.get("Authorization"))
        ):
            return Response(
                401,
                b"Unauthorized\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Basic realm="gpupipe", charset="UTF-8"'},
            )
        starting = srv.starting
        if starting is not None:
            return json_response(503, {"status": "starting", "service": srv.service, **starting.as_dict()})
        if path in ("/healthz", "/readyz"):
            check = srv.ready if path == "/readyz" and srv.ready is not None else srv.health
            ok, details = _run_check(check)
            return json_response(200 if ok else 503, {"status": "ok" if ok else "unhealthy", **details})
        if path == "/health":  # dcgm-exporter's probe endpoint (its Helm chart's probes use it)
            return Response(
                200,
                b"OK",
                "text/plain; charset=utf-8",
                {"X-Content-Type-Options": "nosniff", "X-Registry-Available": "true"},
            )
        route = srv.routes.get(path)
        if route is not None:
            return route(self.headers)
        if path == "/":
            links = "".join(f'<a href="{p}">{p}</a><br>' for p in sorted(srv.routes))
            return Response(200, f"<html><body>{links}</body></html>\n".encode(), "text/html")
        return Response(404, b"Not Found\n", "text/plain; charset=utf-8")

    def _send(self, r: Response, *, head: bool) -> None:
        parts = [r.body] if isinstance(r.body, bytes) else r.body
        self.send_response(r.code)
        self.send_header("Content-Type", r.content_type)
        self.send_header("Content-Length", str(sum(len(p) for p in parts)))
        for k, v in {**self.server.web.current().headers, **r.headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        for p in parts:
            # in slices: the socket timeout bounds each write, and one write of a whole 80 MB body
            # to a client that reads slowly but steadily would run past it and cut the scrape
            view = memoryview(p)
            for i in range(0, len(view), _WRITE_SLICE):
                self.wfile.write(view[i : i + _WRITE_SLICE])
