"""exporter-toolkit v0.16.0's own web-config test files give the results its own tests expect.

Fixtures: tests/fixtures/metrics/exporter-toolkit/testdata/ is the toolkit's ``web/testdata`` at tag
v0.16.0 (the version dcgm-exporter 4.8 pins), copied verbatim; the expected outcome of each file comes
from tests.paths import TESTS
from the toolkit's ``web/tls_config_test.go`` (``TestYAMLFiles``, ``TestServerBehaviour``,
``TestUsers``). Every file is classified below, so a file the table forgets fails the test.

Before this change the toolkit's valid files ``web_config_noAuth.good.yml`` (VerifyClientCertIfGiven
without a CA), ``web_config_noAuth.good.blocking.yml``, ``web_config_rate_limiter_one_second.yaml``
(burst 0) and ``web_config_rate_limiter_nonblocking.yaml`` (interval 0 was a limiter that never
refilled) were refused or misread, and the invalid headers and CA-without-policy files were accepted.
"""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.metrics.http import load_web_config
from tests.paths import TESTS
from tests.unit.consumers.metrics.test_http import get, serve, store  # noqa: F401

TD = TESTS / "fixtures" / "metrics" / "exporter-toolkit" / "testdata"

#: the toolkit accepts these; so do we
LOADS = {
    "web_config_empty.yml",
    "web_config_headers.good.yml",
    "web_config_noAuth.good.yml",
    "web_config_noAuth.good.blocking.yml",
    "web_config_noAuth_allCiphers.good.yml",  # TLS 1.3 suite names among them
    "web_config_noAuth_allCurves.good.yml",
    "web_config_noAuth_noHTTP2.good.yml",
    "web_config_noAuth_someCiphers.good.yml",
    "web_config_noAuth_someCiphers_noOrder.good.yml",
    "web_config_noAuth_someCurves.good.yml",
    "web_config_noAuth_tlsInline.good.yml",
    "tls_config_noAuth.requireandverifyclientcert.good.yml",
    "web_config_auth_client_san.good.yaml",
    "web_config_auth_client_san.bad.yaml",  # loads; its client is refused at the handshake (below)
    "web_config_rate_limiter_nonblocking.yaml",
    "web_config_rate_limiter_one_second.yaml",
    "web_config_users.good.yml",
    "web_config_users_noTLS.good.yml",
    # no toolkit test uses it; the toolkit's code accepts it (Go verifies against the system roots)
    "web_config_auth_clientCAs_missing.bad.yml",
}
#: the toolkit refuses these at start; so do we (our message)
REFUSED = {
    "web_config_junk.yml": "expected a mapping",
    "web_config_junk_key.yml": "unsupported tls_server_config key(s) cert_filse",
    "web_config_noAuth_certPath_empty.bad.yml": "needs cert_file/cert and key_file/key",
    "web_config_noAuth_cert_empty.bad.yml": "needs cert_file/cert and key_file/key",
    "web_config_noAuth_keyPath_empty.bad.yml": "needs cert_file/cert and key_file/key",
    "web_config_noAuth_key_empty.bad.yml": "needs cert_file/cert and key_file/key",
    "web_config_noAuth_certPath_keyPath_empty.bad.yml": "needs cert_file/cert and key_file/key",
    "web_config_noAuth_certPath_invalid.bad.yml": "cannot load TLS files",
    "web_config_noAuth_keyPath_invalid.bad.yml": "cannot load TLS files",
    "web_config_noAuth_certPath_keyPath_invalid.bad.yml": "cannot load TLS files",
    "web_config_noAuth.bad.yml": "configured without a Client Auth Policy",
    "web_config_auth_clientCAs_invalid.bad.yml": "configured without a Client Auth Policy",
    "web_config_auth_user_list_invalid.bad.yml": "not a bcrypt hash",
    "web_config_noAuth_inventedCiphers.bad.yml": "unknown cipher_suites",
    "web_config_noAuth_inventedCurves.bad.yml": "unknown curve_preferences",
    "web_config_noAuth_wrongTLSVersion.bad.yml": "unknown TLS version",
    "web_config_headers_content_type_options.bad.yml": "invalid value for X-Content-Type-Options",
    "web_config_headers_frame_options.bad.yml": "invalid value for X-Frame-Options",
    "web_config_headers_extra_header.bad.yml": "HTTP header 'Content-Type' can not be configured",
}
#: where we differ (docs/metrics.md, compatibility table): the toolkit accepts, we refuse, or the reverse
DIFFERS = {
    # Python's ssl cannot ask for a client certificate without verifying it: refused at start
    "tls_config_noAuth.requireanyclientcert.good.yml": "needs client_ca_file or client_ca here",
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml": "needs client_ca_file or client_ca here",
    # Go's HTTP/2 needs an AES-128-GCM suite; we serve HTTP/1.1 only, so this loads
    "web_config_noAuth_noHTTP2Cipher.bad.yml": "",
}


def test_every_toolkit_file_is_classified() -> None:
    files = {p.name for p in TD.iterdir() if p.suffix in (".yml", ".yaml")}
    assert len(files) == 41
    assert files == LOADS | set(REFUSED) | set(DIFFERS)


@pytest.mark.parametrize("name", sorted(LOADS | {k for k, v in DIFFERS.items() if not v}))
def test_toolkit_valid_files_load(name: str) -> None:
    load_web_config(TD / name)


@pytest.mark.parametrize("name", sorted({**REFUSED, **{k: v for k, v in DIFFERS.items() if v}}))
def test_toolkit_invalid_files_are_refused(name: str) -> None:
    want = REFUSED.get(name) or DIFFERS[name]
    with pytest.raises(ConfigError) as exc:
        load_web_config(TD / name)
    assert want in str(exc.value)


def client(cert: str | None = None) -> ssl.SSLContext:
    """A client, optionally with one of the toolkit's client certificates. It does not verify the
    server: the toolkit's server.crt has only keyEncipherment usage, which Go accepts and OpenSSL
    refuses as a server certificate; the server side is what these tests are about."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(str(TD / f"{cert}.pem"), str(TD / f"{cert}.key"))
    return ctx


REFUSED_HANDSHAKE = (ssl.SSLError, ConnectionError, OSError, http.client.HTTPException)


def test_client_sans_and_verified_client_certificates(store) -> None:  # noqa: F811
    for name, cert, ok in (
        ("web_config_auth_client_san.good.yaml", "client2_selfsigned", True),  # SAN test3 allowed
        ("web_config_auth_client_san.bad.yaml", "client2_selfsigned", False),  # only "bad" allowed
        ("tls_config_noAuth.requireandverifyclientcert.good.yml", "client_selfsigned", True),
        ("tls_config_noAuth.requireandverifyclientcert.good.yml", None, False),
    ):
        srv = serve(store, web_config=load_web_config(TD / name))
        try:
            if ok:
                assert get(srv, "/metrics", context=client(cert))[0] == 200, (name, cert)
            else:
                with pytest.raises(REFUSED_HANDSHAKE):
                    get(srv, "/metrics", context=client(cert))
        finally:
            srv.close()


def test_rate_limiter_files(store) -> None:  # noqa: F811
    srv = serve(store, web_config=load_web_config(TD / "web_config_rate_limiter_nonblocking.yaml"))
    try:  # interval 0: no limiter, whatever the burst
        assert [get(srv, "/health")[0] for _ in range(10)] == [200] * 10
    finally:
        srv.close()
    srv = serve(store, web_config=load_web_config(TD / "web_config_rate_limiter_one_second.yaml"))
    try:  # burst 0: the toolkit's limiter allows nothing
        assert get(srv, "/metrics")[0] == 429
    finally:
        srv.close()


def test_users_files(store) -> None:  # noqa: F811
    import base64

    def auth(user: str, password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    srv = serve(store, web_config=load_web_config(TD / "web_config_users_noTLS.good.yml"))
    try:  # passwords from the toolkit's TestUsers
        assert get(srv, "/metrics")[0] == 401
        assert get(srv, "/metrics", auth("dave", "dave123"))[0] == 200
        assert get(srv, "/metrics", auth("dave", "bad"))[0] == 401
    finally:
        srv.close()
    srv = serve(store, web_config=load_web_config(TD / "web_config_users.good.yml"))
    try:
        assert get(srv, "/metrics", auth("carol", "carol123"), context=client())[0] == 200
        assert get(srv, "/metrics", context=client())[0] == 401
    finally:
        srv.close()


def test_toolkit_sample_that_dcgm_exporter_points_to(tmp_path: Path, store) -> None:  # noqa: F811
    """dcgm-exporter's README tells users to start from the toolkit's docs/web-config.yml (TLS, two
    bcrypt users, rate_limit 1s/20): it loads and serves, asking for basic auth."""
    sample = TD.parent / "web-config.yml"
    for name in ("server.crt", "server.key"):  # the sample names them relative to itself
        (tmp_path / name).write_bytes((TD / name).read_bytes())
    (tmp_path / "web-config.yml").write_text(sample.read_text())
    cfg = load_web_config(tmp_path / "web-config.yml")
    assert set(cfg.users) == {"alice", "bob"}
    assert (cfg.rate_limit.interval_s, cfg.rate_limit.burst) == (1.0, 20)
    srv = serve(store, web_config=cfg)
    try:
        assert get(srv, "/metrics", context=client())[0] == 401
    finally:
        srv.close()
