"""An XID written while no alerts instance leads, on XID partitions no instance has committed yet.

As the chart runs the HA pair (no ``--from-beginning``), a partition without a committed offset starts
at the first record at or after the instance's own process start (gpupipe/kafka/group_start.py). An
XID partition stayed uncommitted until it carried a record, which on a healthy fleet can be for ever,
so an instance started after the leader died skipped every XID of the gap. Found by the staging drill
(docs/staging.md); test_ha.py runs with ``--from-beginning`` and so did not see it. The start position
is now committed when a fresh partition is assigned (consumers/plumbing/consume_loop.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from gpupipe.kafka import topics
from gpupipe_consumers.alerts.leader import LEASE_TOPIC
from tests import hygiene
from tests.conftest import REPO, free_port
from tests.integration.consumers.alerts.test_service import (
    TopicReader,
    _topics,
    produce,
    wait_until,
    xid_event,
)
from tests.integration.kafka_util import GPUPIPE

pytestmark = pytest.mark.integration


def _alerts(kafka: str, prefix: str, tmp: Path, instance: str) -> tuple[subprocess.Popen[bytes], int]:
    """``gpupipe alerts --ha`` with the chart's start position (no --from-beginning)."""
    port = free_port()
    cmd = [*GPUPIPE, "alerts", "--bootstrap-servers", kafka, "--topic-prefix", prefix]
    cmd += ["--group-id", f"g-{prefix}", "--listen", f"127.0.0.1:{port}", "--instance-id", instance]
    cmd += ["--ha", "--ha-session-timeout", "6s", "--no-health-signals", "--log-format", "text"]
    with (tmp / f"{instance}.log").open("wb") as out:
        return hygiene.popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT), port


def _committed(kafka: str, group: str, topic: str) -> list[tuple[int, str | None]]:
    """The group's committed (offset, metadata) per partition of ``topic`` (-1001: none)."""
    c = Consumer({"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        got = c.committed([TopicPartition(topic, p) for p in sorted(parts)], timeout=10)
        return [(tp.offset, tp.metadata) for tp in got]
    finally:
        c.close()


def _role(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return str(json.loads(r.read())["role"])
    except OSError:
        return "down"


def test_an_xid_written_while_no_instance_leads_is_alerted(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    t = _topics(kafka, topic_prefix)
    a, port_a = _alerts(kafka, topic_prefix, tmp_path, "a")
    b = None
    try:
        wait_until(lambda: _role(port_a) == "leader", 60, "a leading")
        # Both records of where the group starts reach the broker while a leads: its start in the
        # leader group's commit on the lease partition, and each quiet XID partition's start position
        # in the input group (committed when assigned: before the fix, never, on a quiet partition).
        lease = topics.with_prefix(topic_prefix, LEASE_TOPIC)
        wait_until(lambda: _committed(kafka, f"g-{topic_prefix}-leader", lease)[0][1], 30, "the lease mark")
        wait_until(
            lambda: all(off >= 0 for off, _ in _committed(kafka, f"g-{topic_prefix}", t[topics.XID])),
            30,
            "the XID partitions' start positions",
        )
        hygiene.stop_group(a, signal.SIGKILL, timeout=1)
        xid = xid_event("node-a", "0000:18:00", 79, int(time.time() * 1000))
        produce(kafka, t[topics.XID], "XidEvent", [xid])
        b, port_b = _alerts(kafka, topic_prefix, tmp_path, "b")
        wait_until(lambda: _role(port_b) == "leader", 60, "b taking over")
        reader = TopicReader(kafka, t[topics.ALERTS])
        try:
            wait_until(lambda: any(r["hostname"] == "node-a" for r in reader.poll()), 30, "the gap's XID")
        finally:
            reader.close()
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                hygiene.stop_group(p)
