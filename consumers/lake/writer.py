"""Records to Iceberg commits, exactly once: the Kafka offsets travel inside each table snapshot.

Each table commit (an Iceberg append) carries, in its snapshot summary, the next offset to read of
every partition of its topic this writer holds: ``gpupipe.offsets.<topic>.<partition>``. The row
data and the offsets are then one atomic catalog commit, and a restart starts each partition at
the offset its table says (``ConsumeLoop(resume=...)``), never at the consumer group's: a kill -9
before the commit reads the batch again, after it goes on after it; no row is lost or written twice.
The group's offsets are still committed, for lag dashboards only.

Rows are buffered and committed every ``flush_rows`` rows or ``flush_interval_s`` per table: an
Iceberg commit writes a metadata file, a manifest list and one data file per partition touched, so
committing every consumed batch would bury the table in small files. Memory is bounded too: once
the buffers of all tables hold ``buffer_bytes``, the largest are committed early. A row is counted
as its Kafka value's size plus what its table's first row took beyond that as a Python dict (one
deep measure per table, then a ``len()`` per row).

A failed commit is retried; an uncertain one (the catalog may have committed before the error, as a
REST catalog can) is settled by reading the offsets back: committed if the table has them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prometheus_client import CollectorRegistry, Counter, Histogram
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    NamespaceAlreadyExistsError,
    NoSuchNamespaceError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform, Transform

from gpupipe.common.errors import ConfigError
from gpupipe.common.logs import fields
from gpupipe_consumers.lake.arrow import build_schema, storage_schema, to_arrow
from gpupipe_consumers.lake.tables import LakeTable
from gpupipe_consumers.lake.version_hint import write_version_hint
from gpupipe_consumers.plumbing.consume_loop import InRecord, Rejected

log = logging.getLogger("gpupipe.lake")

OFFSET_PREFIX = "gpupipe.offsets."


def offset_key(topic: str, partition: int) -> str:
    return f"{OFFSET_PREFIX}{topic}.{partition}"


def _transform(name: str) -> Transform[Any, Any]:
    if name == "day":
        return DayTransform()
    if name == "identity":
        return IdentityTransform()
    if name.startswith("bucket[") and name.endswith("]"):
        return BucketTransform(int(name[len("bucket[") : -1]))
    raise ValueError(f"unknown partition transform {name!r}")


def load_table(catalog: Catalog, namespace: str, spec: LakeTable) -> Table | None:
    """The table, or None when the catalog has none; one it cannot read is a ConfigError (one line).

    A truncated or otherwise damaged metadata file fails in pyiceberg's parser with a many-line
    pydantic error: the line keeps its first words and says what to do."""
    try:
        return catalog.load_table((namespace, spec.name))
    except (NoSuchTableError, NoSuchNamespaceError):
        return None
    except Exception as exc:  # the catalog's or the metadata's fault, of many kinds
        why = " ".join(w for w in str(exc).split("For further information")[0].split())
        raise ConfigError(
            f"cannot read lake table {namespace}.{spec.name} from the catalog: "
            f"{type(exc).__name__}: {why[:300]}; its metadata file may be damaged: restore it or "
            f"the catalog from a backup"
        ) from exc


def open_table(catalog: Catalog, namespace: str, spec: LakeTable) -> Table:
    """Load the table, creating it (schema and partition spec in one commit) or adding new columns.

    New Avro fields become new optional columns (``union_by_name``); a column is never dropped or
    retyped here, as Avro's compatibility rules never ask for that on a topic. Whether a missing
    table may be created is the caller's to decide first (:mod:`gpupipe_consumers.lake.recovery`)."""
    with contextlib.suppress(NamespaceAlreadyExistsError):
        catalog.create_namespace(namespace)
    ident = (namespace, spec.name)
    store = storage_schema(spec)
    table = load_table(catalog, namespace, spec)
    if table is None:
        try:
            with (
                catalog.create_table_transaction(
                    ident,
                    schema=store,
                    properties={"gpupipe.record": spec.record, "gpupipe.topic": spec.topic},
                ) as tx,
                tx.update_spec() as upd,
            ):
                for column, transform in spec.partition:
                    name = f"{column}_{transform.split('[')[0]}"
                    upd.add_field(column, _transform(transform), name)
            log.info("lake table created", extra=fields(table=f"{namespace}.{spec.name}"))
        except TableAlreadyExistsError:  # another writer created it meanwhile
            pass
        table = catalog.load_table(ident)
        write_version_hint(table)
        return table
    have = set(table.schema().column_names)
    missing = [f.name for f in store if f.name not in have]
    if missing:
        with table.update_schema() as upd:
            upd.union_by_name(store)
        log.info("lake table evolved", extra=fields(table=f"{namespace}.{spec.name}", added=missing))
        table = catalog.load_table(ident)
        write_version_hint(table)
    return table


def stored_offsets(table: Table, topic: str) -> dict[int, int]:
    """Next offset per partition of ``topic`` as committed in the table (empty for a new table).

    Walks from the current snapshot to its ancestors and takes each partition's newest value: a
    snapshot without offsets (a compaction, an expiry's rewrite) or one written by a writer holding
    other partitions does not hide the older ones."""
    out: dict[int, int] = {}
    prefix = f"{OFFSET_PREFIX}{topic}."
    snap = table.current_snapshot()
    seen: set[int] = set()
    while snap is not None and snap.snapshot_id not in seen:
        seen.add(snap.snapshot_id)
        props = snap.summary.additional_properties if snap.summary is not None else {}
        for k, v in props.items():
            if k.startswith(prefix):
                part = k[len(prefix) :]
                if part.isdigit():
                    out.setdefault(int(part), int(v))
        if snap.parent_snapshot_id is None:
            break
        snap = table.snapshot_by_id(snap.parent_snapshot_id)
    return out


def deep_size(obj: object) -> int:
    """Bytes a decoded record takes in memory: its containers and the values in them, recursively.

    Keys are not counted: they are the schema's field names, one string shared by every row."""
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(v) for v in obj.values())
    elif isinstance(obj, list | tuple):
        size += sum(deep_size(v) for v in obj)
    return size


class LakeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rows = Counter(
            "gpupipe_lake_rows", "Rows committed to lake tables.", ["table"], registry=registry
        )
        self.commits = Counter("gpupipe_lake_commits", "Iceberg commits.", ["table"], registry=registry)
        self.failures = Counter(
            "gpupipe_lake_commit_failures",
            "Iceberg commits that failed and are tried again.",
            ["table"],
            registry=registry,
        )
        self.seconds = Histogram(
            "gpupipe_lake_commit_duration_seconds",
            "Time to build and commit one table's buffered rows.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )


@dataclass
class _Buffer:
    rows: list[dict[str, Any]] = field(default_factory=list)
    upto: dict[int, int] = field(default_factory=dict)  # partition -> next offset once these are in
    since: float = 0.0  # monotonic time of the first buffered row
    nbytes: int = 0  # estimated memory of the rows (see the module docstring)


class LakeWriter:
    """The consume loop's handler: buffers decoded records per topic and commits them with offsets."""

    def __init__(
        self,
        tables: Mapping[str, tuple[LakeTable, Table]],  # full topic name -> (spec, table)
        registry: CollectorRegistry,
        *,
        flush_rows: int = 50_000,
        flush_interval_s: float = 30.0,
        buffer_bytes: int | None = None,  # None: bounded by flush_rows alone (the CLI always sets it)
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tables = dict(tables)
        self.flush_rows, self.flush_interval_s, self.retry_s = flush_rows, flush_interval_s, retry_s
        self.buffer_bytes = buffer_bytes
        #: per topic: what a row takes in memory beyond its Kafka value (measured on its first row)
        self._row_overhead: dict[str, int] = {}
        self.clock = clock
        self.metrics = LakeMetrics(registry)
        self._build = {t: build_schema(spec) for t, (spec, _) in self.tables.items()}
        self._store = {t: storage_schema(spec) for t, (spec, _) in self.tables.items()}
        self._buffers: dict[str, _Buffer] = {t: _Buffer() for t in self.tables}
        self._committed: dict[str, dict[int, int]] = {
            t: stored_offsets(table, t) for t, (_, table) in self.tables.items()
        }
        self._lock = threading.RLock()
        self.stop = threading.Event()
        self.rows_written = 0
        self.commits = 0
        self.last_commit = clock()
        #: the last commit error while commits fail, else None (reported in /healthz)
        self.failing: str | None = None
        # What /healthz reads, published by the thread holding the lock (one attribute store each,
        # atomic): a probe never waits for the lock, which a commit retried for minutes holds.
        self._rows_buffered = 0
        self._bytes_buffered = 0
        self._oldest_since: float | None = None
        #: True while commits run: the rows published as buffered may be landing in their tables
        #: (``rows_written`` grows, and the buffered figure drops, once each commit is done)
        self.committing = False

    # -- where to start ------------------------------------------------------------------
    def resume(self, partitions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Next offset of each newly assigned partition from its table (missing: from the beginning).

        Called on every assignment: after a rebalance another writer may have committed since."""
        with self._lock:
            out: dict[tuple[str, int], int] = {}
            for topic in {t for t, _ in partitions}:
                if topic not in self.tables:
                    continue
                spec, table = self.tables[topic]
                table = table.refresh()
                self.tables[topic] = (spec, table)
                stored = stored_offsets(table, topic)
                self._committed[topic].update(stored)
                out.update({(topic, p): stored[p] for t, p in partitions if t == topic and p in stored})
            log.info(
                "lake offsets resumed", extra=fields(offsets={f"{t}[{p}]": o for (t, p), o in out.items()})
            )
            return out

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        pass

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        """Commit what is buffered before the partitions go: the next owner starts at the tables' offsets."""
        self.flush()
        with self._lock:
            for t, p in partitions:
                self._committed.get(t, {}).pop(p, None)

    # -- writing -------------------------------------------------------------------------
    def handle(self, records: Sequence[InRecord]) -> Sequence[Rejected] | None:
        with self._lock:
            now = self.clock()
            for r in records:
                buf = self._buffers.get(r.topic)
                if buf is None:
                    continue
                if not buf.rows:
                    buf.since = now
                row = dict(r.value)
                row["_kafka_partition"] = r.partition
                row["_kafka_offset"] = r.offset
                row["_kafka_timestamp"] = r.kafka_ts_ms
                buf.rows.append(row)
                buf.nbytes += self._row_bytes(r, row)
                buf.upto[r.partition] = max(buf.upto.get(r.partition, 0), r.offset + 1)
            due = [t for t, b in self._buffers.items() if len(b.rows) >= self.flush_rows]
            full = self.buffer_bytes is not None and sum(b.nbytes for b in self._buffers.values()) >= (
                self.buffer_bytes
            )
            self.committing = bool(due or full)  # before the rows show: see ``committing``
            self._publish()
            try:
                for topic in due:
                    self._flush_topic(topic)
                if self.buffer_bytes is not None:
                    # largest first: the fewest (and biggest, least fragmented) early commits
                    for topic in sorted(self._buffers, key=lambda t: -self._buffers[t].nbytes):
                        if self._bytes_buffered < self.buffer_bytes:
                            break
                        log.debug("lake buffer full", extra=fields(topic=topic, bytes=self._bytes_buffered))
                        self._flush_topic(topic)
            finally:
                self.committing = False
        self.flush_due()
        return None

    def flush_due(self) -> None:
        """Commit every table whose oldest buffered row waited ``flush_interval_s`` (timer thread too)."""
        with self._lock:
            now = self.clock()
            self._flush_each(
                [t for t, b in self._buffers.items() if b.rows and now - b.since >= self.flush_interval_s]
            )

    def flush(self) -> None:
        with self._lock:
            self._flush_each([t for t, b in self._buffers.items() if b.rows])

    def _flush_each(self, topics: Sequence[str]) -> None:
        if not topics:
            return
        self.committing = True
        try:
            for topic in topics:
                self._flush_topic(topic)
        finally:
            self.committing = False

    @property
    def buffered(self) -> int:
        """Rows buffered, as of the last change (read without the lock: see ``_publish``)."""
        return self._rows_buffered

    def oldest_buffered_s(self) -> float:
        """How long the oldest buffered row has waited (without the lock: see ``_publish``)."""
        since = self._oldest_since
        return 0.0 if since is None else self.clock() - since

    @property
    def buffered_bytes(self) -> int:
        """Estimated memory of the buffered rows (without the lock: see ``_publish``)."""
        return self._bytes_buffered

    def _row_bytes(self, r: InRecord, row: dict[str, Any]) -> int:
        """A row's estimated memory: its Kafka value's size plus its table's per-row overhead."""
        raw = r.raw.value() if r.raw is not None else None
        value = len(raw) if raw is not None else 0
        overhead = self._row_overhead.get(r.topic)
        if overhead is None:
            overhead = self._row_overhead[r.topic] = max(0, deep_size(row) - value)
        return value + overhead

    def _publish(self) -> None:
        """Store the figures /healthz reads; called with the lock held after the buffers change."""
        bufs = [b for b in self._buffers.values() if b.rows]
        self._rows_buffered = sum(len(b.rows) for b in bufs)
        self._bytes_buffered = sum(b.nbytes for b in bufs)
        self._oldest_since = min((b.since for b in bufs), default=None)

    def _flush_topic(self, topic: str) -> None:
        """One Iceberg append of the topic's buffer with the offsets it reaches; retried until done.

        Returns without committing only when ``stop`` is set: the rows are then read again after
        the restart, from the offsets the table has."""
        spec, table = self.tables[topic]
        buf = self._buffers[topic]
        began = time.perf_counter()
        data = to_arrow(buf.rows, self._build[topic], self._store[topic])
        offsets = {**self._committed[topic], **buf.upto}
        props = {offset_key(topic, p): str(o) for p, o in sorted(offsets.items())}
        while True:
            try:
                table.append(data, snapshot_properties=props)
                break
            except Exception as exc:  # catalog, storage or conflict: settle, then retry
                self.metrics.failures.labels(spec.name).inc()
                self.failing = f"{type(exc).__name__}: {exc}"
                log.error("lake commit failed", extra=fields(table=spec.name, error=self.failing))
                table, landed = self._settle(topic, spec, table, buf.upto)
                if landed:
                    break
                if self.stop.wait(self.retry_s):
                    return
        write_version_hint(table)
        self.tables[topic] = (spec, table)
        self._committed[topic] = offsets
        n = len(buf.rows)
        self._buffers[topic] = _Buffer()
        self._publish()
        self.rows_written += n  # after: written + buffered (read unlocked) never exceeds what was read
        self.commits += 1
        self.failing = None
        self.last_commit = self.clock()
        self.metrics.rows.labels(spec.name).inc(n)
        self.metrics.commits.labels(spec.name).inc()
        self.metrics.seconds.observe(time.perf_counter() - began)
        log.debug("lake commit", extra=fields(table=spec.name, rows=n))

    def _settle(
        self, topic: str, spec: LakeTable, table: Table, upto: Mapping[int, int]
    ) -> tuple[Table, bool]:
        """After a failed append: the refreshed table, and whether the append landed after all."""
        try:
            table = table.refresh()
        except Exception:
            return table, False
        stored = stored_offsets(table, topic)
        return table, all(stored.get(p, -1) >= o for p, o in upto.items())


def as_arrow(writer: LakeWriter, topic: str) -> pa.Table:
    """The buffered rows of ``topic`` as they would be committed (tests and the benchmark)."""
    with writer._lock:
        return to_arrow(writer._buffers[topic].rows, writer._build[topic], writer._store[topic])
