"""HTTP endpoint of the metrics consumer: ``/metrics``, ``/healthz`` (thin I/O adapter).

:func:`make_metrics_server` builds a threaded ``http.server`` serving a :class:`SeriesStore`:

* ``GET /metrics``: the store's exposition, ``text/plain; version=0.0.4``. With
  ``Accept-Encoding: gzip`` the answer is one gzip member whose deflate stream is made of two
  parts: the GPU families, compressed once per store version and reused by every scrape until the
  store changes (ended with a sync flush, so it stops on a byte boundary without the final-block
  bit), then the small rest (sample ages, the service's own metrics) compressed per scrape and
  finished; the trailer's CRC-32 continues over both. A deflate stream is just a series of blocks,
  so any decoder reads it (curl and wget stop after the first member of a multi-member gzip, which
  is why this is one member).
* ``GET /healthz``: 200 and a small JSON (``{"status": "ok", ...}``) while the ``health`` callable
  says healthy, else 503 (``{"status": "unhealthy", ...}``). The callable returns a bool, or
  ``(bool, details)`` where ``details`` is a JSON-able mapping merged into the answer; no
  callable: always healthy.
* ``GET /``: a one-line HTML index.

* ``GET /health``: ``OK``, as dcgm-exporter answers it (its Helm chart's probes use it).

TLS, basic auth, extra headers and a request rate limit come from an exporter-toolkit web-config
file (off when no file is given); see :mod:`consumers.metrics.webconfig` for the schema. Basic auth
needs the ``bcrypt`` package; checked passwords are cached (keyed by a SHA-256 of user and password)
so a scrape does not pay bcrypt's cost, and an unknown user costs one bcrypt check like a known one.
``/healthz`` and ``/health`` stay open (a kubelet probe has no password; dcgm-exporter's toolkit
would ask for one there too); ``open_paths`` changes that. With ``rate_limit`` more requests than
allowed get ``429``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import ipaddress
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from consumers.metrics.gzipcache import GzipCache
from consumers.metrics.store import SeriesStore
from consumers.metrics.webconfig import WebConfig, load_web_config, parse_web_config
from gpupipe.errors import ConfigError

log = logging.getLogger("gpupipe.metrics.http")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PORT = 9400  # dcgm-exporter's
HealthCheck = Callable[[], "bool | tuple[bool, Mapping[str, Any]]"]
OPEN_PATHS = frozenset({"/healthz", "/health"})  # probes: no password

__all__ = ["GzipCache", "WebConfig", "load_web_config", "make_metrics_server", "parse_web_config"]


class _Auth:
    """Basic-auth check with bcrypt, remembering outcomes (bounded) so scrapes stay cheap."""

    def __init__(self, users: Mapping[str, bytes], cache_size: int = 1024) -> None:
        import bcrypt

        self._bcrypt = bcrypt
        self._users = dict(users)
        # a dummy hash of the same cost, checked for unknown users: no timing hint about who exists
        first = next(iter(self._users.values()))
        rounds = int(first[4:6]) if first[4:6].isdigit() else 10
        self._dummy = bcrypt.hashpw(b"not-a-password", bcrypt.gensalt(rounds))
        self._cache: dict[bytes, bool] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user_b, _, password = base64.b64decode(header[6:].strip(), validate=True).partition(b":")
            user = user_b.decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        key = hashlib.sha256(user_b + b"\0" + password).digest()
        with self._lock:
            known = self._cache.get(key)
        if known is not None:
            return known
        hashed = self._users.get(user)
        ok = self._bcrypt.checkpw(password, hashed or self._dummy) and hashed is not None
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[key] = ok
        return ok


# -- server --------------------------------------------------------------------------------------
def accepts_gzip(header: str | None) -> bool:
    """True when an Accept-Encoding header allows gzip (``gzip``, ``x-gzip`` or ``*``, q > 0)."""
    if not header:
        return False
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


_WRITE_SLICE = 1 << 20


class MetricsServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` serving a store; TLS handshakes happen in the request threads."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        store: SeriesStore,
        *,
        health: HealthCheck | None = None,
        web_config: WebConfig | None = None,
        gzip_level: int = 1,
        open_paths: frozenset[str] = OPEN_PATHS,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.store = store
        self.health = health
        self.web_config = web_config or WebConfig()
        self.auth = _Auth(self.web_config.users) if self.web_config.users else None
        self.gzip = GzipCache(gzip_level)
        self.open_paths = open_paths
        self.request_timeout_s = request_timeout_s
        self._thread: threading.Thread | None = None
        if address[0] == "":  # Go's ":9400": every address, IPv6 and IPv4 (dual-stack) when possible
            try:
                self.address_family = socket.AF_INET6
                super().__init__(("::", address[1]), _Handler)
                return
            except OSError:
                self.address_family = socket.AF_INET
                address = ("0.0.0.0", address[1])
        if ":" in address[0]:  # "::" or another IPv6 address
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] in ("::", ""):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # also IPv4, as Go
        super().server_bind()

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def scheme(self) -> str:
        return "https" if self.web_config.ssl_context else "http"

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        ctx = self.web_config.ssl_context
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics HTTP: connection from %s failed", client_address, exc_info=True)

    def start(self, poll_interval_s: float = 0.1) -> MetricsServer:
        """Serve in a daemon thread; returns self. ``close()`` takes up to ``poll_interval_s``."""
        self._thread = threading.Thread(
            target=self.serve_forever, args=(poll_interval_s,), name="metrics-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()


def _san_allowed(cert: Mapping[str, Any] | None, allowed: frozenset[str]) -> bool:
    """A verified client certificate with a subjectAltName value in ``allowed`` (any SAN type). IP
    SANs compare in Go's ``net.IP.String()`` form (``2001:db8::1``; Python prints them expanded)."""
    for kind, v in (cert or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            with contextlib.suppress(ValueError):
                v = str(ipaddress.ip_address(v.strip()))
        if v in allowed:
            return True
    return False


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    server_version = "gpupipe-metrics"

    def setup(self) -> None:
        self.request.settimeout(self.server.request_timeout_s)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
            sans = self.server.web_config.allowed_sans
            if sans and not _san_allowed(self.request.getpeercert(), sans):
                raise ssl.SSLError("client certificate SAN not in client_allowed_sans")
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics HTTP %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        srv = self.server
        limiter = srv.web_config.rate_limit
        if limiter is not None and not limiter.allow():
            self._send(429, b"Too Many Requests\n", "text/plain; charset=utf-8")
            return
        needs_auth = srv.auth is not None and path not in srv.open_paths
        if needs_auth and not srv.auth.check(self.headers.get("Authorization")):
            self._send(
                401,
                b"Unauthorized\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Basic realm="gpupipe metrics", charset="UTF-8"'},
            )
            return
        if path == "/metrics":
            self._metrics()
        elif path == "/healthz":
            self._healthz()
        elif path == "/health":  # dcgm-exporter's liveness/readiness endpoint (its Helm probes use it)
            self._send(
                200,
                b"OK",
                "text/plain; charset=utf-8",
                {"X-Content-Type-Options": "nosniff", "X-Registry-Available": "true"},
            )
        elif path == "/":
            self._send(200, b'<html><body><a href="/metrics">/metrics</a></body></html>\n', "text/html")
        else:
            self._send(404, b"Not Found\n", "text/plain; charset=utf-8")

    def _metrics(self) -> None:
        srv = self.server
        parts = srv.store.render_parts()
        headers = {"Vary": "Accept-Encoding"}
        if accepts_gzip(self.headers.get("Accept-Encoding")):
            parts = srv.gzip.compress(parts)
            headers["Content-Encoding"] = "gzip"
        self._send(200, parts, CONTENT_TYPE, headers)

    def _healthz(self) -> None:
        check = self.server.health
        details: Mapping[str, Any] = {}
        try:
            result = True if check is None else check()
            ok, details = result if isinstance(result, tuple) else (bool(result), {})
        except Exception as exc:  # a failing check is an unhealthy service, not a crash
            ok, details = False, {"error": f"{type(exc).__name__}: {exc}"}
        doc = {"status": "ok" if ok else "unhealthy", **details}
        body = (json.dumps(doc, default=str, sort_keys=True) + "\n").encode()
        self._send(200 if ok else 503, body, "application/json")

    def _send(
        self,
        code: int,
        body: bytes | list[bytes],
        content_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = [body] if isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(sum(len(p) for p in parts)))
        for k, v in {**self.server.web_config.headers, **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        for p in parts:
            # in slices: the socket timeout bounds each write, and one write of a whole 80 MB body
            # to a client that reads slowly but steadily would run past it and cut the scrape
            view = memoryview(p)
            for i in range(0, len(view), _WRITE_SLICE):
                self.wfile.write(view[i : i + _WRITE_SLICE])


def make_metrics_server(
    store: SeriesStore,
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    *,
    health: HealthCheck | None = None,
    web_config: WebConfig | str | Path | None = None,
    gzip_level: int = 1,
    open_paths: frozenset[str] = OPEN_PATHS,
) -> MetricsServer:
    """Bind a metrics server (``port=0``: any free port; ``host="::"``: IPv6); ``.start()`` serves it.

    ``web_config``: a :class:`WebConfig`, or the path of an exporter-toolkit web-config file, or
    None (plain HTTP, no auth). ``gzip_level`` 1 keeps a 50 MB exposition's compression in the
    tens of milliseconds; text this repetitive still shrinks about tenfold.
    """
    if isinstance(web_config, str | Path):
        web_config = load_web_config(web_config)
    try:
        return MetricsServer(
            (host, port),
            store,
            health=health,
            web_config=web_config,
            gzip_level=gzip_level,
            open_paths=open_paths,
        )
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
