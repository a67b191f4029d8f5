"""The Kafka sizing arithmetic (bench/kafka_sizing_table.py): given per-record sizes, the table."""

from __future__ import annotations

import pytest

from bench.kafka_sizing_table import REPLICATION, Measured, record_rate, render, sizing_rows
from gpupipe.kafka import topics

SIZES = {topics.SAMPLES: 100.0, topics.XID: 400.0, topics.ALERTS: 450.0, topics.CHARGEBACK: 250.0}


def test_samples_row_from_given_sizes() -> None:
    rows = sizing_rows(Measured(SIZES, per_partition_records_per_s=10_000), [(100_000, 1.0)])
    s = next(r for r in rows if r.topic == topics.SAMPLES)
    assert s.records_per_s == 100_000
    assert s.ingress_mb_per_s == pytest.approx(10.0)  # 1e5 records/s x 100 B
    assert s.disk_gb_per_day == pytest.approx(864.0)  # x 86,400 s
    assert s.retention_days == 3  # the topic's shipped retention
    assert s.disk_gb_retained_rf == pytest.approx(864.0 * 3 * REPLICATION)
    assert s.partitions == 20  # 1e5 / (1e4 x 0.5 headroom)


def test_ten_second_interval_divides_samples_only() -> None:
    one = {r.topic: r for r in sizing_rows(Measured(SIZES, 10_000), [(10_000, 1.0)])}
    ten = {r.topic: r for r in sizing_rows(Measured(SIZES, 10_000), [(10_000, 10.0)])}
    assert ten[topics.SAMPLES].disk_gb_per_day == pytest.approx(one[topics.SAMPLES].disk_gb_per_day / 10)
    assert ten[topics.XID].disk_gb_per_day == one[topics.XID].disk_gb_per_day
    assert one[topics.SAMPLES].partitions == topics.DEFAULT_SPECS[topics.SAMPLES].partitions  # never below


def test_chargeback_keeps_its_400_days_and_the_table_renders() -> None:
    rows = sizing_rows(Measured(SIZES, 10_000), [(80_000, 1.0)])
    cb = next(r for r in rows if r.topic == topics.CHARGEBACK)
    assert cb.records_per_s == pytest.approx(10_000 / 3600)  # 10k nodes, a window an hour each
    assert cb.disk_gb_retained_rf == pytest.approx(10_000 / 3600 * 250 * 86_400 / 1e9 * 400 * 3)
    table = render(rows)
    assert table.count("\n") == 1 + len(rows) and "`gpu.chargeback.v1`" in table


def test_a_topic_without_a_rate_model_is_refused() -> None:
    with pytest.raises(ValueError, match="no rate model"):
        record_rate(topics.DEADLETTER, 1, 1.0)
