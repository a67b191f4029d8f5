"""Kafka sizing arithmetic: measured bytes per record and throughput in, a fleet's sizing table out.

Contract: pure (no I/O, no clock). ``sizing_rows(measured, fleets)`` returns one `SizingRow` per
(fleet, topic); `bench/kafka_sizing.py` measures the inputs on a real broker and prints the table,
docs/operations.md#kafka-sizing quotes it. Record rates per topic come from `record_rate`, whose
assumptions are stated there (they are the only figures here not measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpupipe.kafka import topics

DAY_S = 86_400
REPLICATION = 3  # production replication factor (docs/operations.md: what production needs)
HEADROOM = 0.5  # plan partitions to run at half the measured per-partition ceiling
GPUS_PER_NODE = 8
XIDS_PER_GPU_HOUR = 0.002  # the simulated fleet's default (DEFAULT_XID_RATE_PER_GPU_HOUR)
ALERTS_PER_XID = 2  # an incident is published firing, then resolved
WINDOWS_PER_NODE_HOUR = 1  # one chargeback window per node and hour (one namespace per node)


@dataclass(frozen=True, slots=True)
class Measured:
    """Per-topic figures from the bench: on-disk bytes per record (with the producer's compression,
    segment overhead included) and the producer's records/s into one partition."""

    disk_bytes_per_record: dict[str, float]
    per_partition_records_per_s: float


@dataclass(frozen=True, slots=True)
class SizingRow:
    gpus: int
    interval_s: float
    topic: str
    records_per_s: float
    ingress_mb_per_s: float  # leader ingress, before replication
    disk_gb_per_day: float  # one copy
    retention_days: float
    disk_gb_retained_rf: float  # retention period, times REPLICATION
    partitions: int  # max(topic's default, needed at HEADROOM of the measured ceiling)


def record_rate(topic: str, gpus: int, interval_s: float) -> float:
    """Records/s a fleet sends to ``topic``: samples one per GPU per interval; the rest by the
    assumptions above (independent of the sampling interval)."""
    if topic == topics.SAMPLES:
        return gpus / interval_s
    if topic == topics.XID:
        return gpus * XIDS_PER_GPU_HOUR / 3600
    if topic == topics.ALERTS:
        return gpus * XIDS_PER_GPU_HOUR * ALERTS_PER_XID / 3600
    if topic == topics.CHARGEBACK:
        return gpus / GPUS_PER_NODE * WINDOWS_PER_NODE_HOUR / 3600
    raise ValueError(f"no rate model for {topic}")


def sizing_rows(m: Measured, fleets: list[tuple[int, float]]) -> list[SizingRow]:
    rows = []
    for gpus, interval_s in fleets:
        for topic, b in m.disk_bytes_per_record.items():
            rate = record_rate(topic, gpus, interval_s)
            days = topics.DEFAULT_SPECS[topic].retention_ms / (DAY_S * 1000)
            per_day_gb = rate * b * DAY_S / 1e9
            need = math.ceil(rate / (m.per_partition_records_per_s * HEADROOM))
            rows.append(
                SizingRow(
                    gpus=gpus,
                    interval_s=interval_s,
                    topic=topic,
                    records_per_s=rate,
                    ingress_mb_per_s=rate * b / 1e6,
                    disk_gb_per_day=per_day_gb,
                    retention_days=days,
                    disk_gb_retained_rf=per_day_gb * days * REPLICATION,
                    partitions=max(topics.DEFAULT_SPECS[topic].partitions, need),
                )
            )
    return rows


def render(rows: list[SizingRow]) -> str:
    """The table as Markdown (what docs/operations.md quotes)."""
    out = [
        "| GPUs | interval | topic | records/s | ingress MB/s | disk GB/day (1 copy) | retention | "
        f"disk GB retained x{REPLICATION} | partitions |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.gpus:,} | {r.interval_s:g} s | `{r.topic}` | {r.records_per_s:,.3g} | "
            f"{r.ingress_mb_per_s:.3g} | {r.disk_gb_per_day:.3g} | {r.retention_days:g} d | "
            f"{r.disk_gb_retained_rf:,.4g} | {r.partitions} |"
        )
    return "\n".join(out)
