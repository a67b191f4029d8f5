"""`gpupipe metrics --web-config-file`: TLS and basic auth on /metrics, scraped by a real Prometheus.

The service runs with an exporter-toolkit web config (server certificate + a bcrypt user); a real
Prometheus scrapes it over HTTPS with the CA and the password, as the commented example in
deploy/prometheus/prometheus.yml says. Without credentials /metrics answers 401, /healthz stays
open for probes.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from tests.conftest import free_port
from tests.integration.metrics_helpers import Prometheus, prometheus_config, wait_for

pytestmark = pytest.mark.integration


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1, server key), PEM files."""
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("gpupipe test CA", ca_key, "gpupipe test CA", ca_key, True)
    srv = cert("127.0.0.1", srv_key, "gpupipe test CA", ca_key, False)
    paths = (d / "ca.crt", d / "server.crt", d / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        srv_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


def web_config(d: Path) -> tuple[Path, Path, str]:
    """(CA certificate, exporter-toolkit web config with TLS and the user ``prometheus``, its password)."""
    ca, crt, key = make_certs(d)
    password = "s3cret-" + uuid.uuid4().hex[:6]
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    web = d / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {crt.name}\n  key_file: {key.name}\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    return ca, web, password


def test_tls_and_basic_auth_scraped_by_prometheus(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ca, web, password = web_config(tmp_path)
    port = free_port()
    svc = MetricsService(
        MetricsConfig(
            bootstrap=kafka,
            topic_prefix=topic_prefix,
            group_id=f"metrics-{uuid.uuid4().hex[:8]}",
            host="127.0.0.1",
            port=port,
            web_config=str(web),
        )
    ).start()
    cfg = prometheus_config([f"127.0.0.1:{port}"])
    job = cfg["scrape_configs"][0]
    job["scheme"] = "https"
    job["tls_config"] = {"ca_file": str(ca)}
    job["basic_auth"] = {"username": "prometheus", "password": password}
    prom = Prometheus(cfg, tmp_path / "prom", free_port())
    try:
        ctx = ssl.create_default_context(cafile=str(ca))
        base = f"https://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/metrics", context=ctx, timeout=10)
        assert err.value.code == 401

        def healthy() -> bool:  # /healthz stays open for probes: 503 until consuming, then 200
            with urllib.request.urlopen(base + "/healthz", context=ctx, timeout=10) as r:
                return json.loads(r.read())["status"] == "ok"

        wait_for(healthy, 30, "/healthz 200 over HTTPS without credentials")
        with pytest.raises((urllib.error.URLError, OSError)):  # plain HTTP gets nothing
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()

        prom.wait_ready()
        res = wait_for(
            lambda: prom.query('gpupipe_metrics_gpus{job="gpupipe-metrics"}'), 30, "an HTTPS scrape"
        )
        assert float(res[0]["value"][1]) == 0.0
        assert prom.query('up{job="gpupipe-metrics"} == 1')
    except BaseException:
        print("--- prometheus log ---\n" + prom.log_tail())
        raise
    finally:
        prom.stop()
        svc.stop()
