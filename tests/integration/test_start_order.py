"""Every service on an empty cluster or before the broker: it waits, says "starting", then serves.

Started before any topic existed, a service that created them and read one at once could exit with
"Not leader for partition" (a fresh partition has no leader for a moment), a crash loop on every
fresh install; `recommend` did, as its start-up was its own copy without the wait.
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


@pytest.mark.parametrize("service", ["alerts", "metrics", "chargeback", "recommend"])
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


@pytest.mark.parametrize("service", ["alerts", "metrics", "chargeback", "recommend", "produce"])
def test_before_the_broker_a_service_answers_starting_and_stops_on_sigterm(
    tmp_path: Path, service: str
) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # no broker there (yet)
    port = free_port()
    log = tmp_path / "service.log"
    argv = [service, "--bootstrap-servers", nobody, "--listen", f"127.0.0.1:{port}", "--log-format", "text"]
    if service == "produce":
        argv += ["--source", "simulated", "--nodes", "1", "--gpus-per-node", "1"]
    with log.open("wb") as out:
        proc = popen([*GPUPIPE, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:

        def starting() -> dict | None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            except urllib.error.HTTPError as exc:
                return json.loads(exc.read()) if exc.code == 503 else None
            except OSError:
                return None
            return None

        deadline = time.monotonic() + 60
        body = None
        while time.monotonic() < deadline and proc.poll() is None and body is None:
            body = starting()
            time.sleep(0.1)
        assert proc.poll() is None, f"{service} exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert (
            body is not None
            and body["status"] == "starting"
            and body["service"] == ("producer" if service == "produce" else service)
        ), body
        assert nobody in body["waiting_for"]
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()[-2000:]
        assert time.monotonic() - began < 10
    finally:
        if proc.poll() is None:
            stop_group(proc)
