"""`--web-config-file` on every service's own /metrics, end to end (issue 12 item 5).

The metrics service has its Prometheus-scraped test (test_metrics_tls_auth.py); the producer,
chargeback, alerts and recommend share its web-config server, which unit tests cover
(tests/unit/test_service_http_web_config.py). Here each runs as the CLI a user starts, against a
real broker, with an exporter-toolkit web config (TLS + a bcrypt user): /metrics over HTTPS with
the CA and the password answers the service's own series, without the password 401, plain HTTP
nothing; /healthz stays open for probes.
"""

from __future__ import annotations

import base64
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpupipe import topics
from gpupipe.kafka_admin import ensure_topics
from tests import hygiene
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.integration.metrics_helpers import wait_for
from tests.integration.test_metrics_tls_auth import web_config

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
