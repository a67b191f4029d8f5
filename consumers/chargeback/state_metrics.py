"""Scrape-time metrics of the chargeback service: engine counters, watermarks, lag (read from snapshots
the loop takes after each batch, so a scrape never touches the engine the loop is mutating)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class StateCollector(Collector):
    """Engine counters, watermarks and lag, read from snapshots the loop takes after each batch."""

    def __init__(self, service: Any) -> None:
        self._svc = service

    def collect(self) -> Iterator[Any]:
        svc = self._svc
        stats = dict(svc.stats_snapshot)
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
            "Records still to replay before a restored partition makes new progress (review L7: alert "
            "when it does not fall, e.g. a crash loop that never finishes its replay).",
            labels=["partition"],
        )
        for part, info in sorted(svc.partition_info().items()):
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
