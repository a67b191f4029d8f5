"""`gpupipe alerts` on an empty cluster: it creates the topics and must then serve, not crash.

Reproduces the defect of issue 9: started before any topic existed, the service created them and
exited at once with "cannot restore alerts from gpu.alerts.v1: ... Not leader for partition" (a
fresh partition has no leader for a moment), a crash loop on every fresh install.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.kafka_util import GPUPIPE

pytestmark = pytest.mark.integration


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            json.loads(r.read())
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@pytest.mark.parametrize("service", ["alerts", "metrics", "chargeback"])
def test_service_on_an_empty_cluster_becomes_ready(
    kafka: str, topic_prefix: str, tmp_path: Path, service: str
) -> None:
    port = free_port()
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        argv = [service, "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
        argv += ["--listen", f"127.0.0.1:{port}", "--log-format", "text"]
        proc = popen(
            [*GPUPIPE, *argv],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and _health(port) != 200:
            time.sleep(0.2)
        assert proc.poll() is None, f"{service} exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert _health(port) == 200, log.read_text()[-2000:]
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()[-2000:]
        assert time.monotonic() - began < 10
    finally:
        if proc.poll() is None:
            stop_group(proc)
