"""Never lose an XID: with the broker down, XIDs spool to disk; they arrive in order when it returns."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.xid.sender import XidSender
from gpupipe_producer.xid.spool import XidSpool
from gpupipe_producer.xid.spool_format import SPOOL_FILE
from tests.conftest import BROKER_START_TIMEOUT, REPO, _free_pair
from tests.integration.kafka_util import read_all

pytestmark = pytest.mark.integration


def _producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "message.timeout.ms": 3000,
            "linger.ms": 5,
        }
    )


def test_xids_survive_a_broker_outage_and_a_restart(tmp_path: Path) -> None:
    port = _free_pair()
    bootstrap = f"127.0.0.1:{port}"
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(tmp_path / "kafka"),
        "KAFKA_PORT": str(port),
        **BROKER_START_TIMEOUT,
    }
    script = str(REPO / "scripts" / "kafka-local")
    spool_dir = tmp_path / "spool"

    # Broker down: events go to the spool, deliveries fail after the message timeout.
    p1 = _producer(bootstrap)
    sender = XidSender(p1, "xid-test", XidSpool(spool_dir), retry_after_s=0.0)
    for i in range(5):
        sender.send(b"GPU-1", f"xid-{i}".encode())
    deadline = time.monotonic() + 30
    while sender.failed_attempts < 5 and time.monotonic() < deadline:
        p1.poll(0.2)
    assert sender.failed_attempts == 5 and sender.depth == 5

    # The producer process "restarts" while the broker is still down: the spool survives.
    p1.flush(0)
    sender.spool.close()
    sender2_spool = XidSpool(spool_dir)
    assert [v for _, _, v in sender2_spool.pending()] == [f"xid-{i}".encode() for i in range(5)]

    # Broker comes back.
    out = subprocess.run(
        [script, "start", "--port", str(port)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    try:
        ensure_topics(bootstrap, ["xid-test"])
        p2 = _producer(bootstrap)
        sender2 = XidSender(p2, "xid-test", sender2_spool)  # replays the spool in order on start
        sender2.send(b"GPU-1", b"xid-5")
        deadline = time.monotonic() + 60
        while sender2.depth and time.monotonic() < deadline:
            p2.poll(0.2)
            sender2.retry_failed()
        assert sender2.depth == 0
        msgs = read_all(bootstrap, "xid-test", expect=6)
        assert [m.value() for m in msgs] == [f"xid-{i}".encode() for i in range(6)]
        assert (spool_dir / SPOOL_FILE).stat().st_size == 0
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)
