"""The one HTTP server every service listens with: TLS, auth, limits and probes said once.

A service registers its routes; the server owns the web config (re-read when its files change),
``/healthz``, ``/readyz``, ``/health`` and ``/``, a start-up mode (503 on every path), HEAD, 401,
429, header deadlines and size limits. A connection holds a worker only while it has something to
say, and connection caps per client and in all keep tricklers from starving the probes.
More (every limit and deadline): docs/architecture.md, "Module notes", ``web/server.py``.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from gpupipe.common.errors import ConfigError
from gpupipe.web.auth import BasicAuth
from gpupipe.web.config import WebConfig, WebConfigSource

log = logging.getLogger("gpupipe.web")

#: Probes have no password (a kubelet probe cannot send one).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})
#: Requests served at once (a worker thread each); connections waiting for a request hold none.
DEFAULT_MAX_CONNECTIONS = 64
#: Connections open at once, idle ones included (a file descriptor each, well under the usual 1024).
DEFAULT_MAX_OPEN_CONNECTIONS = 512
#: Connections open at once from one client address: a quarter, so it takes several to fill them.
DEFAULT_MAX_CLIENT_CONNECTIONS = 128
#: One client address gets at most max_connections // this workers at once (8 of 64).
CLIENT_WORKER_SHARE = 8
DEFAULT_REQUEST_TIMEOUT_S = 30.0
#: Go's http.Server reads headers under ReadHeaderTimeout; the whole head, not each read.
HEADER_DEADLINE_S = 10.0
#: From connect to a finished TLS handshake, apart from request_timeout_s (a slow answer's bound):
#: a handshake takes milliseconds, and a client that sends no ClientHello must not wait 30 s.
HANDSHAKE_DEADLINE_S = 5.0
#: An idle keep-alive connection's wait for its next request (Prometheus scrapes every 15-60 s).
KEEPALIVE_IDLE_S = 120.0
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
        self._nonblocking = False
        self.eof = False

    def pending(self, rfile: io.BufferedReader) -> bool:
        """Whether ``rfile`` (over this reader) has a byte now, without waiting: pipelined
        requests are served at once, an idle connection is parked (and ``eof`` says it is closed)."""
        self._nonblocking = True
        try:
            return bool(rfile.peek(1))
        finally:
            self._nonblocking = False

    def arm(self, deadline_s: float, budget: int) -> None:
        self._deadline = time.monotonic() + deadline_s
        self._budget = budget

    def disarm(self) -> None:
        self._deadline = None
        self._sock.settimeout(self._timeout_s)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        if self._nonblocking:
            self._sock.settimeout(0.0)
            try:
                n = self._sock.recv_into(b)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return None
            finally:
                self._sock.settimeout(self._timeout_s)
            self.eof = n == 0
            return n
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
    """What a service waits for while it starts (:class:`gpupipe.kafka.ready.StartupState`)."""

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


def client_key(address: Any) -> str:
    """The client a connection counts against: its IP address (IPv4 for an IPv4-mapped one). An
    IPv6 address counts alone, not its /64: Kubernetes gives the pods of a node addresses of one
    /64 by default, and a scraper must not share its bounds with another pod on its node."""
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    except (ValueError, TypeError, IndexError):
        return str(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@dataclass(eq=False)
class _Conn:
    """An accepted connection: parked, waiting for a worker, or with one."""

    sock: socket.socket
    address: Any
    client: str
    deadline: float  # parked or waiting: closed past it (monotonic)
    handshaken: bool  # plain connections have none to make
    head_by: float | None = None  # the first request head's deadline, counted from connect


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


class HttpServer(HTTPServer):
    """Serve in a daemon thread (``start()``); ``close()`` releases the port."""

    allow_reuse_address = True
    request_queue_size = DEFAULT_MAX_OPEN_CONNECTIONS  # a flood's burst waits here, not in SYN retries

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
        max_open_connections: int = DEFAULT_MAX_OPEN_CONNECTIONS,
        max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS,
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
        self.max_connections = max_connections
        self.max_open_connections = max_open_connections
        self.max_client_connections = min(max_client_connections, max_open_connections)
        self.client_workers = max(1, max_connections // CLIENT_WORKER_SHARE)
        self.refused_connections = 0  # closed at once: no idle connection to make room
        self.evicted_connections = 0  # idle ones closed to make room
        # the accept loop's own state (only its thread touches it) ...
        self._parked: dict[_Conn, None] = {}  # insertion order: longest idle first
        self._waiting: dict[_Conn, None] = {}  # bytes arrived, no worker yet
        self._open: Counter[str] = Counter()
        self._open_total = 0
        self._busy: Counter[str] = Counter()
        self._busy_total = 0
        self._serving: set[_Conn] = set()  # with a worker
        # ... and what workers hand back to it
        self._returned: list[tuple[_Conn, bool]] = []
        self._returned_lock = threading.Lock()
        self._closed = False  # close() ran: a worker closes its connection itself
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
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

    # -- the accept loop: connections wait in a selector, workers serve requests ----------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        sel = selectors.DefaultSelector()
        self.socket.setblocking(False)
        sel.register(self.socket, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        sweep_at = 0.0
        try:
            while not self._stop.is_set():
                try:
                    sweep_at = self._round(sel, poll_interval, sweep_at)
                except Exception:  # a bug here must not end every probe while the service runs on
                    log.exception("HTTP: the accept loop failed a round; it goes on")
                    time.sleep(poll_interval)
        finally:
            for conn in [*self._parked, *self._waiting]:
                self._close(sel, conn)
            sel.close()
            self._stop.clear()
            self._stopped.set()

    def _round(self, sel: selectors.BaseSelector, poll_interval: float, sweep_at: float) -> float:
        """One round of the accept loop; the next time deadlines are swept."""
        for key, _ in sel.select(poll_interval):
            if key.data == "accept":
                self._accept(sel)
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.data in self._parked:  # it has something to say (not closed meanwhile)
                sel.unregister(key.fileobj)
                del self._parked[key.data]
                # bytes came: the rest of the head is due within the header deadline, not the
                # keep-alive one, so a waiting connection never holds its place for long
                key.data.deadline = min(key.data.deadline, time.monotonic() + HEADER_DEADLINE_S)
                self._waiting[key.data] = None
        self._take_back(sel)
        now = time.monotonic()
        if now >= sweep_at:  # deadlines to a tenth of a second are precise enough
            self._expire(sel, now)
            sweep_at = now + 0.1
        self._dispatch(sel)
        return sweep_at

    def shutdown(self) -> None:
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop wakes anyway
            self._wake_w.send(b"\0")

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the next round tries again
                log.warning("HTTP: accept failed: %s", exc)
                return
            self._admit(sel, sock, address)

    def _admit(self, sel: selectors.BaseSelector, sock: socket.socket, address: Any) -> None:
        client = client_key(address)
        full = self._open[client] >= self.max_client_connections
        if full or self._open_total >= self.max_open_connections:
            # make room by closing the longest-idle parked connection (the client's own past its
            # cap), else a waiting one of the client that holds the most (never a smaller one's)
            victim = next((c for c in self._parked if not full or c.client == client), None)
            if victim is None:
                victim = self._greediest_waiting(client, full)
            if victim is None:
                self.refused_connections += 1
                self.shutdown_request(sock)
                return
            self.evicted_connections += 1
            self._close(sel, victim)
        ctx = self.web.current().ssl_context
        try:
            # as Go does: an answer's head and body are separate writes, and Nagle's algorithm
            # would hold the body for the client's delayed ACK (40 ms a keep-alive request)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:  # the handshake happens in a worker, never in this loop
                sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError:
            sock.close()
            return
        first = HANDSHAKE_DEADLINE_S if ctx is not None else HEADER_DEADLINE_S
        deadline = time.monotonic() + first
        conn = _Conn(
            sock, address, client, deadline, handshaken=ctx is None, head_by=None if ctx else deadline
        )
        self._open[client] += 1
        self._open_total += 1
        self._park(sel, conn)

    def _greediest_waiting(self, client: Any, own: bool) -> _Conn | None:
        """A waiting connection to close for a new one of ``client``: its own oldest when ``own``
        (past its cap), else the oldest of the client holding the most connections, if that one
        holds more than ``client`` will. Clients that fill the server with half-sent heads then
        lose connections to a newcomer, a probe included, instead of keeping it out."""
        if own:
            return next((c for c in self._waiting if c.client == client), None)
        counts: Counter[Any] = Counter(c.client for c in self._waiting)
        if not counts:
            return None
        greedy, _ = max(counts.items(), key=lambda kv: self._open[kv[0]])
        if self._open[greedy] <= self._open[client] + 1:
            return None
        return next(c for c in self._waiting if c.client == greedy)

    def _park(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        sel.register(conn.sock, selectors.EVENT_READ, conn)
        self._parked[conn] = None

    def _close(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        if conn in self._parked:
            del self._parked[conn]
            sel.unregister(conn.sock)
        self._waiting.pop(conn, None)
        self._open_total -= 1
        self._open[conn.client] -= 1
        if self._open[conn.client] <= 0:
            del self._open[conn.client]
        self.shutdown_request(conn.sock)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        for conn in [c for c in (*self._parked, *self._waiting) if c.deadline <= now]:
            self._close(sel, conn)

    def _take_back(self, sel: selectors.BaseSelector) -> None:
        with self._returned_lock:
            returned, self._returned = self._returned, []
        for conn, keep in returned:
            self._serving.discard(conn)
            self._busy_total -= 1
            self._busy[conn.client] -= 1
            if self._busy[conn.client] <= 0:
                del self._busy[conn.client]
            if keep:
                conn.deadline = time.monotonic() + KEEPALIVE_IDLE_S
                self._park(sel, conn)
            else:
                self._close(sel, conn)

    def _dispatch(self, selector: selectors.BaseSelector) -> None:
        for conn in list(self._waiting):
            if self._busy_total >= self.max_connections:
                return
            if self._busy[conn.client] >= self.client_workers:
                continue  # it waits for one of its own client's requests to end
            del self._waiting[conn]
            worker = threading.Thread(
                target=self._work, args=(conn,), name=f"{self.service}-http-worker", daemon=True
            )
            try:
                worker.start()
            except RuntimeError:  # no thread to be had: this one is refused, the server goes on
                self.refused_connections += 1
                self._waiting[conn] = None
                self._close(selector, conn)
                return
            self._serving.add(conn)
            self._busy_total += 1
            self._busy[conn.client] += 1

    def _work(self, conn: _Conn) -> None:
        keep = False
        try:
            keep = not _Handler(conn, self).close_connection
        except Exception:
            self.handle_error(conn.sock, conn.address)
        finally:
            with self._returned_lock:
                if self._closed:
                    self.shutdown_request(conn.sock)
                else:
                    self._returned.append((conn, keep))
            self._wake()

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
        with self._returned_lock:
            self._closed = True
            returned, self._returned = self._returned, []
        for conn, _keep in returned:
            self.shutdown_request(conn.sock)
        for conn in list(self._serving):  # wake its worker (a read of a request head, say) to end it
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        self.server_close()
        self._wake_r.close()
        self._wake_w.close()

    stop = close


class _Handler(BaseHTTPRequestHandler):
    """One turn of a connection with a worker: the TLS handshake if not yet made, then its
    requests while they are already there; ``close_connection`` False after it: park it."""

    server: HttpServer
    protocol_version = "HTTP/1.1"
    server_version = "gpupipe"

    def __init__(self, conn: _Conn, server: HttpServer) -> None:
        self.conn = conn
        super().__init__(conn.sock, conn.address, server)  # type: ignore[arg-type]

    def setup(self) -> None:
        sock, conn = self.request, self.conn
        if not conn.handshaken:
            left = conn.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("TLS handshake not made in time")
            sock.settimeout(left)
            sock.do_handshake()
            sans = self.server.web.current().allowed_sans
            if sans and not san_allowed(sock.getpeercert(), sans):
                raise ssl.SSLError("client certificate SAN not in client_allowed_sans")
            conn.handshaken = True
        sock.settimeout(self.server.request_timeout_s)
        super().setup()
        self._reader = _DeadlineReader(sock, self.server.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            try:
                if not self._reader.pending(self.rfile):
                    self.close_connection = self._reader.eof
                    return  # idle: parked until the next request arrives
            except OSError:
                self.close_connection = True
                return
            self.handle_one_request()

    def handle_one_request(self) -> None:
        # a plain connection's first head counts from connect (its wait for a worker included);
        # after a TLS handshake, or between keep-alive requests, from now
        head_by, self.conn.head_by = self.conn.head_by, None
        left = HEADER_DEADLINE_S if head_by is None else head_by - time.monotonic()
        self._reader.arm(left, MAX_HEADER_BYTES)
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
        # probes never meet the rate limit, and only requests that passed authentication spend it
        # (a flood without the password must not leave the scraper, or a probe, a 429)
        if path in srv.open_paths:
            pass
        elif auth is not None and not auth.check(
            self.headers.get("Authorization"), client_key(self.client_address)
        ):
            return Response(
                401,
                b"Unauthorized\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Basic realm="gpupipe", charset="UTF-8"'},
            )
        elif cfg.rate_limit is not None and not cfg.rate_limit.allow():
            return Response(429, b"Too Many Requests\n", "text/plain; charset=utf-8")
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
