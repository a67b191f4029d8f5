"""Corrections grouped by *runs* of late records: the same input always gives the same corrections.

A correction sums the late samples of one row (window, namespace, node, model) within one *run* of
the partition's late records, which only the input ends (the watermark moving to a later window, a
quiet gap of ``gap_ms``, a new block of ``BLOCK`` offsets, an idle partition). A run is emitted only
once it has ended, so any replay emits the same corrections with the same ``record_id``; the pending
run is checkpointed like an open window (commit metadata ``lr``, ``lw``).
More: docs/inside-chargeback.md, "late_runs.py".
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
