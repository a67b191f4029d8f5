"""gpupipe.web.server: the one server every service listens with (TLS, client SANs, rate limit,
basic auth, reload, probes, HEAD, the start-up mode, the connection bound)."""

from __future__ import annotations

import base64
import contextlib
import http.client as http_client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry, Counter

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import ready
from gpupipe.web.config import WebConfigSource
from gpupipe.web.server import HttpServer, registry_route
from tests.integration.consumers.metrics.test_tls_auth import make_certs
from tests.pki import Pki


def serve(reg: CollectorRegistry, web: Path | None = None, **kw: object) -> HttpServer:
    """A service's own /metrics and probes, as the runner serves them (not started)."""
    routes = {"/metrics": registry_route(reg)}
    return HttpServer("127.0.0.1:0", web, routes=routes, health=lambda: (True, {}), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("argv", [["produce"], ["chargeback"], ["alerts"], ["metrics"], ["recommend"]])
def test_every_service_with_listen_takes_a_web_config_file(argv: list[str]) -> None:
    args = cli.build_parser().parse_args([*argv, "--web-config-file", "/etc/gpupipe/web.yml"])
    assert args.web_config_file == "/etc/gpupipe/web.yml"


def test_tls_and_basic_auth_on_a_service_metrics_endpoint(tmp_path: Path) -> None:
    ca, crt, key = make_certs(tmp_path)
    hashed = bcrypt.hashpw(b"pw-1", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {crt.name}\n  key_file: {key.name}\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    )
    reg = CollectorRegistry()
    Counter("gpupipe_test_things", "things", registry=reg).inc()
    http = serve(reg, web).start()
    try:
        assert http.scheme == "https"
        base = f"https://127.0.0.1:{http.port}"
        ctx = ssl.create_default_context(cafile=str(ca))

        def get(path: str, auth: str | None = None) -> tuple[int, str, dict[str, str]]:
            req = urllib.request.Request(base + path)
            if auth:
                req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                    return r.status, r.read().decode(), dict(r.headers)
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode(), dict(e.headers)

        code, body, headers = get("/metrics", "prometheus:pw-1")
        assert code == 200 and "gpupipe_test_things_total 1.0" in body
        assert headers["X-Frame-Options"] == "deny"
        assert get("/metrics")[0] == 401
        assert get("/metrics", "prometheus:wrong")[0] == 401
        assert get("/healthz")[0] == 200  # probes need no password
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(base + "/healthz", context=ssl.create_default_context(), timeout=10)
    finally:
        http.stop()


def test_without_web_config_it_stays_plain_http() -> None:
    http = serve(CollectorRegistry()).start()
    try:
        assert http.scheme == "http"
        with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        http.stop()


def test_a_bad_web_config_is_a_clear_error(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_confg: {}\n")
    with pytest.raises(ConfigError, match="unsupported key"):
        serve(CollectorRegistry(), web)


# -- the one server: what every service's port now does alike --------------------------------------
def _status(
    base: str,
    path: str = "/metrics",
    *,
    ctx: ssl.SSLContext | None = None,
    auth: str | None = None,
    method: str = "GET",
) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(base + path, method=method)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    p = Pki(tmp_path)
    p.server()
    p.client("prometheus.scrape")
    p.client("intruder.example")
    return p


def _mtls(pki: Pki, client: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client:
        ctx.load_cert_chain(str(pki.dir / f"{client}.crt"), str(pki.dir / f"{client}.key"))
    return ctx


def test_client_allowed_sans_are_enforced(pki: Pki) -> None:
    web = pki.dir / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: ca.crt\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_allowed_sans: [prometheus.scrape]\n"
    )
    with contextlib.closing(serve(CollectorRegistry(), web).start()) as http:
        base = f"https://127.0.0.1:{http.port}"
        assert _status(base, ctx=_mtls(pki, "prometheus.scrape"))[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            _status(base, ctx=_mtls(pki, "intruder.example"))


def test_rate_limit_answers_429_past_the_burst(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("rate_limit:\n  interval: 1h\n  burst: 3\n")
    with contextlib.closing(serve(CollectorRegistry(), web).start()) as http:
        base = f"http://127.0.0.1:{http.port}"
        paths = ("/metrics", "/healthz", "/metrics", "/metrics", "/metrics", "/healthz")
        # probes are never limited (a 429 to a liveness probe restarts the service)
        assert [_status(base, p)[0] for p in paths] == [200, 200, 200, 200, 429, 200]


def test_head_answers_like_get_without_a_body(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    Counter("gpupipe_test_things", "things", registry=reg).inc()
    with contextlib.closing(serve(reg).start()) as http:
        base = f"http://127.0.0.1:{http.port}"
        for path in ("/metrics", "/healthz", "/readyz", "/health", "/nowhere"):
            got, body, _headers = _status(base, path)
            head, head_body, head_headers = _status(base, path, method="HEAD")
            assert (head, head_body) == (got, b""), path
            assert head_headers["Content-Length"] == str(len(body)), path


def test_probes_answer_alike(tmp_path: Path) -> None:
    with contextlib.closing(serve(CollectorRegistry()).start()) as http:
        base = f"http://127.0.0.1:{http.port}"
        code, body, headers = _status(base, "/health")
        assert (code, body) == (200, b"OK")  # dcgm-exporter's answer, on every service
        for path in ("/healthz", "/readyz"):
            code, body, headers = _status(base, path)
            assert code == 200 and headers["Content-Type"] == "application/json", path
            assert json.loads(body)["status"] == "ok"


def test_users_and_certificates_are_reloaded_when_their_files_change(pki: Pki) -> None:
    web = pki.dir / "web.yml"

    def write(password: str) -> None:
        web.write_text(
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            f"basic_auth_users:\n  prometheus: '{_hash(password)}'\n"
        )

    write("first")
    source = WebConfigSource(web, check_every_s=0)
    with contextlib.closing(serve(CollectorRegistry(), source).start()) as http:  # type: ignore[arg-type]
        base = f"https://127.0.0.1:{http.port}"
        ctx = _mtls(pki, None)
        assert _status(base, ctx=ctx, auth="prometheus:first")[0] == 200
        write("second")  # the old password is revoked
        assert _status(base, ctx=ctx, auth="prometheus:first")[0] == 401
        assert _status(base, ctx=ctx, auth="prometheus:second")[0] == 200

        def served_serial() -> int:
            raw = socket.create_connection(("127.0.0.1", http.port), timeout=10)
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                der = tls.getpeercert(binary_form=True)
            return x509.load_der_x509_certificate(der).serial_number

        before = served_serial()
        crt, _ = pki.server()  # rotated in place: same file names, a new certificate
        assert served_serial() == x509.load_pem_x509_certificate(crt.read_bytes()).serial_number != before
        assert source.reloads >= 2


def test_a_broken_rewrite_keeps_the_config_that_works(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{_hash('pw')}'\n")
    source = WebConfigSource(web, check_every_s=0)
    with contextlib.closing(serve(CollectorRegistry(), source).start()) as http:  # type: ignore[arg-type]
        base = f"http://127.0.0.1:{http.port}"
        web.write_text("basic_auth_users: [not, a, mapping\n")  # half written
        assert _status(base, auth="prometheus:pw")[0] == 200
        assert _status(base)[0] == 401  # still protected
        assert source.reload_errors == 1


@pytest.mark.parametrize(
    "rewrite",
    [
        "rate_limit:\n  interval: 1s\n  burst: .inf\n",  # OverflowError in the parser
        "http_server_config:\n  headers: [a]\n",  # AttributeError
        "tls_server_config:\n  client_auth_type: [x]\n",  # TypeError
    ],
)
def test_any_rewrite_that_does_not_parse_keeps_the_server_answering(tmp_path: Path, rewrite: str) -> None:
    # The accept loop reads the config: an exception other than ConfigError ended it, and the
    # service went on running with no probe or scrape answered.
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{_hash('pw')}'\n")
    source = WebConfigSource(web, check_every_s=0)
    with contextlib.closing(serve(CollectorRegistry(), source).start()) as http:  # type: ignore[arg-type]
        base = f"http://127.0.0.1:{http.port}"
        web.write_text(rewrite)
        for _ in range(3):
            assert _status(base, auth="prometheus:pw")[0] == 200
        assert _status(base)[0] == 401  # the previous config stays
        assert source.reload_errors == 1


def test_a_password_longer_than_bcrypt_reads_is_refused_with_401(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{_hash('pw')}'\n")
    with contextlib.closing(serve(CollectorRegistry(), web).start()) as http:
        base = f"http://127.0.0.1:{http.port}"
        assert _status(base, auth="prometheus:" + "x" * 100)[0] == 401
        assert _status(base, auth="prometheus:pw")[0] == 200  # the server is still there


def test_starting_mode_is_503_behind_the_same_tls_and_auth(pki: Pki) -> None:
    web = pki.dir / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        f"basic_auth_users:\n  prometheus: '{_hash('pw')}'\n"
    )
    state = ready.StartupState()
    state.waiting_for = "Kafka at h:1"
    http = HttpServer("127.0.0.1:0", web, service="recommend", starting=state).start()
    with contextlib.closing(http):
        base = f"https://127.0.0.1:{http.port}"
        ctx = _mtls(pki, None)
        code, body, _ = _status(base, "/healthz", ctx=ctx)
        assert code == 503 and json.loads(body)["status"] == "starting"
        assert json.loads(body)["waiting_for"] == "Kafka at h:1"
        assert _status(base, "/metrics", ctx=ctx)[0] == 401  # no open door while starting
        reg = CollectorRegistry()
        http.serve({"/metrics": registry_route(reg)}, health=lambda: (True, {}))
        assert _status(base, "/healthz", ctx=ctx)[0] == 200
        assert _status(base, "/metrics", ctx=ctx, auth="prometheus:pw")[0] == 200


def test_connections_past_the_bound_are_closed_not_queued() -> None:
    http = serve(CollectorRegistry(), max_open_connections=1).start()
    with contextlib.closing(http):
        base = f"http://127.0.0.1:{http.port}"
        busy = socket.create_connection(("127.0.0.1", http.port), timeout=10)
        try:
            busy.sendall(b"GET /metrics HTTP/1.1\r\n")  # a worker waits for the rest of its head
            # the only connection is not idle, so nothing makes room for another
            deadline = time.monotonic() + 30
            while http.refused_connections == 0:
                assert time.monotonic() < deadline, "no connection was refused"
                with contextlib.suppress(OSError, http_client.HTTPException):
                    _status(base)
        finally:
            busy.close()
        deadline = time.monotonic() + 30
        while True:  # the slot comes back when the busy connection is gone
            with contextlib.suppress(OSError, http_client.HTTPException):
                if _status(base)[0] == 200:
                    break
            assert time.monotonic() < deadline, "the slot never came back"
            time.sleep(0.05)


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_head_over_the_budget_is_431_and_a_body_is_413() -> None:
    http = serve(CollectorRegistry()).start()
    with contextlib.closing(http):
        big = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90))
        answer = _raw(http.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 431 ")
        answer = _raw(http.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert _status(f"http://127.0.0.1:{http.port}")[0] == 200, "ordinary requests still served"


def test_a_client_trickling_its_head_loses_the_slot_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupipe.web import server as server_mod

    monkeypatch.setattr(server_mod, "HEADER_DEADLINE_S", 1.0)
    http = serve(CollectorRegistry(), max_connections=1).start()
    with contextlib.closing(http):
        slow = socket.create_connection(("127.0.0.1", http.port), timeout=10)
        with contextlib.closing(slow):
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            slow.settimeout(0.3)
            closed = False
            for _ in range(60):  # up to ~18 s of one header byte every 0.3 s
                try:
                    slow.sendall(b"X")
                    if slow.recv(1024) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            assert closed, "the trickling client kept its slot"
        deadline = time.monotonic() + 30
        while True:  # the slot comes back once the server thread let the connection go
            with contextlib.suppress(OSError, http_client.HTTPException):
                if _status(f"http://127.0.0.1:{http.port}")[0] == 200:
                    break
            assert time.monotonic() < deadline, "the slot never came back"
            time.sleep(0.05)
