"""Reading the lake in process: DuckDB over the tables, and the pyarrow path it is checked against.

``gpupipe lake query "SQL"`` scans each table the SQL names (with pyiceberg: partition pruning
needs a filter pyiceberg understands, so the readers below pass time bounds to the scan) into Arrow
and lets DuckDB answer; nothing is copied out of the warehouse and no server runs.

"GPU-hours per namespace last quarter" is :data:`GPU_HOURS_SQL` / :func:`gpu_hours_by_namespace`:
chargeback records are additive partials, summed over partitions, instances and kinds (window and
correction), each ``record_id`` counted once as the reports do (a re-emitted record carries the
same id; records from writers older than the field are each counted).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import And, BooleanExpression, GreaterThanOrEqual, LessThan
from pyiceberg.table import Table

from gpupipe_consumers.lake.tables import TABLES

#: Per-namespace GPU-hours of the windows starting in [$start, $end) (timestamps, UTC).
GPU_HOURS_SQL = """
SELECT namespace, SUM(allocated_gpu_seconds) / 3600.0 AS gpu_hours
FROM (
    SELECT DISTINCT ON (
        COALESCE(record_id, '@' || CAST(_kafka_partition AS VARCHAR) || ':' || CAST(_kafka_offset AS VARCHAR))
    ) *
    FROM chargeback_windows
    WHERE window_start_ms >= $start AND window_start_ms < $end
)
GROUP BY namespace
ORDER BY namespace
"""


def quarter_before(now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the calendar quarter before the one ``now`` is in, UTC."""
    now = now.astimezone(UTC)
    q = (now.month - 1) // 3
    end = datetime(now.year, 3 * q + 1, 1, tzinfo=UTC)
    start = (
        datetime(end.year - 1, 10, 1, tzinfo=UTC)
        if q == 0
        else datetime(end.year, 3 * (q - 1) + 1, 1, tzinfo=UTC)
    )
    return start, end


def load_tables(catalog: Catalog, namespace: str) -> dict[str, Table]:
    """The lake tables that exist in ``namespace``, by table name."""
    have = {ident[-1] for ident in catalog.list_tables(namespace)}
    return {t.name: catalog.load_table((namespace, t.name)) for t in TABLES if t.name in have}


def _time_filter(column: str, start: datetime, end: datetime) -> BooleanExpression:
    return And(GreaterThanOrEqual(column, start.isoformat()), LessThan(column, end.isoformat()))


def query(
    tables: Mapping[str, Table],
    sql: str,
    params: Mapping[str, object] | None = None,
    row_filters: Mapping[str, BooleanExpression] | None = None,
) -> pa.Table:
    """Run ``sql`` in an in-process DuckDB over the tables it names (each scanned into Arrow).

    ``row_filters`` narrows a table's scan (pyiceberg prunes partitions and files with it)."""
    con = duckdb.connect()
    try:
        for name, table in tables.items():
            if re.search(rf"\b{re.escape(name)}\b", sql):
                flt = (row_filters or {}).get(name)
                scan = table.scan(row_filter=flt) if flt is not None else table.scan()
                con.register(name, scan.to_arrow())
        result = con.sql(sql, params=dict(params or {}))
        # duckdb 1.4 named it to_arrow_table; earlier releases call it arrow
        fetch = getattr(result, "to_arrow_table", None) or result.arrow
        return fetch()
    finally:
        con.close()


def gpu_hours_sql(tables: Mapping[str, Table], start: datetime, end: datetime) -> dict[str, float]:
    """GPU-hours per namespace of the windows starting in [start, end), by DuckDB."""
    out = query(
        tables,
        GPU_HOURS_SQL,
        {"start": start, "end": end},
        {"chargeback_windows": _time_filter("window_start_ms", start, end)},
    )
    return dict(zip(out.column("namespace").to_pylist(), out.column("gpu_hours").to_pylist(), strict=True))


def gpu_hours_by_namespace(table: Table, start: datetime, end: datetime) -> dict[str, float]:
    """The same answer with pyarrow only (no DuckDB): what a data-platform job without SQL does."""
    data = table.scan(
        row_filter=_time_filter("window_start_ms", start, end),
        selected_fields=(
            "namespace",
            "allocated_gpu_seconds",
            "record_id",
            "_kafka_partition",
            "_kafka_offset",
        ),
    ).to_arrow()
    fallback = pc.binary_join_element_wise(
        "@", pc.cast(data["_kafka_partition"], pa.string()), pc.cast(data["_kafka_offset"], pa.string()), ":"
    )
    key = pc.coalesce(data["record_id"], fallback)
    first = (
        pa.table({"key": key, "i": pa.array(range(data.num_rows), pa.int64())})
        .group_by("key")
        .aggregate([("i", "min")])
    )
    unique = data.take(first["i_min"])
    sums = unique.group_by("namespace").aggregate([("allocated_gpu_seconds", "sum")])
    return {
        ns: s / 3600.0
        for ns, s in zip(
            sums["namespace"].to_pylist(), sums["allocated_gpu_seconds_sum"].to_pylist(), strict=True
        )
    }
