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

TLS and basic auth come from a web-config file in the Prometheus exporter-toolkit format (off
when no file is given)::

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: ca.crt                          # needed to verify client certificates
      min_version: TLS12                              # optional: TLS10..TLS13 (default TLS12)
      max_version: TLS13                              # optional
    http_server_config:
      headers: {X-Frame-Options: deny}               # optional: added to every answer
    basic_auth_users:
      prometheus: $2y$10$...                          # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':')

Relative paths are read relative to the file. ``client_auth_type`` can be ``NoClientCert``
(default), ``VerifyClientCertIfGiven`` or ``RequireAndVerifyClientCert``; ``RequestClientCert``
and ``RequireAnyClientCert`` (accept a client certificate without verifying it) are rejected,
since Python's ssl module cannot do that. Any other key is a startup error, so a typo never
silently leaves the endpoint open. Basic auth needs the ``bcrypt`` package; checked passwords are
cached (keyed by a SHA-256 of user and password) so a scrape does not pay bcrypt's cost, and an
unknown user costs one bcrypt check like a known one. ``/healthz`` stays open (a kubelet probe
has no password); ``open_paths`` changes that.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import socket
import ssl
import struct
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from consumers.metrics.store import SeriesStore
from gpupipe.errors import ConfigError

log = logging.getLogger("gpupipe.metrics.http")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PORT = 9400  # dcgm-exporter's
HealthCheck = Callable[[], "bool | tuple[bool, Mapping[str, Any]]"]

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}


# -- web config ----------------------------------------------------------------------------------
@dataclass
class WebConfig:
    """What a web-config file asks for: a server TLS context, basic-auth users, extra headers."""

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)
    source: str = "<none>"


def load_web_config(path: str | Path) -> WebConfig:
    """Read an exporter-toolkit web-config YAML file; :class:`ConfigError` says what is wrong."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"web config {p}: {exc}") from exc
    return parse_web_config(doc, base_dir=p.parent, source=str(p))


def parse_web_config(
    doc: Mapping[str, Any], *, base_dir: Path = Path("."), source: str = "<dict>"
) -> WebConfig:
    if not isinstance(doc, Mapping):
        raise ConfigError(f"web config {source}: expected a mapping at the top level")
    unknown = set(doc) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(f"web config {source}: unsupported key(s) {', '.join(sorted(unknown))}")
    cfg = WebConfig(source=source)
    tls = doc.get("tls_server_config")
    if tls:
        cfg.ssl_context = _tls_context(tls, base_dir, source)
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, Mapping):
        raise ConfigError(f"web config {source}: basic_auth_users must map user names to bcrypt hashes")
    for user, hashed in users.items():
        h = str(hashed).encode()
        if not h.startswith((b"$2a$", b"$2b$", b"$2y$")):
            raise ConfigError(f"web config {source}: the password of {user!r} is not a bcrypt hash")
        cfg.users[str(user)] = h
    if cfg.users:
        try:
            import bcrypt  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"web config {source}: basic_auth_users needs the 'bcrypt' package") from exc
    http_cfg = doc.get("http_server_config") or {}
    if not isinstance(http_cfg, Mapping) or set(http_cfg) - {"headers", "http2"}:
        raise ConfigError(f"web config {source}: http_server_config supports only 'headers' (and 'http2')")
    cfg.headers = {str(k): str(v) for k, v in (http_cfg.get("headers") or {}).items()}
    return cfg


def _tls_context(tls: Any, base_dir: Path, source: str) -> ssl.SSLContext:
    if not isinstance(tls, Mapping):
        raise ConfigError(f"web config {source}: tls_server_config must be a mapping")
    unknown = set(tls) - _TLS_KEYS
    if unknown:
        raise ConfigError(
            f"web config {source}: unsupported tls_server_config key(s) {', '.join(sorted(unknown))}"
        )
    if not tls.get("cert_file") or not tls.get("key_file"):
        raise ConfigError(f"web config {source}: tls_server_config needs cert_file and key_file")
    auth = tls.get("client_auth_type") or "NoClientCert"
    if auth not in _CLIENT_AUTH:
        raise ConfigError(
            f"web config {source}: client_auth_type {auth!r} not supported (use {', '.join(_CLIENT_AUTH)})"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.minimum_version = _TLS_VERSIONS[tls.get("min_version") or "TLS12"]
        if tls.get("max_version"):
            ctx.maximum_version = _TLS_VERSIONS[tls["max_version"]]
    except KeyError as exc:
        raise ConfigError(
            f"web config {source}: unknown TLS version {exc} (use {', '.join(_TLS_VERSIONS)})"
        ) from exc

    def path(key: str) -> str:
        return str((base_dir / str(tls[key])).resolve())

    try:
        ctx.load_cert_chain(path("cert_file"), path("key_file"))
        ctx.verify_mode = _CLIENT_AUTH[auth]
        if auth != "NoClientCert":
            if not tls.get("client_ca_file"):
                raise ConfigError(f"web config {source}: client_auth_type {auth} needs client_ca_file")
            ctx.load_verify_locations(cafile=path("client_ca_file"))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"web config {source}: cannot load TLS files: {exc}") from exc
    return ctx


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


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, OS unknown


def _deflate(data: bytes, level: int, final: bool) -> bytes:
    """Raw deflate blocks of ``data``; not final: ended by a sync flush (byte-aligned, more may follow)."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


class GzipCache:
    """gzip of ``[body, tail]`` as one member, reusing the body's deflate blocks while the body is
    the same object (the store hands out the same ``bytes`` until it changes)."""

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self.hits = 0  # answers that reused the cached body blocks
        self._lock = threading.Lock()
        self._body: tuple[bytes, bytes, int] | None = None  # (body object, its deflate blocks, CRC-32)

    def compress(self, parts: list[bytes]) -> list[bytes]:
        body, tail = parts
        with self._lock:
            cached = self._body
            if cached is not None and cached[0] is body:
                self.hits += 1
        if cached is not None and cached[0] is body:
            _, blocks, crc = cached
        else:
            blocks, crc = _deflate(body, self.level, final=False), zlib.crc32(body)
            with self._lock:
                self._body = (body, blocks, crc)
        size = (len(body) + len(tail)) & 0xFFFFFFFF
        trailer = struct.pack("<II", zlib.crc32(tail, crc), size)
        return [_GZIP_HEADER, blocks, _deflate(tail, self.level, final=True), trailer]


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
        open_paths: frozenset[str] = frozenset({"/healthz"}),
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
        if ":" in address[0]:  # "::" or another IPv6 address
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

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


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    server_version = "gpupipe-metrics"

    def setup(self) -> None:
        self.request.settimeout(self.server.request_timeout_s)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics HTTP %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        srv = self.server
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
            self.wfile.write(p)


def make_metrics_server(
    store: SeriesStore,
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    *,
    health: HealthCheck | None = None,
    web_config: WebConfig | str | Path | None = None,
    gzip_level: int = 1,
    open_paths: frozenset[str] = frozenset({"/healthz"}),
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
