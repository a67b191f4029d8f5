"""Scrape-time metrics of the chargeback service: engine counters, watermarks, lag (read from snapshots
the loop takes after each batch, so a scrape never touches the engine the loop is mutating)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from confluent_kafka import TopicPartition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe_consumers.chargeback.partitions import InputPartitions
from gpupipe_consumers.chargeback.price_agreement import PriceAgreement


class PartitionInfo:
    """What the scrape thread reads of the loop's state: the engine's counters and, per assigned
    partition, position, watermark, checkpoint distance and lag. Taken by the loop (after each batch,
    and at every commit attempt), lag included (from the consumer's cached end offsets, read in the
    loop thread too). The scrape thread never calls into the consumer: a call on it from another
    thread waits for the loop's own (seen: a /metrics answer taking 3-56 s on a loaded machine,
    past Prometheus' 10 s scrape timeout)."""

    def __init__(self, partitions: InputPartitions, engine: Any) -> None:
        self.partitions = partitions
        self.engine = engine
        self.stats: dict[str, int] = {}  # replaced whole, never mutated: a scrape reads it as is
        self._lock = threading.Lock()
        self._info: dict[int, dict[str, Any]] = {}

    def take_stats(self) -> None:
        self.stats = dict(self.engine.stats)

    def refresh(self) -> None:
        """Take the per-partition snapshot (the loop thread)."""
        parts, engine = self.partitions, self.engine
        info: dict[int, dict[str, Any]] = {}
        for part in parts.assigned:
            pos = parts.positions.get(part)
            if pos is None:  # nothing read yet: the consumer starts where its state begins
                pos = parts.starts.get(part)
            cp = parts.committed.get(part)
            until = engine.replay_until(part)
            info[part] = {
                "replay_remaining": (until - pos)
                if until is not None and pos is not None and pos < until
                else 0,
                "position": pos,
                "watermark_ms": engine.watermark(part),
                "checkpoint_behind": (pos - cp.offset) if pos is not None and cp is not None else None,
            }
            try:
                _, high = parts.consumer.get_watermark_offsets(
                    TopicPartition(parts.topic, part), timeout=0.5, cached=True
                )
            except Exception:
                continue
            if pos is not None and high >= 0:
                info[part]["lag"] = max(0, high - pos)
        with self._lock:
            self._info = info

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """Per assigned partition: position, watermark, checkpoint distance and lag (scrape thread)."""
        with self._lock:
            return {p: dict(v) for p, v in self._info.items()}


class StateCollector(Collector):
    """Engine counters, watermarks and lag, read from snapshots the loop takes after each batch."""

    def __init__(self, info: PartitionInfo, agreement: PriceAgreement) -> None:
        self.info = info
        self.agreement = agreement

    def collect(self) -> Iterator[Any]:
        stats = dict(self.info.stats)
        events = CounterMetricFamily(
            "gpupipe_chargeback_engine_events",
            "Window-engine events: samples, first/continued/duplicate/backwards placements, late "
            "(into corrections), replay_skipped, clock_ahead, windows_closed, corrections_emitted.",
            labels=["event"],
        )
        for name, value in sorted(stats.items()):
            events.add_metric([name], value)
        yield events
        late = CounterMetricFamily(
            "gpupipe_chargeback_late_samples", "Samples whose window had closed: counted in corrections."
        )
        late.add_metric([], stats.get("late", 0))
        yield late
        skewed = CounterMetricFamily(
            "gpupipe_chargeback_clock_skewed_samples",
            "Samples stamped ahead of their record's (broker) timestamp by more than --max-clock-skew: "
            "billed once, in the window of the record timestamp.",
        )
        skewed.add_metric([], stats.get("clock_ahead", 0))
        yield skewed
        skipped = CounterMetricFamily(
            "gpupipe_chargeback_replay_skipped",
            "Replayed samples skipped because their window's output was committed already.",
        )
        skipped.add_metric([], stats.get("replay_skipped", 0))
        yield skipped
        lag = GaugeMetricFamily(
            "gpupipe_chargeback_lag_records",
            "High watermark minus the consumer position, per input partition.",
            labels=["partition"],
        )
        behind = GaugeMetricFamily(
            "gpupipe_chargeback_checkpoint_behind_records",
            "Consumer position minus the committed checkpoint offset: what a restart replays.",
            labels=["partition"],
        )
        watermark = GaugeMetricFamily(
            "gpupipe_chargeback_watermark_seconds",
            "Event-time watermark (newest sample timestamp) per input partition.",
            labels=["partition"],
        )
        checkpoint_lag = GaugeMetricFamily(
            "gpupipe_chargeback_checkpoint_lag_records",
            "High watermark minus the committed checkpoint offset, per input partition: the lag that "
            "tools reading the group's committed offsets see (about a window by design). The true "
            "progress lag is gpupipe_chargeback_lag_records, and <group>.progress carries positions.",
            labels=["partition"],
        )
        replaying = GaugeMetricFamily(
            "gpupipe_chargeback_replay_remaining_records",
            "Records still to replay before a restored partition makes new progress (alert when it "
            "does not fall, e.g. a crash loop that never finishes its replay).",
            labels=["partition"],
        )
        hold = GaugeMetricFamily(
            "gpupipe_chargeback_price_hold_from_seconds",
            "Usage time from which windows wait, unbilled, because another instance prices them "
            "differently (a rolling update of the price table in progress); absent when "
            "every instance agrees.",
        )
        agreement = self.agreement
        if agreement.held_from is not None:
            hold.add_metric([], agreement.held_from / 1000.0)
        yield hold
        other = GaugeMetricFamily(
            "gpupipe_chargeback_price_other_table_from_seconds",
            "Per partition of another instance whose checkpoint prices differently, or of this "
            "instance carrying the table of the instance it took the partition from: the usage time "
            "from which it does, labelled with the instance whose table it is (writer; '?' from "
            "older versions). The instance to update to end a price hold.",
            labels=["partition", "writer"],
        )
        for part, (since, writer) in sorted(agreement.differing.items()):
            other.add_metric([str(part), writer or "?"], since / 1000.0)
        yield other
        for part, info in sorted(self.info.snapshot().items()):
            if info.get("replay_remaining") is not None:
                replaying.add_metric([str(part)], info["replay_remaining"])
            if info.get("lag") is not None:
                lag.add_metric([str(part)], info["lag"])
                if info.get("checkpoint_behind") is not None:
                    checkpoint_lag.add_metric([str(part)], info["lag"] + info["checkpoint_behind"])
            if info.get("checkpoint_behind") is not None:
                behind.add_metric([str(part)], info["checkpoint_behind"])
            if info.get("watermark_ms") is not None:
                watermark.add_metric([str(part)], info["watermark_ms"] / 1000.0)
        yield lag
        yield replaying
        yield checkpoint_lag
        yield behind
        yield watermark
