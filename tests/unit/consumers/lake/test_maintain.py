"""`gpupipe lake maintain` on a real SQLite catalog: closed days compacted to one file per
partition with every row kept, old snapshots expired, and the offsets still resume exactly once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe_consumers.lake.maintain import Policy, maintain
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table, stored_offsets
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.lake_records import end_pyiceberg_threads, fill

TOPIC = "gpu.xid.v1"
SPEC = BY_NAME["xid_events"]
DAY0 = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def cat(tmp_path: Path) -> SqlCatalog:
    (tmp_path / "wh").mkdir()
    return SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=(tmp_path / "wh").as_uri())


def write_small_commits(
    cat: SqlCatalog, partitions: tuple[int, ...] = (0, 1), commits: int = 6, first: int = 0
) -> None:
    """Two days of XIDs in many small commits (one per batch), offsets per partition; a writer
    holding only ``partitions`` (the others revoked, as after a rebalance)."""
    w = LakeWriter({TOPIC: (SPEC, open_table(cat, "gpupipe", SPEC))}, CollectorRegistry(), flush_rows=10**6)
    base = w.resume([(TOPIC, 0), (TOPIC, 1)])
    w.on_revoke([(TOPIC, p) for p in range(2) if p not in partitions])
    n = first
    for c in range(commits):
        recs = []
        for p in partitions:
            for i in range(5):
                ts = int((DAY0 + timedelta(hours=8 * c + i)).timestamp() * 1000)
                recs.append(
                    InRecord(
                        TOPIC,
                        p,
                        base.get((TOPIC, p), 0) + c * 5 + i,
                        None,
                        "XidEvent",
                        fill("XidEvent", event_id=f"e{n}", timestamp_ms=ts),
                        ts,
                    )
                )
                n += 1
        w.handle(recs)
        w.flush()


def keys(cat: SqlCatalog) -> Counter[str]:
    data = cat.load_table(("gpupipe", "xid_events")).scan(selected_fields=("event_id",)).to_arrow()
    return Counter(data.column("event_id").to_pylist())


def files(cat: SqlCatalog) -> int:
    return sum(1 for _ in cat.load_table(("gpupipe", "xid_events")).scan().plan_files())


def test_closed_days_are_compacted_and_offsets_survive(cat: SqlCatalog) -> None:
    write_small_commits(cat)
    before_rows, before_files = keys(cat), files(cat)
    table = cat.load_table(("gpupipe", "xid_events"))
    offsets = stored_offsets(table, TOPIC)
    assert offsets == {0: 30, 1: 30}
    # The first day ended more than a day before "now"; the second did not (still written to).
    now = DAY0 + timedelta(days=2, hours=1)
    report = maintain(table, SPEC, Policy(compact_after=timedelta(days=1), min_files=2), now)
    assert report.days_compacted == 1
    assert keys(cat) == before_rows and set(before_rows.values()) == {1}
    assert files(cat) < before_files
    day1 = datetime(2026, 11, 1, tzinfo=UTC)
    tasks = [
        t
        for t in cat.load_table(("gpupipe", "xid_events")).scan().plan_files()
        if t.file.partition[0] == (day1 - datetime(1970, 1, 1, tzinfo=UTC)).days
    ]
    assert len(tasks) == 1
    table = cat.load_table(("gpupipe", "xid_events"))
    assert stored_offsets(table, TOPIC) == offsets
    # A writer started after the compaction resumes where the last one stopped.
    w = LakeWriter({TOPIC: (SPEC, table)}, CollectorRegistry())
    assert w.resume([(TOPIC, 0), (TOPIC, 1)]) == {(TOPIC, 0): 30, (TOPIC, 1): 30}


def test_expiry_keeps_the_snapshots_that_carry_offsets(cat: SqlCatalog) -> None:
    write_small_commits(cat, commits=3)
    write_small_commits(cat, partitions=(1,), commits=3, first=30)  # a writer holding partition 1 only
    table = cat.load_table(("gpupipe", "xid_events"))
    assert len(table.snapshots()) == 6
    now = datetime.now(UTC) + timedelta(days=30)  # every snapshot is old
    report = maintain(table, SPEC, Policy(expire_after=timedelta(days=7), min_files=10**6), now)
    table = cat.load_table(("gpupipe", "xid_events"))
    # Kept: the current snapshot back to partition 0's last commit (the resume follows parents).
    assert report.snapshots_expired == 2
    assert len(table.snapshots()) == 4
    assert stored_offsets(table, TOPIC) == {0: 15, 1: 30}
    assert sum(keys(cat).values()) == 45


def test_samples_compact_per_day_and_node_bucket(cat: SqlCatalog) -> None:
    spec, topic = BY_NAME["samples"], "gpu.samples.v1"
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    fleet = SimulatedFleet(FleetConfig(nodes=4, gpus_per_node=2, interval_ms=600_000))
    w = LakeWriter({topic: (spec, open_table(cat, "gpupipe", spec))}, CollectorRegistry(), flush_rows=10**6)
    offset = 0
    t0 = int(DAY0.timestamp() * 1000)
    for c in range(4):  # four commits, each across both days
        recs = []
        for day in range(2):
            for s in fleet.tick(t0 + day * 86_400_000 + c * 600_000)[0]:
                recs.append(
                    InRecord(topic, 0, offset, None, "GpuSample", codec.decode(enc.encode(s)).record, 0)
                )
                offset += 1
        w.handle(recs)
        w.flush()
    table = cat.load_table(("gpupipe", "samples"))
    before = table.scan(selected_fields=("uuid", "timestamp_ms")).to_arrow().sort_by("timestamp_ms")
    report = maintain(table, spec, Policy(min_files=2), DAY0 + timedelta(days=2, hours=1))
    assert report.days_compacted == 1
    table = cat.load_table(("gpupipe", "samples"))
    after = table.scan(selected_fields=("uuid", "timestamp_ms")).to_arrow().sort_by("timestamp_ms")
    assert sorted(after.to_pylist(), key=str) == sorted(before.to_pylist(), key=str)
    day0 = (DAY0 - datetime(1970, 1, 1, tzinfo=UTC)).days
    per_part = Counter(
        tuple(t.file.partition) for t in table.scan().plan_files() if t.file.partition[0] == day0
    )
    assert per_part and set(per_part.values()) == {1}  # one file per (day, node bucket)
    assert stored_offsets(table, topic) == {0: offset}
