"""Event-time tumbling windows of GPU accounting per input partition, with exact replay recovery.

Pure: no Kafka, no clocks, integer milliseconds; the same input gives the same output.
``service.py`` drives a :class:`WindowEngine` and owns the Kafka transaction. Windows, watermarks,
checkpoints and replay: docs/inside-chargeback.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpupipe.domain.price_schedule import Fingerprint, PriceSchedule, fingerprint
from gpupipe.domain.prices import PriceTable
from gpupipe_consumers.chargeback.accounting import (
    DUPLICATE,
    AccountingConfig,
    ReferenceSample,
    account,
    gpu_key,
)
from gpupipe_consumers.chargeback.errors import (
    ChargebackConfigError,
    ChargebackStateError,
    CheckpointMismatchError,
    GpuCapReached,
)
from gpupipe_consumers.chargeback.late_runs import GAP_MS, LateRun
from gpupipe_consumers.chargeback.records import CORRECTION, WINDOW, GpuTimeAggregate, RowKey, to_record
from gpupipe_schemas.records import ChargebackRecordKind, ChargebackWindow

DEFAULT_WINDOW_MS = 3_600_000
DEFAULT_GRACE_MS = 300_000
#: GPU references held at most (see "Bounded state"): about 100 bytes each.
DEFAULT_MAX_GPUS = 100_000
_METADATA_TAG = "gpupipe-chargeback"
_METADATA_VERSION = 1


def record_id(kind: str, partition: int, key: RowKey, sequence: str) -> str:
    """The output record's idempotency key (see ChargebackWindow.record_id)."""
    start, namespace, node, model = key
    return f"{kind}|{partition}|{start}|{namespace}|{node}|{model}|{sequence}"


def window_bounds(ts_ms: int, window_ms: int) -> tuple[int, int]:
    """The tumbling window ``[start, end)`` holding ``ts_ms``; windows are aligned to the epoch."""
    start = ts_ms - ts_ms % window_ms
    return start, start + window_ms


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What to commit for one partition: the offset, and metadata that makes the replay exact."""

    offset: int
    watermark_ms: int | None
    replay_until: int
    window_ms: int
    grace_ms: int
    # The committing instance's price schedule (price_schedule.fingerprint): what the partition's
    # windows before the watermark's horizon were priced with; None from older writers.
    prices: Fingerprint | None = None
    # First offset of the run of late records pending at the checkpoint (late_runs.py): a replay
    # folds the late records from there on into corrections again; None: no run was pending.
    late_from: int | None = None
    # The watermark when that run began: with the records since, the watermark each of them was
    # read at (which were late then). None from older writers, whose runs held late records only.
    late_wm: int | None = None
    # The committing instance's --instance-id: an instance held by another partition's prices can
    # name which instance still runs the other table (a hold that never ends).
    writer: str | None = None
    # Another instance's table this partition was taken over from (price_agreement.carry): the
    # group keeps knowing of it while that instance is away; with that instance's id.
    carried_prices: Fingerprint | None = None
    carried_writer: str | None = None

    def to_metadata(self) -> str:
        """Commit-metadata string (well under Kafka's default 4096-byte limit: 16 price versions
        at most, about 500 bytes, twice with a carried table)."""
        data: dict[str, Any] = {
            "t": _METADATA_TAG,
            "v": _METADATA_VERSION,
            "wm": self.watermark_ms,
            "until": self.replay_until,
            "window_ms": self.window_ms,
            "grace_ms": self.grace_ms,
        }
        if self.prices is not None:
            data["px"] = [[start, digest] for start, digest in self.prices]
        if self.late_from is not None:
            data["lr"] = self.late_from
        if self.late_wm is not None:
            data["lw"] = self.late_wm
        if self.writer is not None:
            data["by"] = self.writer
        if self.carried_prices is not None:
            data["cx"] = [[start, digest] for start, digest in self.carried_prices]
            data["cby"] = self.carried_writer
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_metadata(cls, offset: int, metadata: str | None) -> Checkpoint | None:
        """The checkpoint committed at ``offset``; None when the metadata is not ours (start fresh)."""
        if not metadata:
            return None
        try:
            data = json.loads(metadata)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("t") != _METADATA_TAG or data.get("v") != _METADATA_VERSION:
            return None
        try:
            wm = data["wm"]
            return cls(
                offset=int(offset),
                watermark_ms=None if wm is None else int(wm),
                replay_until=int(data["until"]),
                window_ms=int(data["window_ms"]),
                grace_ms=int(data["grace_ms"]),
                prices=_prices(data.get("px")),
                late_from=None if data.get("lr") is None else int(data["lr"]),
                late_wm=None if data.get("lw") is None else int(data["lw"]),
                writer=data["by"] if isinstance(data.get("by"), str) else None,
                carried_prices=_prices(data.get("cx")),
                carried_writer=data["cby"] if isinstance(data.get("cby"), str) else None,
            )
        except (KeyError, TypeError, ValueError):
            return None

    def billed_before(self) -> int | None:
        """Windows starting before this were closed (emitted) at the watermark; None: nothing was."""
        if self.watermark_ms is None:
            return None
        edge = self.watermark_ms - self.grace_ms  # a window ending at or before it is closed
        return edge - edge % self.window_ms


def _prices(value: Any) -> Fingerprint | None:
    """A fingerprint from commit metadata; None when absent or not one (an unknown schedule)."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
            return None
        out.append((int(entry[0]), entry[1]))
    return tuple(out)


class _Window:
    __slots__ = ("anchor", "rows")

    def __init__(self, anchor: int) -> None:
        self.anchor = anchor  # oldest offset this window's state depends on
        self.rows: dict[tuple[str, str, str], GpuTimeAggregate] = {}


class _Partition:
    __slots__ = (
        "closed",
        "flushed_end",
        "gpus",
        "late",
        "late_from",
        "late_wm",
        "next_offset",
        "pruned_wm",
        "replay_until",
        "restored",
        "watermark",
        "windows",
    )

    def __init__(self, window_ms: int, late_run_gap_ms: int) -> None:
        self.watermark: int | None = None
        self.windows: dict[int, _Window] = {}  # open windows by start
        self.closed: list[tuple[int, _Window]] = []  # closed, not yet polled
        self.late = LateRun(window_ms, late_run_gap_ms)  # late samples, grouped into corrections
        self.late_from: int | None = None  # restored: replayed late records from here are folded again
        self.late_wm: int | None = None  # replaying from late_from: the watermark each record was read at
        self.gpus: dict[str, ReferenceSample] = {}
        self.next_offset: int | None = None  # highest offset seen + 1
        self.pruned_wm: int | None = None  # watermark of the latest pruning at the GPU cap
        self.replay_until: int | None = None
        self.restored: Checkpoint | None = None
        self.flushed_end: int | None = None  # flush_all closed every window ending at or before this


class WindowEngine:
    """Windowed chargeback aggregation of GpuSample dicts; see the module docstring for the protocol."""

    def __init__(
        self,
        window_ms: int = DEFAULT_WINDOW_MS,
        grace_ms: int = DEFAULT_GRACE_MS,
        prices: PriceTable | PriceSchedule | None = None,
        instance_id: str = "chargeback",
        *,
        accounting: AccountingConfig | None = None,
        team_of: Callable[[str], str | None] | None = None,
        max_clock_skew_ms: int | None = None,
        late_run_gap_ms: int = GAP_MS,
        max_gpus: int = DEFAULT_MAX_GPUS,
    ) -> None:
        if window_ms <= 0:
            raise ChargebackConfigError(f"window_ms must be > 0, got {window_ms}")
        if grace_ms < 0:
            raise ChargebackConfigError(f"grace_ms must be >= 0, got {grace_ms}")
        self.window_ms = int(window_ms)
        self.grace_ms = int(grace_ms)
        self.prices = prices if prices is not None else PriceTable()
        if isinstance(self.prices, PriceSchedule):
            self.prices.check_windows(self.window_ms)
        self.instance_id = instance_id
        self.accounting = accounting if accounting is not None else AccountingConfig()
        self.team_of = team_of
        if max_clock_skew_ms is not None and max_clock_skew_ms < 0:
            raise ChargebackConfigError(f"max_clock_skew_ms must be >= 0, got {max_clock_skew_ms}")
        self.max_clock_skew_ms = max_clock_skew_ms
        self.late_run_gap_ms = int(late_run_gap_ms)
        if max_gpus < 1:
            raise ChargebackConfigError(f"max_gpus must be >= 1, got {max_gpus}")
        self.max_gpus = max_gpus
        self.stats: Counter[str] = Counter()
        self.price_fingerprint = fingerprint(self.prices)
        self._parts: dict[int, _Partition] = {}
        self._stale_margin = self.window_ms + self.grace_ms + self.accounting.max_gap_limit_ms

    # -- feeding ----------------------------------------------------------------------------------
    def add(
        self, sample: dict[str, Any], partition: int, offset: int, record_ts_ms: int | None = None
    ) -> None:
        """Account one GpuSample read at ``offset`` of input ``partition`` (in offset order).

        ``record_ts_ms`` is the Kafka record's timestamp. With ``max_clock_skew_ms`` set, a sample
        stamped further ahead of it than that (a node clock far in the future) is accounted at the
        record's timestamp instead, so one bad clock can neither close the partition's windows early
        nor hold the checkpoint back until its future window is reached. Only as trustworthy as the
        record timestamp: use LogAppendTime, or a broker bound on CreateTime.
        """
        p = self._parts.get(partition)
        if p is None:
            p = self._parts[partition] = _Partition(self.window_ms, self.late_run_gap_ms)
        if p.next_offset is None or offset >= p.next_offset:
            p.next_offset = offset + 1
        replaying = p.replay_until is not None and offset < p.replay_until
        ts = int(sample["timestamp_ms"])
        skew = self.max_clock_skew_ms  # event_time(), inline: this runs for every sample
        if record_ts_ms is not None and skew is not None and ts > record_ts_ms + skew:
            ts = int(record_ts_ms)
        if ts != sample["timestamp_ms"]:
            self.stats["clock_ahead"] += 1
            sample = {**sample, "timestamp_ms": ts}
        if p.watermark is None or ts > p.watermark:
            p.watermark = ts
            self._close_due(p)
        # The watermark this record was first read at: the restored one is ahead during a replay;
        # from the pending run's start on it is rebuilt (late_runs.py).
        read_at = p.watermark
        if replaying and p.late_from is not None and offset >= p.late_from and p.late_wm is not None:
            p.late_wm = read_at = max(p.late_wm, ts)
        late = p.late
        if late.start is not None:
            late.before(offset, record_ts_ms, read_at)
        elif record_ts_ms is not None:  # what before() does without a pending run
            late.last_ts = record_ts_ms

        key = gpu_key(sample)
        ref = p.gpus.get(key)
        if ref is None and not replaying and self._full(p):
            self.stats["gpu_cap"] += 1
            raise GpuCapReached(
                f"GPU {key[:80]!r} is new and {self.max_gpus} GPUs are held (--max-gpus): dead-lettered, "
                "not billed"
            )
        if ref is not None and read_at is not None and ref.ts_ms + self._stale_margin < read_at:
            ref = None  # stale (_is_stale)
        res = account(sample, ref, offset, self.accounting, key)
        if res.new_ref is not None:
            p.gpus[key] = res.new_ref
        stats = self.stats
        stats["samples"] += 1
        stats[res.status] += 1

        window_ms = self.window_ms
        start = ts - ts % window_ms
        end = start + window_ms  # _is_closed(p, start), inline: this runs for every sample
        if (p.flushed_end is not None and end <= p.flushed_end) or (
            p.watermark is not None and end + self.grace_ms <= p.watermark
        ):
            if replaying and (
                p.late_from is None
                or offset < p.late_from
                or start + self.window_ms + self.grace_ms > read_at  # on time when first read
            ):
                self.stats["replay_skipped"] += 1  # already committed in a window or a correction
                return
            if res.contributions:
                self.stats["late"] += 1
            p.late.fold(start, res.contributions, offset, res.depends_on, read_at)
            return

        anchor = offset if res.depends_on is None else min(offset, res.depends_on)
        win = p.windows.get(start)
        if win is None:
            win = p.windows[start] = _Window(anchor)
        elif anchor < win.anchor:
            win.anchor = anchor
        if res.status != DUPLICATE:
            rows = win.rows
            for c in res.contributions:
                rk = (c.namespace, c.node, c.gpu_model)
                agg = rows.get(rk)
                if agg is None:
                    agg = rows[rk] = GpuTimeAggregate()
                agg.add(c)

    def _full(self, p: _Partition) -> bool:
        """``max_gpus`` references are held; stale ones of ``p`` are pruned first (as a checkpoint
        would), at most once per sixteenth of the stale margin of its event time."""
        if sum(len(q.gpus) for q in self._parts.values()) < self.max_gpus:
            return False
        wm = p.watermark
        if wm is not None and (p.pruned_wm is None or wm - p.pruned_wm >= self._stale_margin // 16):
            p.pruned_wm = wm
            p.gpus = {k: r for k, r in p.gpus.items() if not self._is_stale(r, wm)}
            return sum(len(q.gpus) for q in self._parts.values()) >= self.max_gpus
        return True

    def event_time(self, sample_ts_ms: int, record_ts_ms: int | None) -> int:
        """The time a sample is accounted at: its own, or its record's (broker) timestamp when it is
        stamped further ahead of that than ``max_clock_skew_ms`` (see :meth:`add`)."""
        if (
            record_ts_ms is not None
            and self.max_clock_skew_ms is not None
            and sample_ts_ms > record_ts_ms + self.max_clock_skew_ms
        ):
            return int(record_ts_ms)
        return sample_ts_ms

    def _is_stale(self, ref: ReferenceSample, watermark: int | None) -> bool:
        return watermark is not None and ref.ts_ms + self._stale_margin < watermark

    def _is_closed(self, p: _Partition, start: int) -> bool:
        end = start + self.window_ms
        if p.flushed_end is not None and end <= p.flushed_end:
            return True
        return p.watermark is not None and end + self.grace_ms <= p.watermark

    def _close_due(self, p: _Partition) -> None:
        due = [s for s in p.windows if self._is_closed(p, s)]
        for start in sorted(due):
            p.closed.append((start, p.windows.pop(start)))

    def advance_idle(self, partition: int, broker_ms: int) -> bool:
        """Move an idle partition's watermark to ``broker_ms``; True if it moved.

        Called by the service when the partition delivered nothing for ``--idle-timeout`` and is
        caught up: its GPUs stopped sending (scale-down, a quiet fleet), so event time would never
        close its last window nor free its checkpoint. Broker time is what its samples would carry
        if any came; later ones for closed windows become corrections, as any late sample. The
        advanced watermark is committed with the checkpoint, so a replay agrees with it.
        """
        p = self._parts.get(partition)
        if p is None:
            return False
        if p.replay_until is not None and (p.next_offset is None or p.next_offset < p.replay_until):
            return False  # still replaying: the restored state is the truth
        ended = p.late.end_if_quiet(int(broker_ms))  # a quiet partition's pending late run goes out
        if p.watermark is None or broker_ms <= p.watermark or p.late.start is not None:
            # Not while a run is pending: a replay rebuilds the watermark its records were read
            # at from the records alone. The run ends once broker time is past its gap (above).
            return ended
        p.watermark = int(broker_ms)
        self.stats["idle_advances"] += 1
        self._close_due(p)
        return True

    # -- output -----------------------------------------------------------------------------------
    def poll_closed(self) -> list[ChargebackWindow]:
        """ChargebackWindow records ready to emit: closed windows, then corrections, per partition."""
        out: list[ChargebackWindow] = []
        for pid in sorted(self._parts):
            p = self._parts[pid]
            emitted_at = p.watermark if p.watermark is not None else 0
            for start, win in p.closed:
                for ns, node, model in sorted(win.rows):
                    rk = (start, ns, node, model)
                    rec = self._record(rk, win.rows[(ns, node, model)], WINDOW, pid, emitted_at)
                    rec["record_id"] = record_id(WINDOW, pid, rk, "0")
                    rec["late_offsets"] = []
                    out.append(rec)
                self.stats["windows_closed"] += 1
            p.closed.clear()
            for rk, agg, offsets in p.late.take():  # runs that ended: the same in every run (late_runs)
                rec = self._record(rk, agg, CORRECTION, pid, emitted_at)
                rec["record_id"] = record_id(CORRECTION, pid, rk, f"{offsets[0]}-{offsets[-1]}")
                # Which samples it sums: the report counts each once even against corrections of
                # writers that grouped late samples per commit.
                rec["late_offsets"] = list(offsets)
                out.append(rec)
                self.stats["corrections_emitted"] += 1
        self.stats["records_emitted"] += len(out)
        return out

    def _record(
        self, key: RowKey, agg: GpuTimeAggregate, kind: ChargebackRecordKind, pid: int, emitted_at: int
    ) -> ChargebackWindow:
        return to_record(
            key,
            agg,
            kind=kind,
            window_ms=self.window_ms,
            prices=self.prices.at(key[0]),  # the price in force when the GPU was used
            partition=pid,
            instance_id=self.instance_id,
            emitted_at_ms=emitted_at,
            team_of=self.team_of,
        )

    def flush_all(self) -> list[ChargebackWindow]:
        """Close every open window now and return all pending records (finite inputs, tests).

        Never on rebalance or shutdown of a streaming service: that would emit partial windows the
        next owner emits again after its replay. Later samples for flushed windows become corrections.
        """
        for p in self._parts.values():
            p.late.end()
            if p.windows:
                last_end = max(p.windows) + self.window_ms
                p.flushed_end = last_end if p.flushed_end is None else max(p.flushed_end, last_end)
                self._close_due(p)
        return self.poll_closed()

    # -- recovery ---------------------------------------------------------------------------------
    def open_rows(self) -> set[tuple[str, str]]:
        """(namespace, gpu_model) pairs with time in a window not emitted yet (open, or closed and not
        polled), for metrics that must exist before the window is emitted."""
        out: set[tuple[str, str]] = set()
        for p in self._parts.values():
            for w in [*p.windows.values(), *(w for _, w in p.closed)]:
                out.update((ns, model) for ns, _, model in w.rows)
        return out

    def open_windows_min_offset(self, partition: int) -> int | None:
        """Oldest offset the partition's open windows and live GPU state depend on; None when nothing."""
        p = self._parts.get(partition)
        if p is None:
            return None
        anchors = [w.anchor for w in p.windows.values()]
        anchors.extend(ref.offset for ref in p.gpus.values() if not self._is_stale(ref, p.watermark))
        return min(anchors) if anchors else None

    def checkpoint(self, partition: int, next_offset: int | None = None) -> Checkpoint | None:
        """What to commit for ``partition`` now; None when nothing was consumed from it yet.

        Call after :meth:`poll_closed` and commit it in the same transaction as the polled records.
        ``next_offset`` is the consumer position when the service skipped records the engine never
        saw (dead letters); by default the highest offset added + 1.
        """
        p = self._parts.get(partition)
        if p is None:
            return None
        if p.closed or p.late.ended:
            raise ChargebackStateError(f"partition {partition}: poll_closed() before checkpoint()")
        position = p.next_offset
        if next_offset is not None:
            position = next_offset if position is None else max(position, next_offset)
        if p.restored is not None and (position is None or position < p.restored.replay_until):
            # Still replaying: the restored checkpoint stays the truth, with this instance's price
            # schedule (the service checked that it prices what was billed as before),
            # so that the other instances learn of it before this one bills anything.
            return dataclasses.replace(
                p.restored,
                prices=self.price_fingerprint,
                writer=self.instance_id,
                carried_prices=None,
                carried_writer=None,
            )
        if position is None:
            return None
        p.gpus = {k: r for k, r in p.gpus.items() if not self._is_stale(r, p.watermark)}
        anchors = [a for a in (self.open_windows_min_offset(partition), p.late.anchor) if a is not None]
        offset = min([position, *anchors])
        return Checkpoint(
            offset,
            p.watermark,
            position,
            self.window_ms,
            self.grace_ms,
            self.price_fingerprint,
            late_from=p.late.start,
            late_wm=p.late.start_wm,
            writer=self.instance_id,
        )

    def restore(self, partition: int, checkpoint: Checkpoint | None) -> None:
        """Start ``partition`` over from a committed checkpoint (None: from scratch), before consuming."""
        p = self._parts[partition] = _Partition(self.window_ms, self.late_run_gap_ms)
        if checkpoint is None:
            return
        if checkpoint.window_ms != self.window_ms or checkpoint.grace_ms != self.grace_ms:
            raise CheckpointMismatchError(
                f"partition {partition} was checkpointed with window_ms={checkpoint.window_ms} "
                f"grace_ms={checkpoint.grace_ms}, the engine has window_ms={self.window_ms} "
                f"grace_ms={self.grace_ms}: drain with the old settings before changing them"
            )
        p.watermark = checkpoint.watermark_ms
        p.replay_until = checkpoint.replay_until
        p.late_from = checkpoint.late_from
        # Older writers' runs held late records only: all of them are folded again, as at the
        # restored watermark.
        p.late_wm = checkpoint.late_wm if checkpoint.late_wm is not None else checkpoint.watermark_ms
        p.restored = checkpoint

    def replay_until(self, partition: int) -> int | None:
        """The restored position below which records are replays (None: not restored)."""
        p = self._parts.get(partition)
        return None if p is None else p.replay_until

    def is_replay(self, partition: int, offset: int) -> bool:
        """True for a record below the restored position: its output was committed already."""
        p = self._parts.get(partition)
        return p is not None and p.replay_until is not None and offset < p.replay_until

    def drop_partition(self, partition: int) -> None:
        """Forget a revoked partition (checkpoint and commit it first)."""
        self._parts.pop(partition, None)

    # -- introspection ----------------------------------------------------------------------------
    def partitions(self) -> tuple[int, ...]:
        return tuple(sorted(self._parts))

    def watermark(self, partition: int) -> int | None:
        p = self._parts.get(partition)
        return None if p is None else p.watermark

    def open_window_starts(self, partition: int) -> tuple[int, ...]:
        p = self._parts.get(partition)
        return () if p is None else tuple(sorted(p.windows))

    def gpu_count(self, partition: int) -> int:
        p = self._parts.get(partition)
        return 0 if p is None else len(p.gpus)
