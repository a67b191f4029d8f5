"""`gpupipe lake write` on a catalog that lost a table its consumer group shows it wrote: one line and
exit 2, never a silent rewrite; with --rebuild-catalog it rewrites the table from Kafka and says
which offsets Kafka's retention already deleted."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.kafka.admin import ensure_topics
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.lake_records import end_pyiceberg_threads, fill

pytestmark = pytest.mark.integration

SENT, DELETED, COMMITTED = 6, 4, 6  # records produced, then deleted by "retention", group's offset


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


def writer(kafka: str, prefix: str, tmp: Path, *more: str) -> subprocess.Popen[str]:
    return hygiene.popen(
        [
            *GPUPIPE,
            "lake",
            "write",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--tables",
            "xid_events",
            "--group-id",
            f"{prefix}lake",
            "--catalog-uri",
            f"sqlite:///{tmp}/catalog.db",
            "--warehouse",
            str(tmp / "warehouse"),
            "--flush-interval",
            "200ms",
            "--log-format",
            "text",
            *more,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
    )


def test_a_lost_catalog_is_refused_then_rebuilt_saying_what_kafka_lost(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    topic = topic_prefix + "gpu.xid.v1"
    ensure_topics(kafka, ["gpu.xid.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    enc = AvroCodec().encoder("XidEvent")
    p = Producer({"bootstrap.servers": kafka})
    for i in range(SENT):
        p.produce(topic, enc.encode(fill("XidEvent", event_id=f"e{i}")), partition=0)
    assert p.flush(30) == 0
    # An earlier writer of this group got to the end (its table and catalog since lost) ...
    c = Consumer({"bootstrap.servers": kafka, "group.id": f"{topic_prefix}lake"})
    c.commit(offsets=[TopicPartition(topic, 0, COMMITTED)], asynchronous=False)
    c.close()
    # ... and retention has deleted the oldest records since.
    admin = AdminClient({"bootstrap.servers": kafka})
    deleting = admin.delete_records(
        [TopicPartition(topic, 0, DELETED)], request_timeout=30, operation_timeout=30
    )
    for fut in deleting.values():
        fut.result(60)

    proc = writer(kafka, topic_prefix, tmp_path)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        hygiene.stop_group(proc)
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if "error:" in ln]  # after the start-up's log lines
    assert "gpupipe.xid_events" in line and "--rebuild-catalog" in line
    assert f"[0] offsets 0 to {DELETED - 1} (group at {COMMITTED})" in line

    proc = writer(kafka, topic_prefix, tmp_path, "--rebuild-catalog")
    cat = SqlCatalog(
        "gpupipe", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=(tmp_path / "warehouse").as_uri()
    )
    try:
        deadline = time.monotonic() + 120
        rows = 0
        while time.monotonic() < deadline and proc.poll() is None:
            if cat.table_exists(("gpupipe", "xid_events")):
                rows = cat.load_table(("gpupipe", "xid_events")).scan().to_arrow().num_rows
                if rows == SENT - DELETED:
                    break
            time.sleep(0.2)
        assert rows == SENT - DELETED, "what Kafka still holds is rewritten"
    finally:
        hygiene.stop_group(proc, timeout=30)
    out, _ = proc.communicate(timeout=30)
    rebuilt = [ln for ln in out.splitlines() if "lake table lost, rebuilding it from Kafka" in ln]
    assert rebuilt and f"[0] offsets 0 to {DELETED - 1} (group at {COMMITTED})" in rebuilt[0], out
