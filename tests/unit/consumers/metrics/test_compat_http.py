"""dcgm-exporter's HTTP surface: /health, IPv6 and Go-style listen addresses, the full exporter-toolkit
web-config schema (inline PEM, cipher suites, curves, client SANs, rate limit).

Before: /health was 404, `--listen [::]:9400` failed, and a web config with any of these toolkit
keys (or the toolkit's own sample, which has rate_limit) stopped the service at startup.
"""

from __future__ import annotations

import http.client
import socket
import ssl

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe.web.server import parse_listen
from gpupipe_consumers.metrics.http import make_metrics_server, parse_web_config
from tests.unit.consumers.metrics.test_http import client_context, get, pki, serve, store  # noqa: F401


def test_health_answers_ok_like_dcgm_exporter(store):  # noqa: F811
    srv = serve(store)
    try:
        status, headers, body = get(srv, "/health")
        assert (status, body) == (200, b"OK")
        assert headers["x-content-type-options"] == "nosniff"
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (":9400", ("", 9400)),
        ("[::]:9400", ("::", 9400)),
        ("[2001:db8::1]:9401", ("2001:db8::1", 9401)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("node-1:80", ("node-1", 80)),
    ],
)
def test_listen_addresses_as_go_reads_them(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["9400", "[::]9400", "::1:9400", "[::1]:x", "h:70000"])
def test_bad_listen_addresses(text):
    with pytest.raises(ConfigError):
        parse_listen(text)


def _get(host: str, port: int) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_all_addresses_and_ipv6_listen(store):  # noqa: F811
    if not _ipv6_loopback():  # a machine without IPv6: ':0' still listens (IPv4), '[::]' says why not
        srv = make_metrics_server(store, "", 0).start()
        try:
            assert srv.address_family == socket.AF_INET and _get("127.0.0.1", srv.port) == 200
        finally:
            srv.close()
        with pytest.raises(ConfigError, match="cannot listen"):
            make_metrics_server(store, "::", 0)
        return
    for host in ("", "::"):  # ':0' and '[::]:0': both IPv6 and IPv4 clients
        srv = make_metrics_server(store, host, 0).start()
        try:
            assert srv.address_family == socket.AF_INET6
            assert _get("::1", srv.port) == 200
            assert _get("127.0.0.1", srv.port) == 200
        finally:
            srv.close()


def full_toolkit_doc(pki, sans: list[str], burst: int = 3) -> dict:  # noqa: F811
    return {
        "tls_server_config": {
            "cert": pki["server_crt"].read_text(),  # inline PEM
            "key": pki["server_key"].read_text(),
            "client_ca": pki["ca"].read_text(),
            "client_auth_type": "RequireAndVerifyClientCert",
            "cipher_suites": [
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
                "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            ],
            "curve_preferences": ["CurveP256", "X25519"],
            "prefer_server_cipher_suites": True,
            "min_version": "TLS12",
            "max_version": "TLS13",
            "client_allowed_sans": sans,
        },
        "http_server_config": {"http2": True, "headers": {"X-Frame-Options": "deny"}},
        "rate_limit": {"interval": "1m", "burst": burst},
    }


def test_full_toolkit_schema_serves(pki, store):  # noqa: F811
    cfg = parse_web_config(full_toolkit_doc(pki, ["prometheus.scrape"]))
    srv = serve(store, web_config=cfg)
    try:
        ctx = client_context(pki, with_cert=True)
        status, headers, body = get(srv, "/metrics", context=ctx)
        assert status == 200 and b"DCGM_FI_DEV_GPU_TEMP" in body
        assert headers["x-frame-options"] == "deny"
        assert get(srv, "/health", context=ctx)[0] == 200  # a probe: never rate limited
        assert get(srv, "/metrics", context=ctx)[0] == 200
        assert get(srv, "/metrics", context=ctx)[0] == 200
        assert get(srv, "/metrics", context=ctx)[0] == 429  # burst of 3 spent, one more per minute
        assert get(srv, "/health", context=ctx)[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            get(srv, "/metrics", context=client_context(pki))  # no client certificate
    finally:
        srv.close()


def test_client_allowed_sans_rejects_other_clients(pki, store):  # noqa: F811
    srv = serve(store, web_config=parse_web_config(full_toolkit_doc(pki, ["someone.else"], burst=100)))
    try:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError, http.client.HTTPException)):
            get(srv, "/metrics", context=client_context(pki, with_cert=True))
    finally:
        srv.close()


def test_request_client_cert_and_zero_rate_limit_are_accepted(pki):  # noqa: F811
    cfg = parse_web_config(
        {
            "tls_server_config": {
                "cert_file": str(pki["server_crt"]),
                "key_file": str(pki["server_key"]),
                "client_auth_type": "RequestClientCert",
            },
            "rate_limit": {"interval": "0s", "burst": 0},
        }
    )
    assert cfg.ssl_context is not None and cfg.rate_limit is None


def test_toolkit_spellings_and_go_semantics(pki):  # noqa: F811
    """Valid for exporter-toolkit v0.16.0, refused or misread before: the old name RequireClientCert,
    a cert_file next to an inline cert (the file wins), TLS 1.3 cipher names (Go accepts and ignores
    them; alone they leave only TLS 1.3), a bare-number interval (Go: nanoseconds)."""
    base = {"cert_file": str(pki["server_crt"]), "key_file": str(pki["server_key"])}
    cfg = parse_web_config(
        {
            "tls_server_config": {
                **base,
                "client_auth_type": "RequireClientCert",
                "client_ca": pki["ca"].read_text(),
            }
        }
    )
    assert cfg.ssl_context.verify_mode == ssl.CERT_REQUIRED
    parse_web_config({"tls_server_config": {**base, "cert": "not a certificate", "key": "not a key"}})
    mixed = ["TLS_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"]
    cfg = parse_web_config({"tls_server_config": {**base, "cipher_suites": mixed}})
    assert cfg.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2
    cfg = parse_web_config({"tls_server_config": {**base, "cipher_suites": ["TLS_AES_256_GCM_SHA384"]}})
    assert cfg.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert (
        parse_web_config({"rate_limit": {"interval": 2_000_000_000, "burst": 5}}).rate_limit.interval_s == 2.0
    )
    assert parse_web_config({"rate_limit": {"interval": "0s", "burst": 5}}).rate_limit is None


def test_ip_sans_compare_in_go_form():
    from gpupipe.web.server import san_allowed as _san_allowed

    cert = {"subjectAltName": (("DNS", "scraper"), ("IP Address", "2001:DB8:0:0:0:0:0:1\n"))}
    assert _san_allowed(cert, frozenset({"2001:db8::1"}))  # Go's net.IP.String()
    assert _san_allowed(cert, frozenset({"scraper"}))
    assert not _san_allowed(cert, frozenset({"10.0.0.1"}))
    assert not _san_allowed(None, frozenset({"scraper"}))


def test_startup_health_takes_the_same_listen_addresses():
    """`gpupipe metrics -a [::]:9400` first answers 503 on that address while Kafka is awaited:
    the server in its start-up mode takes every address the metrics server takes."""
    from gpupipe.kafka import ready
    from gpupipe.web.server import HttpServer

    hosts = ["[::]:0", "[::1]:0"] if _ipv6_loopback() else []
    for listen in [*hosts, ":0", "127.0.0.1:0"]:
        h = HttpServer(listen, service="metrics", starting=ready.StartupState()).start()
        try:
            port = h.port
            conn = http.client.HTTPConnection(
                "::1" if listen.startswith("[") else "127.0.0.1", port, timeout=10
            )
            try:
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 503, listen
            finally:
                conn.close()
        finally:
            h.close()
