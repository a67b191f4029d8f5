"""Issue 12: producer, chargeback and alerts serve /metrics with the same web-config (TLS, basic
auth) as the metrics service, parsed by the same code; /healthz stays open for probes."""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Counter

from gpupipe import cli
from gpupipe.errors import ConfigError
from gpupipe.health_server import ServiceHttp
from tests.integration.test_metrics_tls_auth import make_certs


@pytest.mark.parametrize("argv", [["produce"], ["chargeback"], ["alerts"], ["metrics"]])
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
    http = ServiceHttp("127.0.0.1:0", reg, lambda: (True, {}), str(web)).start()
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
    http = ServiceHttp("127.0.0.1:0", CollectorRegistry(), lambda: (True, {})).start()
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
        ServiceHttp("127.0.0.1:0", CollectorRegistry(), lambda: (True, {}), str(web))
