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


SERVICES = ("alerts", "metrics", "chargeback", "recommend")


def _start(service: str, argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return popen([*GPUPIPE, service, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def _stops_on_sigterm(service: str, proc: subprocess.Popen, log: Path) -> None:
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, f"{service}: {log.read_text()[-2000:]}"
    assert time.monotonic() - began < 10, service


def test_services_on_an_empty_cluster_become_ready(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    # All at once, as on a fresh install: each creates the topics it needs while the others do too.
    procs: dict[str, tuple[subprocess.Popen, Path, int]] = {}
    try:
        for service in SERVICES:
            port, log = free_port(), tmp_path / f"{service}.log"
            argv = ["--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
            argv += ["--listen", f"127.0.0.1:{port}", "--log-format", "text"]
            procs[service] = (_start(service, argv, log), log, port)
        deadline = time.monotonic() + 90
        waiting = set(SERVICES)
        while waiting and time.monotonic() < deadline:
            for service in list(waiting):
                proc, log, port = procs[service]
                assert proc.poll() is None, f"{service} exited {proc.returncode}: {log.read_text()[-2000:]}"
                if _health(port) == 200:
                    waiting.discard(service)
            time.sleep(0.2)
        assert not waiting, {s: procs[s][1].read_text()[-1500:] for s in waiting}
        for service, (proc, log, _) in procs.items():
            _stops_on_sigterm(service, proc, log)
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                stop_group(proc)


def test_before_the_broker_each_service_answers_starting_and_stops_on_sigterm(tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # no broker there (yet)
    procs: dict[str, tuple[subprocess.Popen, Path, int]] = {}
    try:
        for service in (*SERVICES, "produce"):
            port, log = free_port(), tmp_path / f"{service}.log"
            argv = ["--bootstrap-servers", nobody, "--listen", f"127.0.0.1:{port}", "--log-format", "text"]
            if service == "produce":
                argv += ["--source", "simulated", "--nodes", "1", "--gpus-per-node", "1"]
            procs[service] = (_start(service, argv, log), log, port)
        deadline = time.monotonic() + 90
        bodies: dict[str, dict | None] = dict.fromkeys(procs)
        # The first answer may come before the service names what it waits for ("start").
        while time.monotonic() < deadline and any(nobody not in str(b) for b in bodies.values()):
            for service, (proc, log, port) in procs.items():
                assert proc.poll() is None, f"{service} exited {proc.returncode}: {log.read_text()[-2000:]}"
                if nobody not in str(bodies[service]):
                    bodies[service] = _starting_body(port)
            time.sleep(0.1)
        for service, body in bodies.items():
            assert (
                body is not None
                and body["status"] == "starting"
                and body["service"] == ("producer" if service == "produce" else service)
            ), (service, body)
            assert nobody in body["waiting_for"], (service, body)
        for service, (proc, log, _) in procs.items():
            _stops_on_sigterm(service, proc, log)
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                stop_group(proc)


def _nvml_agent(kafka: str, topic_prefix: str, tmp_path: Path, port: int) -> subprocess.Popen:
    """The real CLI with the suite's fake NVML, topics not created by it (as the DaemonSet runs)."""
    import os
    import sys

    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("boot\n")  # not empty: its end is a position the agent seeks to
    env = {**os.environ, "GPUPIPE_FAKE_NVML": "H100:2", "NODE_NAME": "order-node"}
    argv = [sys.executable, str(REPO / "tests" / "fake_nvml_cli.py"), "produce", "--source", "nvml"]
    argv += ["--bootstrap-servers", kafka, "--topic-prefix", topic_prefix, "--no-create-topics"]
    argv += ["--interval", "200ms", "--sample-queue-max", "20", "--kubelet-socket", ""]
    argv += ["--kmsg-path", str(kmsg), "--spool-dir", str(tmp_path / "spool"), "--no-nvml-events"]
    argv += ["--listen", f"127.0.0.1:{port}", "--log-format", "text"]
    # A record to a missing topic fails after this long (default 30 s): a short run shows it.
    argv += ["--kafka-config", "topic.metadata.propagation.max.ms=1000"]
    out = (tmp_path / "agent.log").open("wb")
    return popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _starting_body(port: int) -> dict | None:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read()) if exc.code == 503 else None
    except OSError:
        return None
    return None


def _spool_records(tmp_path: Path) -> int:
    from gpupipe_producer.xid.spool_format import SPOOL_FILE, scan_records

    f = tmp_path / "spool" / SPOOL_FILE
    return len(scan_records(f.read_bytes()).records) if f.exists() else 0


def _write_xid(tmp_path: Path, proc: subprocess.Popen) -> None:
    """An Xid 79 in the kernel log, once the agent reads it (it follows the file from its end)."""
    from tests.agent_harness import await_at_end_of, find_line

    log = tmp_path / "agent.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "node agent started" not in log.read_text():
        time.sleep(0.1)
    await_at_end_of(proc.pid, tmp_path / "kmsg.log")
    with (tmp_path / "kmsg.log").open("a") as f:
        f.write(find_line("xid_real.txt", "Xid (PCI:0000:91:00): 79") + "\n")


def test_the_node_agent_waits_for_its_topics_and_spools_xids_meanwhile(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    # On a fresh broker the agent used to publish at once: every record failed with "Unknown topic
    # or partition" and /healthz said ok. It must say "starting", spool, and deliver once they exist.
    from gpupipe.kafka import topics
    from gpupipe.kafka.admin import ensure_topics
    from gpupipe_schemas.codec import AvroCodec
    from tests.integration.kafka_util import read_all

    port = free_port()
    proc = _nvml_agent(kafka, topic_prefix, tmp_path, port)
    log = tmp_path / "agent.log"
    try:
        deadline = time.monotonic() + 30
        body: dict | None = None
        while time.monotonic() < deadline and proc.poll() is None:
            body = _starting_body(port)
            if body is not None and topic_prefix + topics.XID in body.get("waiting_for", ""):
                break
            time.sleep(0.1)
        assert body is not None and body["status"] == "starting", (body, log.read_text()[-2000:])
        assert topic_prefix + topics.XID in body["waiting_for"], (body, log.read_text()[-2000:])
        _write_xid(tmp_path, proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _spool_records(tmp_path) < 1:
            time.sleep(0.1)
        assert _spool_records(tmp_path) == 1, log.read_text()[-2000:]
        time.sleep(2.0)  # samples pile up in their bounded queue meanwhile
        assert _starting_body(port) is not None, "still starting while the topics are missing"

        ensure_topics(kafka, [topics.SAMPLES, topics.XID, topics.TOPOLOGY], prefix=topic_prefix)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and _health(port) != 200:
            time.sleep(0.2)
        assert _health(port) == 200, log.read_text()[-3000:]
        codec = AvroCodec()
        xids = [codec.decode(m.value()).record for m in read_all(kafka, topic_prefix + topics.XID, expect=1)]
        assert [(x["kind"], x["xid"]) for x in xids] == [("xid", 79)]
        assert read_all(kafka, topic_prefix + topics.SAMPLES, expect=1, timeout_s=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            stop_group(proc)
    text = log.read_text()
    assert "Unknown topic" not in text and "UNKNOWN_TOPIC" not in text, text[-3000:]
    assert _spool_records(tmp_path) == 0


def test_a_node_agent_stopped_before_its_topics_exist_counts_what_it_keeps(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    # The final line said "0 XIDs kept in the spool" while the spool held them (it counted only what
    # librdkafka purged). It now counts the spool.
    port = free_port()
    proc = _nvml_agent(kafka, topic_prefix, tmp_path, port)
    log = tmp_path / "agent.log"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and _starting_body(port) is None:
            time.sleep(0.1)
        _write_xid(tmp_path, proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _spool_records(tmp_path) < 1:
            time.sleep(0.1)
        time.sleep(3.0)  # long enough for a record sent to the missing topic to have failed
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            stop_group(proc)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert "XIDs kept in the spool" in text, text[-3000:]
    assert "1 XIDs kept in the spool for the next start" in text, text[-3000:]
    assert _spool_records(tmp_path) == 1
    assert "Unknown topic" not in text and "UNKNOWN_TOPIC" not in text, text[-3000:]
