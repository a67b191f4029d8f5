"""Stream ChargebackWindow records from Kafka for a report, in bounded memory.

``gpu.chargeback.v1`` holds 400 days (about 10^8 records for a 10k-GPU fleet): records are
yielded one by one, never listed, and a report with a
``--from`` starts each partition at ``offsets_for_times(from - margin)``: a record is emitted after
its window started (in wall-clock time, give or take the bounded clock skew), so nothing of the
range lies before that offset. Records come with their Kafka timestamp (wall-clock emission time),
which the de-duplication below uses to forget keys that can no longer repeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gpupipe_consumers.plumbing.topic_reader import iter_topic
from gpupipe_consumers.report.chargeback_report import RECORDED_AT
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.validate import violation

SEEK_MARGIN_MS = 86_400_000
"""How far before ``--from`` reading starts: covers emission delay, clock skew and slow commits."""

DEDUP_HORIZON_MS = 5 * 86_400_000
"""A record can only be emitted again while its input is retained (gpu.samples.v1 keeps 3 days):
once every partition has been read past a window's end plus this, its keys are forgotten."""


def read_from_ms(since_ms: int | None, *, billing: bool = False) -> int | None:
    """Where a report of records from ``since_ms`` on starts reading (by Kafka timestamp).

    A report by window start reads from ``since_ms`` less ``SEEK_MARGIN_MS``: every record of a
    window in range, the first emission and any copy, was written after the window started. In
    billing mode (the FOCUS export) a record written after its month was invoiced is billed in a
    later month, so a copy re-emitted by a reprocess (an offset reset) a few days after its original
    can fall in the range while the original lies before it: a March invoice would bill a February
    window that February's invoice already billed. A copy is written within ``DEDUP_HORIZON_MS`` of
    its original (its input must still be retained), and a late record billed in the range was
    written after ``since_ms`` plus the invoice lag, so reading that horizon further back finds
    every original, and the de-duplication drops the copy. The lag only moves originals later, so
    it need not be added.
    """
    if since_ms is None:
        return None
    back = SEEK_MARGIN_MS + (DEDUP_HORIZON_MS if billing else 0)
    return max(0, since_ms - back)


def iter_chargeback_records(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    *,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    on_bad: Callable[[str], None] | None = None,
    since_ms: int | None = None,
    billing: bool = False,
) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, Kafka timestamp) of every committed record up to the end offsets seen at the start,
    from where a report of ``since_ms`` on must read (:func:`read_from_ms`)."""
    now_ms = int(time.time() * 1000)
    for rec, ts in iter_topic(
        bootstrap,
        topic,
        codec,
        "ChargebackWindow",
        since_ms=read_from_ms(since_ms, billing=billing),
        extra=extra,
        timeout_s=timeout_s,
        missing_hint="has chargeback run with this --topic-prefix?",
        on_bad=on_bad,
        group_prefix="gpupipe-report-",
    ):
        # A window out of the contract's bounds (a forged record, a writer before the bounds) would
        # break every format of the report; it is skipped with a line, like an undecodable one.
        bad = violation("ChargebackWindow", rec, ts, now_ms)
        if bad is None:
            yield rec, ts
        elif on_bad is not None:
            on_bad(f"{topic}: window {rec.get('record_id') or '?'} out of range ({bad})")


class Deduplicator:
    """Counts each ``record_id`` once: an offset reset or a failover that re-processes
    input re-emits records with the same key. Corrections are matched by the samples they sum too
    (``late_offsets``): a re-processing run groups the same late samples into other corrections,
    with other keys, and one whose samples were all counted for its window and row is a copy.
    Memory is bounded by the keys (and late offsets) of windows that ended within ``horizon_ms`` of
    the oldest emission time still being read, not by the topic's size."""

    def __init__(self, horizon_ms: int = DEDUP_HORIZON_MS) -> None:
        self.horizon_ms = horizon_ms
        self.by_end: dict[int, set[str]] = {}
        # window end -> (source partition, window start, namespace, node, model) -> late offsets
        self.late_by_end: dict[int, dict[tuple[Any, ...], set[int]]] = {}
        self.dropped = 0
        self._low = 0  # emission time below which no record can still arrive (approximate, monotonic)
        self._seen_since_prune = 0

    def keep(self, rec: dict[str, Any], emitted_ms: int) -> bool:
        rid = rec.get("record_id")
        if rid is None:  # written before record_id existed
            return True
        end = int(rec["window_end_ms"])
        ids = self.by_end.get(end)
        if ids is None:
            ids = self.by_end[end] = set()
        elif rid in ids:
            self.dropped += 1
            return False
        late = rec.get("late_offsets")
        if late:
            row = (rec["source_partition"], rec["window_start_ms"], rec["namespace"], rec["node"])
            counted = self.late_by_end.setdefault(end, {}).setdefault((*row, rec["gpu_model"]), set())
            if counted.issuperset(late):
                self.dropped += 1
                return False
            counted.update(late)
        ids.add(rid)
        self._seen_since_prune += 1
        if self._seen_since_prune >= 10_000:
            self._prune(emitted_ms)
        return True

    def _prune(self, emitted_ms: int) -> None:
        self._seen_since_prune = 0
        # Partitions interleave, so lag the newest emission time by a day before trusting it.
        self._low = max(self._low, emitted_ms - SEEK_MARGIN_MS)
        cutoff = self._low - self.horizon_ms
        for end in [e for e in self.by_end if e < cutoff]:
            del self.by_end[end]
            self.late_by_end.pop(end, None)

    def keys_held(self) -> int:
        late = sum(len(o) for rows in self.late_by_end.values() for o in rows.values())
        return sum(len(v) for v in self.by_end.values()) + late


def deduplicated(
    records: Iterable[tuple[dict[str, Any], int]], dedup: Deduplicator | None = None
) -> Iterator[dict[str, Any]]:
    """The records of ``records`` (with their Kafka timestamps), each ``record_id`` once, each with
    its timestamp under ``RECORDED_AT``: when it was written, which bills a record written after
    its month was invoiced into a later month."""
    dedup = dedup if dedup is not None else Deduplicator()
    for rec, ts in records:
        if dedup.keep(rec, ts):
            rec[RECORDED_AT] = ts
            yield rec
