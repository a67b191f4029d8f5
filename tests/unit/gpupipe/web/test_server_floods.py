"""gpupipe.web.server under floods: probes and scrapes keep answering.

Each test is one flood scaled down: a server with 4 request
workers (``max_connections=4``) and three times as many hostile connections, or a small rate-limit
burst. Clients at other addresses use other loopback addresses (127.0.0.2, ...), which Linux
routes to 127.0.0.1 like any loopback address.
"""

from __future__ import annotations

import base64
import contextlib
import http.client as http_client
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry

from gpupipe.web import auth as auth_mod
from gpupipe.web import server as server_mod
from gpupipe.web.server import HttpServer, client_key, registry_route
from tests.agent_harness import wait_for
from tests.pki import Pki

WORKERS = 4
HOGS = 3 * WORKERS


def serve(web: Path | None = None, **kw: object) -> HttpServer:
    routes = {"/metrics": registry_route(CollectorRegistry())}
    return HttpServer("127.0.0.1:0", web, routes=routes, health=lambda: (True, {}), **kw)  # type: ignore[arg-type]


def get(
    port: int,
    path: str = "/healthz",
    *,
    src: str = "127.0.0.1",
    ctx: ssl.SSLContext | None = None,
    auth: str | None = None,
) -> int | str:
    """The status code, or the name of what went wrong instead (a refused probe is an outcome)."""
    conn: http_client.HTTPConnection
    if ctx is None:
        conn = http_client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(src, 0))
    else:
        conn = http_client.HTTPSConnection(
            "127.0.0.1", port, timeout=10, source_address=(src, 0), context=ctx
        )
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        with conn.getresponse() as r:
            r.read()
            return r.status
    except (OSError, http_client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


@contextlib.contextmanager
def connections(
    port: int, n: int, *, src: str = "127.0.0.1", send: bytes = b"", answered: bool = True
) -> Iterator[list[socket.socket]]:
    """``n`` connections that send ``send`` (and read its answer where ``answered``), then say
    nothing more."""
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(src, 0))
            socks.append(s)
            if send:
                s.sendall(send)
            if send and answered:
                with contextlib.suppress(OSError):
                    s.recv(4096)  # the answer, or b"" where the server closed it at once
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closes ``s`` within its 10 s timeout (what it still had to say, read)."""
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    p = Pki(tmp_path)
    p.server()
    p.client("prometheus.scrape")
    return p


def _mtls_web(pki: Pki) -> Path:
    web = pki.dir / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: ca.crt\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_allowed_sans: [prometheus.scrape]\n"
    )
    return web


def _client_ctx(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.dir / "prometheus.scrape.crt"), str(pki.dir / "prometheus.scrape.key"))
    return ctx


# -- connection floods ---------------------------------------------------------------------
def test_idle_keep_alive_connections_do_not_starve_the_probes() -> None:
    with contextlib.closing(serve(max_connections=WORKERS).start()) as http:
        # the review's http_slots.py: keep-alive connections that each asked once and now wait
        with connections(http.port, HOGS, send=b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"):
            probes = [get(http.port) for _ in range(5)]
            scrape = get(http.port, "/metrics")
        assert probes == [200] * 5
        assert scrape == 200


def test_silent_tls_connections_do_not_starve_a_probe_with_a_good_certificate(pki: Pki) -> None:
    with contextlib.closing(serve(_mtls_web(pki), max_connections=WORKERS).start()) as http:
        # the review's tls_idle_slots.py: TCP connections that never send a ClientHello
        with connections(http.port, HOGS):
            probes = [get(http.port, ctx=_client_ctx(pki)) for _ in range(5)]
        assert probes == [200] * 5


def test_a_silent_tls_connection_is_closed_at_the_handshake_deadline(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_mod, "HANDSHAKE_DEADLINE_S", 0.5)
    with contextlib.closing(serve(_mtls_web(pki)).start()) as http, connections(http.port, 1) as (silent,):
        assert closed_by_server(silent), "held past the handshake deadline"
        assert get(http.port, ctx=_client_ctx(pki)) == 200


def test_an_idle_keep_alive_connection_is_closed_at_the_idle_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_mod, "KEEPALIVE_IDLE_S", 0.5)
    ask = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with contextlib.closing(serve().start()) as http, connections(http.port, 1, send=ask) as (idle,):
        assert closed_by_server(idle)


def test_a_client_trickling_request_heads_holds_only_its_share_of_the_workers() -> None:
    with contextlib.closing(serve(max_connections=WORKERS).start()) as http:
        # each connection sent part of a head: a worker waits for the rest (up to 10 s)
        with connections(http.port, HOGS, src="127.0.0.2", send=b"GET /metrics HTTP/1.1\r\n", answered=False):
            probes = [get(http.port) for _ in range(5)]
        assert probes == [200] * 5
        assert http.client_workers == 1  # 4 // CLIENT_WORKER_SHARE, at least one


def test_one_client_holds_at_most_its_share_and_a_full_server_still_admits_a_probe() -> None:
    http = serve(max_open_connections=6, max_client_connections=3).start()
    with contextlib.closing(http):
        with connections(http.port, 5, src="127.0.0.2") as mine:
            # past its share a client's newest connections push out its own oldest idle ones
            assert [closed_by_server(s) for s in mine[:2]] == [True, True]
            with connections(http.port, 3, src="127.0.0.3"):
                # every open connection taken: the longest idle one makes room for the probe
                assert get(http.port) == 200
        assert http.evicted_connections >= 3


def test_clients_filling_the_server_with_half_sent_heads_do_not_keep_a_probe_out() -> None:
    # Connections that sent part of a head wait for a worker; with every open connection such a
    # one, none was parked to evict and every new connection, the probe's, was refused.
    http = serve(max_connections=4, max_open_connections=8, max_client_connections=4).start()
    with contextlib.closing(http):
        with (
            connections(http.port, 4, src="127.0.0.2", send=b"GET /metrics HTTP/1.1\r\n", answered=False),
            connections(http.port, 4, src="127.0.0.3", send=b"GET /metrics HTTP/1.1\r\n", answered=False),
        ):
            wait_for(lambda: http._busy_total + len(http._waiting) == 8, 10, "all eight waiting or served")
            for _ in range(3):
                assert get(http.port) == 200
                # the probe's closed connection still counts for its address until the server reads
                # its end: the next probe comes once it is gone, as a prober's next period would
                wait_for(lambda: "127.0.0.1" not in http._open, 10, "the probe's connection reaped")
        assert http.evicted_connections >= 1


def test_the_client_a_connection_counts_against() -> None:
    assert client_key(("10.0.0.7", 5000)) == "10.0.0.7"
    assert client_key(("::ffff:10.0.0.7", 5000, 0, 0)) == "10.0.0.7"  # dual-stack socket, IPv4 client
    assert client_key(("fd00::1:2", 5000, 0, 0)) == "fd00::1:2"
    assert client_key(("fe80::1%eth0", 5000, 0, 2)) == "fe80::1"


# -- the rate limit ------------------------------------------------------------------------
def test_unauthenticated_requests_do_not_spend_the_rate_limit_and_probes_are_not_limited(
    tmp_path: Path,
) -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"rate_limit:\n  interval: 1h\n  burst: 3\nbasic_auth_users:\n  prometheus: '{hashed}'\n")
    with contextlib.closing(serve(web).start()) as http:
        # the review's http_ratelimit_probe.py: a flood without a password
        assert [get(http.port, "/metrics") for _ in range(10)] == [401] * 10
        assert [get(http.port, "/healthz") for _ in range(10)] == [200] * 10
        scrapes = [get(http.port, "/metrics", auth="prometheus:pw") for _ in range(4)]
        assert scrapes == [200, 200, 200, 429]  # the bucket is for those who may scrape


# -- wrong passwords ----------------------------------------------------------------------
def test_wrong_passwords_cost_a_bounded_number_of_bcrypt_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed = {
        u: bcrypt.hashpw(p, bcrypt.gensalt(rounds=4)).decode()
        for u, p in (("prom", b"pw"), ("prom2", b"pw2"))
    }
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in hashed.items()))
    checks = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: checks.append(pw) or real(pw, h))
    with contextlib.closing(serve(web).start()) as http:
        assert get(http.port, "/metrics", auth="prom:pw") == 200
        checks.clear()
        t0 = time.monotonic()
        # the review's bcrypt_flood.py: distinct wrong passwords, each a cache miss
        flood = [get(http.port, "/metrics", auth=f"prom:wrong-{i}") for i in range(60)]
        elapsed = time.monotonic() - t0
        assert set(flood) == {401}
        bound = auth_mod.FAILED_AUTH_BURST + elapsed / auth_mod.FAILED_AUTH_INTERVAL_S + 1
        assert len(checks) <= bound, f"{len(checks)} bcrypt checks for 60 wrong passwords"
        assert get(http.port, "/metrics", auth="prom:pw") == 200  # the good scrape: still cached
        assert len(checks) <= bound
        # a scraper at another address is not refused for the flood's sake
        assert get(http.port, "/metrics", src="127.0.0.2", auth="prom2:pw2") == 200


def test_a_new_address_never_hands_every_spent_failure_budget_back() -> None:
    # With 4,096 addresses tracked and none whole, one more address reset every budget at once.
    budget = auth_mod._FailureBudget()
    for i in range(auth_mod.MAX_TRACKED_CLIENTS - 1):
        assert budget.spend(f"10.0.{i // 256}.{i % 256}")
    while budget.spend("attacker"):
        pass
    assert budget.spend("one-more-address")  # the table was full: the longest-failed one goes
    assert not budget.spend("attacker")  # its spent budget is still spent
