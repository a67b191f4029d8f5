"""Corrections grouped by *runs* of late records: the same input always gives the same corrections.

A late sample (its window already closed) goes into a ``kind=correction`` record. Grouped per
commit, a re-processing run (an offset reset), which commits at other moments, would group the
same late samples differently; the report recognises a correction whose samples were all counted
already, but one that straddles the earlier run's end (some samples counted by it, some it never
reached) would be kept whole and its counted part billed twice.

So a correction sums the late samples of one row (window, namespace, node, model) within one
*run*: the late records of the partition, in offset order, from the first until the input alone
says the run ends:

* before a record that moves the partition's watermark into a later window than the one it was in
  when the run began (so a correction covers at most about one window of the partition's time:
  a node clock behind, or a spool replayed among live samples, is corrected per window, not per
  sample, and the checkpoint is held back no longer than an open window holds it);
* before a record whose Kafka timestamp is ``gap_ms`` or more after the previous record's (the
  partition was quiet: see the idle flush below);
* before a record in another block of ``BLOCK`` offsets than the run's first.

On-time records in between go to their open windows and do not end the run.

A run's corrections are emitted only once it has ended, so any run over the same input emits the
same corrections, with the same ``record_id`` and ``late_offsets``, and the report drops the copies;
the run pending when an earlier run stopped was never emitted by it, so it is new. The pending run
is state like an open window: the checkpoint stays at or before its first record (and the references
its samples were measured against), and the commit metadata carries its first offset (``lr``) and
the watermark when it began (``lw``). A replay folds again the records from ``lr`` on that were
late when first read: the watermark then is ``lw`` raised by the records since ``lr`` (late records
never raise it, and nothing else moves it during a run, see below); it skips the other late ones.

A partition that goes quiet with a run pending would never emit it. When the partition is idle
(``--idle-timeout``, caught up), the run is ended there if broker time is ``gap_ms`` +
``IDLE_MARGIN_MS`` past the last record's timestamp: the next record, appended later, is then at
least ``gap_ms`` after it, so a re-processing run ends the run at the same place (with
LogAppendTime; with CreateTime the producers' clocks decide, which they mostly do alike). An idle
advance of the watermark ends the pending run first, for the same reason (it follows a quiet time
longer than ``gap_ms`` with the default idle timeout).
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

    __slots__ = ("anchor", "ended", "gap_ms", "last_ts", "offsets", "rows", "start", "start_wm", "window_ms")

    def __init__(self, window_ms: int, gap_ms: int = GAP_MS) -> None:
        self.window_ms = window_ms
        self.gap_ms = gap_ms
        self.rows: dict[RowKey, GpuTimeAggregate] = {}
        self.offsets: dict[RowKey, list[int]] = {}  # input offsets of each row's late samples
        self.start: int | None = None  # offset of the pending run's first late sample
        self.start_wm: int | None = None  # the partition's watermark when the pending run began
        self.anchor: int | None = None  # oldest offset the pending run's samples depend on
        self.ended: list[Ended] = []
        self.last_ts: int | None = None  # Kafka timestamp of the partition's previous record

    def before(self, offset: int, record_ts_ms: int | None, watermark: int | None) -> None:
        """Every record, before it is accounted, with the partition's watermark once raised by it:
        end the pending run if one ends before it."""
        if self.start is not None and (
            offset // BLOCK != self.start // BLOCK
            or (
                record_ts_ms is not None
                and self.last_ts is not None
                and record_ts_ms - self.last_ts >= self.gap_ms
            )
            or (
                watermark is not None
                and self.start_wm is not None
                and watermark // self.window_ms > self.start_wm // self.window_ms
            )
        ):
            self.end()
        if record_ts_ms is not None:
            self.last_ts = record_ts_ms

    def fold(
        self,
        start_ms: int,
        contribs: tuple[Contribution, ...],
        offset: int,
        depends_on: int | None,
        watermark: int | None,
    ) -> None:
        """A late record's contributions (to the closed window starting at ``start_ms``), read at
        the partition's ``watermark``."""
        if not contribs:
            return
        if self.start is None:
            self.start, self.start_wm = offset, watermark
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
        self.start = self.start_wm = self.anchor = None

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
