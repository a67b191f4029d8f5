"""Corrections grouped by *runs* of late records: the same input always gives the same corrections.

A late sample (its window already closed) goes into a ``kind=correction`` record. Grouped per
commit, a re-processing run (an offset reset), which commits at other moments, would group the
same late samples differently; the report recognises a correction whose samples were all counted
already, but one that straddles the earlier run's end (some samples counted by it, some it never
reached) would be kept whole and its counted part billed twice.

So a correction sums the late samples of one row (window, namespace, node, model) within one
*run*: consecutive late records of the partition, in offset order, and the run ends where the
input alone says so:

* before a record whose window is open (an on-time record);
* before a record whose Kafka timestamp is ``gap_ms`` or more after the previous record's (the
  partition was quiet: see the idle flush below);
* before a record in another block of ``BLOCK`` offsets than the run's first (bounds how far back
  a pending run holds the checkpoint).

A run's corrections are emitted only once it has ended, so any run over the same input emits the
same corrections, with the same ``record_id`` and ``late_offsets``, and the report drops the copies;
the run pending when an earlier run stopped was never emitted by it, so it is new. The pending run
is state like an open window: the checkpoint stays at or before its first record (and the references
its samples were measured against), and the commit metadata carries its first offset (``lr``), so
that a replay folds the records from there on again (every record from there to the checkpointed
position was late, which is why an on-time record ends a run) and skips the late ones before it.

A partition that goes quiet with a run pending would never emit it. When the partition is idle
(``--idle-timeout``, caught up), the run is ended there if broker time is ``gap_ms`` +
``IDLE_MARGIN_MS`` past the last record's timestamp: the next record, appended later, is then at
least ``gap_ms`` after it, so a re-processing run ends the run at the same place (with
LogAppendTime; with CreateTime the producers' clocks decide, which they mostly do alike).
"""

from __future__ import annotations

from gpupipe_consumers.chargeback.accounting import Contribution
from gpupipe_consumers.chargeback.records import GpuTimeAggregate, RowKey

GAP_MS = 60_000
"""Default quiet time (in record timestamps) that ends a run of late records."""

IDLE_MARGIN_MS = 30_000
"""How much further broker time must be before an idle partition's pending run is ended."""

BLOCK = 10_000
"""A run never spans two blocks of this many input offsets."""

Ended = tuple[RowKey, GpuTimeAggregate, list[int]]


class LateRun:
    """The late records of one partition: the pending run, and the ended runs not polled yet."""

    __slots__ = ("anchor", "ended", "gap_ms", "last_ts", "offsets", "rows", "start")

    def __init__(self, gap_ms: int = GAP_MS) -> None:
        self.gap_ms = gap_ms
        self.rows: dict[RowKey, GpuTimeAggregate] = {}
        self.offsets: dict[RowKey, list[int]] = {}  # input offsets of each row's late samples
        self.start: int | None = None  # offset of the pending run's first late sample
        self.anchor: int | None = None  # oldest offset the pending run's samples depend on
        self.ended: list[Ended] = []
        self.last_ts: int | None = None  # Kafka timestamp of the partition's previous record

    def before(self, offset: int, record_ts_ms: int | None) -> None:
        """Every record, before it is accounted: end the pending run if one ends before it."""
        if self.start is not None and (
            offset // BLOCK != self.start // BLOCK
            or (
                record_ts_ms is not None
                and self.last_ts is not None
                and record_ts_ms - self.last_ts >= self.gap_ms
            )
        ):
            self.end()
        if record_ts_ms is not None:
            self.last_ts = record_ts_ms

    def fold(
        self, start_ms: int, contribs: tuple[Contribution, ...], offset: int, depends_on: int | None
    ) -> None:
        """A late record's contributions (to the closed window starting at ``start_ms``)."""
        if not contribs:
            return
        if self.start is None:
            self.start = offset
        anchor = offset if depends_on is None else min(offset, depends_on)
        self.anchor = anchor if self.anchor is None else min(self.anchor, anchor)
        for c in contribs:
            rk = (start_ms, c.namespace, c.node, c.gpu_model)
            agg = self.rows.get(rk)
            if agg is None:
                agg = self.rows[rk] = GpuTimeAggregate()
            agg.add(c)
            offsets = self.offsets.setdefault(rk, [])
            if not offsets or offsets[-1] != offset:  # ascending: records come in offset order
                offsets.append(offset)

    def end(self) -> None:
        """End the pending run: its corrections go out at the next poll."""
        self.ended.extend((rk, self.rows[rk], self.offsets[rk]) for rk in sorted(self.rows))
        self.rows, self.offsets = {}, {}
        self.start = self.anchor = None

    def end_if_quiet(self, broker_ms: int) -> bool:
        """The idle flush (see the module docstring); True if a run was ended."""
        if self.start is None:
            return False
        if self.last_ts is not None and broker_ms - self.last_ts < self.gap_ms + IDLE_MARGIN_MS:
            return False
        self.end()
        return True

    def take(self) -> list[Ended]:
        out, self.ended = self.ended, []
        return out
