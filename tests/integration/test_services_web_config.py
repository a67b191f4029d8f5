"""`--web-config-file` on every service's own port, end to end.

Every service listens with the one server of gpupipe.web (unit tests: tests/unit/gpupipe/web/test_server.py).
Here each runs as the CLI a user starts, against a
real broker, with an exporter-toolkit web config (TLS + a bcrypt user): /metrics over HTTPS with
the CA and the password answers the service's own series, without the password 401, plain HTTP
nothing; /healthz stays open for probes.
"""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests import hygiene
from tests.conftest import free_port
from tests.integration.consumers.metrics.test_tls_auth import web_config
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.integration.metrics_helpers import wait_for
from tests.pki import Pki

pytestmark = pytest.mark.integration

PRICES = "currency: USD\ndefault_per_gpu_hour: 2.0\nmodels: []\n"

# service -> (extra arguments, a series of its own that /metrics must show)
SERVICES = {
    "produce": (["--source", "simulated", "--nodes", "1", "--gpus-per-node", "2"], b"gpupipe_producer_"),
    "chargeback": (["--prices", "{prices}", "--instance-id", "w"], b"gpupipe_chargeback_"),
    "alerts": (["--instance-id", "w"], b"gpupipe_alerts_"),
    "recommend": (["--prices", "{prices}"], b"gpupipe_recommend"),
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_own_metrics_behind_tls_and_basic_auth(
    kafka: str, topic_prefix: str, tmp_path: Path, service: str
) -> None:
    ensure_topics(kafka, topics.ALL, prefix=topic_prefix)
    ca, web, password = web_config(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    extra, own = SERVICES[service]
    port = free_port()
    cmd = [
        *GPUPIPE,
        service,
        *("--bootstrap-servers", kafka, "--topic-prefix", topic_prefix),
        *("--listen", f"127.0.0.1:{port}", "--web-config-file", str(web)),
        *(a.format(prices=prices) for a in extra),
    ]
    log = tmp_path / f"{service}.log"
    with log.open("wb") as out:
        proc = hygiene.popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        ctx = ssl.create_default_context(cafile=str(ca))
        base = f"https://127.0.0.1:{port}"

        def health() -> int | None:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/healthz", context=ctx, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code  # 503 while starting: served, without credentials
            except OSError:
                return None

        wait_for(lambda: health() == 200, 60, f"{service} /healthz 200 over HTTPS without credentials")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/metrics", context=ctx, timeout=10)
        assert err.value.code == 401
        auth = base64.b64encode(f"prometheus:{password}".encode()).decode()
        req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Basic {auth}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            assert r.status == 200 and own in r.read()
        with pytest.raises((urllib.error.URLError, OSError)):  # plain HTTP gets nothing
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        hygiene.stop_group(proc)


ALL_SERVICES = {**SERVICES, "metrics": ([], b"gpupipe_metrics_")}


@pytest.mark.parametrize("service", sorted(ALL_SERVICES))
def test_sans_rate_limit_reload_and_head_on_every_service_port(
    kafka: str, topic_prefix: str, tmp_path: Path, service: str
) -> None:
    """The same web config means the same door on every port: a client certificate outside
    client_allowed_sans is refused, a revoked password stops working without a restart, the rate
    limit answers 429 (never to a probe), HEAD answers, and silent connections do not starve the
    probe. Four services ignored the SANs and the limit before."""
    ensure_topics(kafka, topics.ALL, prefix=topic_prefix)
    pki = Pki(tmp_path)
    pki.server()
    pki.client("prometheus.scrape")
    pki.client("intruder.example")
    web = tmp_path / "web.yml"

    def write(password: str, rate_limit: str = "") -> None:
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
        web.write_text(
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: ca.crt\n"
            "  client_auth_type: RequireAndVerifyClientCert\n  client_allowed_sans: [prometheus.scrape]\n"
            f"basic_auth_users:\n  prometheus: '{hashed}'\n{rate_limit}"
        )

    write("first")
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    extra, own = ALL_SERVICES[service]
    port = free_port()
    cmd = [
        *GPUPIPE,
        service,
        *("--bootstrap-servers", kafka, "--topic-prefix", topic_prefix),
        *("--listen", f"127.0.0.1:{port}", "--web-config-file", str(web)),
        *(a.format(prices=prices) for a in extra),
    ]
    log = tmp_path / f"{service}.log"
    with log.open("wb") as out:
        proc = hygiene.popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"https://127.0.0.1:{port}"

        def ctx(client: str) -> ssl.SSLContext:
            c = ssl.create_default_context(cafile=str(pki.ca))
            c.load_cert_chain(str(tmp_path / f"{client}.crt"), str(tmp_path / f"{client}.key"))
            return c

        def get(path: str, password: str | None = None, method: str = "GET") -> tuple[int, bytes]:
            assert proc.poll() is None, log.read_text()[-3000:]
            req = urllib.request.Request(base + path, method=method)
            if password:
                auth = base64.b64encode(f"prometheus:{password}".encode()).decode()
                req.add_header("Authorization", f"Basic {auth}")
            try:
                with urllib.request.urlopen(req, context=ctx("prometheus.scrape"), timeout=10) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        def healthy() -> bool:
            try:
                return get("/healthz")[0] == 200
            except OSError:
                return False

        wait_for(healthy, 60, f"{service} /healthz 200 with the allowed client certificate")
        code, body = get("/metrics", "first")
        assert code == 200 and own in body
        assert get("/metrics", "first", method="HEAD") == (200, b"")
        with pytest.raises((urllib.error.URLError, OSError)):  # a SAN outside the list: no answer
            urllib.request.urlopen(base + "/healthz", context=ctx("intruder.example"), timeout=10).read()

        write("second", "rate_limit:\n  interval: 1h\n  burst: 5\n")  # revoke, and limit
        wait_for(lambda: get("/metrics", "second")[0] == 200, 30, f"{service} reloads its web config")
        assert get("/metrics", "first")[0] == 401
        codes = [get("/metrics", "second")[0] for _ in range(6)]
        assert 429 in codes, codes
        # with the bucket spent and more silent connections than the 64
        # workers, the probe with the allowed certificate is still answered
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(80)]
        try:
            assert get("/healthz")[0] == 200
        finally:
            for s in silent:
                s.close()
    finally:
        hygiene.stop_group(proc)
