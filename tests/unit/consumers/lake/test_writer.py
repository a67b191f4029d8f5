"""The lake writer on a real SQLite catalog in tmp_path (no Kafka): offsets in snapshots, retries,
schema evolution, and the GPU-hours query by DuckDB and by pyarrow."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.lake.query import gpu_hours_by_namespace, gpu_hours_sql, load_tables, query
from gpupipe_consumers.lake.tables import BY_NAME, LakeTable
from gpupipe_consumers.lake.writer import LakeWriter, offset_key, open_table, stored_offsets
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.lake_records import end_pyiceberg_threads, fill

TOPIC = "gpu.chargeback.v1"


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def cat(tmp_path: Path) -> SqlCatalog:
    (tmp_path / "wh").mkdir()
    return SqlCatalog("t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=(tmp_path / "wh").as_uri())


def window(ns: str, hours: float, start: datetime, rid: str | None, **kw: Any) -> dict[str, Any]:
    ms = int(start.timestamp() * 1000)
    return fill(
        "ChargebackWindow",
        namespace=ns,
        allocated_gpu_seconds=hours * 3600,
        window_start_ms=ms,
        window_end_ms=ms + 3_600_000,
        record_id=rid,
        **kw,
    )


def recs(values: list[dict[str, Any]], partition: int = 0, first: int = 0) -> list[InRecord]:
    return [
        InRecord(TOPIC, partition, first + i, None, "ChargebackWindow", v, 1) for i, v in enumerate(values)
    ]


def writer(cat: SqlCatalog, spec: LakeTable = BY_NAME["chargeback_windows"], **kw: Any) -> LakeWriter:
    return LakeWriter({TOPIC: (spec, open_table(cat, "gpupipe", spec))}, CollectorRegistry(), **kw)


def test_offsets_ride_in_the_snapshot_and_resume_reads_them(cat: SqlCatalog) -> None:
    t0 = datetime(2026, 2, 3, tzinfo=UTC)
    w = writer(cat, flush_rows=3)
    w.handle(recs([window("a", 1, t0, f"r{i}") for i in range(2)], partition=0))
    assert stored_offsets(cat.load_table("gpupipe.chargeback_windows"), TOPIC) == {}  # buffered only
    w.handle(recs([window("b", 1, t0, "r9")], partition=2, first=40))  # 3 rows: one commit
    table = cat.load_table("gpupipe.chargeback_windows")
    assert stored_offsets(table, TOPIC) == {0: 2, 2: 41}
    assert table.current_snapshot().summary[offset_key(TOPIC, 2)] == "41"
    w.handle(recs([window("a", 1, t0, "r10")], partition=0, first=2))
    w.flush()
    # partition 2 is not in this batch: its offset is carried over, never lost
    assert stored_offsets(cat.load_table("gpupipe.chargeback_windows"), TOPIC) == {0: 3, 2: 41}
    fresh = writer(cat)
    assert fresh.resume([(TOPIC, 0), (TOPIC, 1), (TOPIC, 2)]) == {(TOPIC, 0): 3, (TOPIC, 2): 41}
    assert cat.load_table("gpupipe.chargeback_windows").scan().to_arrow().num_rows == 4


def test_flush_interval_commits_a_quiet_table(cat: SqlCatalog) -> None:
    now = [100.0]
    w = writer(cat, flush_rows=10**6, flush_interval_s=5, clock=lambda: now[0])
    w.handle(recs([window("a", 1, datetime(2026, 2, 3, tzinfo=UTC), "r1")]))
    w.flush_due()
    assert w.commits == 0 and w.buffered == 1
    now[0] += 5
    w.flush_due()
    assert w.commits == 1 and w.buffered == 0


class Flaky:
    """A table whose append fails ``fail`` times; with ``landed`` the first failure committed anyway."""

    def __init__(self, table: Any, fail: int, landed: bool) -> None:
        self.table, self.fail, self.landed, self.appends = table, fail, landed, 0

    def append(self, data: pa.Table, snapshot_properties: dict[str, str]) -> None:
        self.appends += 1
        if self.fail:
            self.fail -= 1
            if self.landed:
                self.table.append(data, snapshot_properties=snapshot_properties)
            raise OSError("connection reset after the request was sent")
        self.table.append(data, snapshot_properties=snapshot_properties)

    def refresh(self) -> Any:
        return self.table.refresh()  # the real table from now on


@pytest.mark.parametrize("landed", [False, True])
def test_a_failed_commit_is_retried_and_an_uncertain_one_never_doubles(cat: SqlCatalog, landed: bool) -> None:
    w = writer(cat, flush_rows=10**6, retry_s=0.01)
    spec, table = w.tables[TOPIC]
    w.tables[TOPIC] = (spec, Flaky(table, fail=1, landed=landed))  # type: ignore[assignment]
    w.handle(recs([window("a", 1, datetime(2026, 2, 3, tzinfo=UTC), f"r{i}") for i in range(5)]))
    w.flush()
    assert w.failing is None and w.metrics.failures.labels(spec.name)._value.get() == 1
    data = cat.load_table("gpupipe.chargeback_windows").scan().to_arrow()
    assert data.num_rows == 5, "a commit that landed before its error is not appended again"
    assert stored_offsets(cat.load_table("gpupipe.chargeback_windows"), TOPIC) == {0: 5}


def test_a_stop_while_commits_fail_leaves_the_rows_for_the_restart(cat: SqlCatalog) -> None:
    w = writer(cat, flush_rows=10**6, retry_s=0.01)
    spec, table = w.tables[TOPIC]
    w.tables[TOPIC] = (spec, Flaky(table, fail=10**6, landed=False))  # type: ignore[assignment]
    w.handle(recs([window("a", 1, datetime(2026, 2, 3, tzinfo=UTC), "r1")]))
    w.stop.set()
    w.flush()
    assert w.failing is not None and w.buffered == 1
    assert stored_offsets(cat.load_table("gpupipe.chargeback_windows"), TOPIC) == {}


def test_the_table_gains_columns_the_avro_schema_gains(cat: SqlCatalog) -> None:
    spec = BY_NAME["xid_events"]
    first = open_table(cat, "gpupipe", spec)
    assert "new_field" not in first.schema().column_names
    grown_avro = {
        **spec.avro(),
        "fields": [*spec.avro()["fields"], {"name": "new_field", "type": ["null", "long"], "default": None}],
    }

    class Grown(LakeTable):
        def avro(self) -> dict[str, Any]:
            return grown_avro

    grown = Grown(spec.name, spec.topic, spec.record, spec.partition, spec.key, spec.doc)
    table = open_table(cat, "gpupipe", grown)
    assert "new_field" in table.schema().column_names
    assert [f.name for f in table.spec().fields] == ["timestamp_ms_day"]  # partitioning kept


def test_gpu_hours_per_namespace_by_duckdb_and_by_pyarrow_agree(cat: SqlCatalog) -> None:
    q_start, q_end = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    rows = [
        window("vision", 2.0, datetime(2026, 1, 5, tzinfo=UTC), "r1"),
        window("vision", 2.0, datetime(2026, 1, 5, tzinfo=UTC), "r1"),  # re-emitted: counted once
        window("vision", 0.5, datetime(2026, 3, 31, 23, tzinfo=UTC), "r2", kind="correction"),
        window("nlp", 1.25, datetime(2026, 2, 1, tzinfo=UTC), None),  # no record_id: each counted
        window("nlp", 1.25, datetime(2026, 2, 1, tzinfo=UTC), None),
        window("nlp", 9.0, datetime(2026, 4, 1, tzinfo=UTC), "r3"),  # next quarter
        window("nlp", 9.0, datetime(2025, 12, 31, 23, tzinfo=UTC), "r4"),  # previous quarter
    ]
    w = writer(cat)
    w.handle(recs(rows))
    w.flush()
    tables = load_tables(cat, "gpupipe")
    want = {"nlp": 2.5, "vision": 2.5}
    assert gpu_hours_sql(tables, q_start, q_end) == pytest.approx(want, rel=1e-12)
    assert gpu_hours_by_namespace(tables["chargeback_windows"], q_start, q_end) == pytest.approx(
        want, rel=1e-12
    )
    assert query(tables, "SELECT count(*) AS n FROM chargeback_windows").column("n").to_pylist() == [7]


def test_the_byte_bound_commits_before_the_row_count_does(cat: SqlCatalog) -> None:
    spec = BY_NAME["xid_events"]
    topic = "gpu.xid.v1"
    w = LakeWriter(
        {topic: (spec, open_table(cat, "gpupipe", spec))},
        CollectorRegistry(),
        flush_rows=10**6,
        buffer_bytes=40_000,
    )
    # XIDs with 4,000-character messages (within bounds): about 5 KB each in memory
    big = [fill("XidEvent", event_id=f"e{i}", message="m" * 4000) for i in range(30)]
    for i in range(0, 30, 3):
        w.handle([InRecord(topic, 0, i + j, None, "XidEvent", v, 1) for j, v in enumerate(big[i : i + 3])])
        assert w.buffered_bytes < 40_000, "the bound holds after every batch"
    assert w.commits >= 2, "rows were committed long before 10**6 were buffered"
    rows = cat.load_table("gpupipe.xid_events").scan().to_arrow().num_rows
    assert rows + w.buffered == 30 and rows >= 20
    assert stored_offsets(cat.load_table("gpupipe.xid_events"), topic) == {0: rows}


def test_a_truncated_metadata_file_is_one_line_not_a_traceback(cat: SqlCatalog) -> None:
    spec = BY_NAME["xid_events"]
    meta = Path(open_table(cat, "gpupipe", spec).metadata_location.removeprefix("file://"))
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    with pytest.raises(ConfigError) as exc:
        open_table(cat, "gpupipe", spec)
    line = str(exc.value)
    assert "\n" not in line and "gpupipe.xid_events" in line and "Invalid JSON" in line


def test_each_commit_points_the_version_hint_at_the_current_metadata(cat: SqlCatalog, tmp_path: Path) -> None:
    """Readers without the catalog (DuckDB's ``iceberg_scan('<table dir>')``) follow the hint."""
    t0 = datetime(2026, 2, 3, tzinfo=UTC)
    hint = tmp_path / "wh" / "gpupipe" / "chargeback_windows" / "metadata" / "version-hint.text"
    w = writer(cat)
    created = cat.load_table("gpupipe.chargeback_windows").metadata_location
    assert created.endswith(f"/{hint.read_text()}.metadata.json")
    for i in range(2):
        w.handle(recs([window("a", 1, t0, f"r{i}")], first=i))
        w.flush()
        now = cat.load_table("gpupipe.chargeback_windows").metadata_location
        assert now != created
        assert now.endswith(f"/{hint.read_text()}.metadata.json")
        created = now
