"""The lake's tables: one Iceberg table per topic, named, keyed and partitioned here.

What a table holds is derived from the Avro contract (:mod:`gpupipe_consumers.lake.arrow` maps the schemas
to Arrow, hence Iceberg); this module is the catalogue of tables itself, without pyarrow, so the
CLI can name the tables without loading the columnar stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe.kafka import topics
from gpupipe_schemas import catalog

#: Buckets of the samples table's node partition: identity(hostname) would write one file per node
#: per commit (1,000 nodes, 1,000 small files a minute); 16 buckets keep `hostname = 'x'` pruned.
NODE_BUCKETS = 16


@dataclass(frozen=True)
class LakeTable:
    """One topic's table: its name, record type, partitioning and the key that makes a row unique."""

    name: str
    topic: str  # base topic name (without the environment prefix)
    record: str  # Avro record name
    partition: tuple[tuple[str, str], ...]  # (column, transform): "day", "identity" or "bucket[N]"
    key: tuple[str, ...]  # unique per record on the topic: what the exactly-once tests count
    doc: str

    def avro(self) -> dict[str, Any]:
        return catalog.current(self.record).raw


TABLES: tuple[LakeTable, ...] = (
    LakeTable(
        "samples",
        topics.SAMPLES,
        "GpuSample",
        (("timestamp_ms", "day"), ("hostname", f"bucket[{NODE_BUCKETS}]")),
        ("uuid", "timestamp_ms"),
        "Every GpuSample, appended. Partitioned by sample day and a bucket of the node.",
    ),
    LakeTable(
        "xid_events",
        topics.XID,
        "XidEvent",
        (("timestamp_ms", "day"),),
        ("event_id",),
        "Every XidEvent, appended. Partitioned by event day.",
    ),
    LakeTable(
        "alerts",
        topics.ALERTS,
        "GpuAlert",
        (("emitted_at_ms", "day"),),
        ("alert_id", "sequence"),
        "Every GpuAlert state change (firing, resolved, action), appended; an alert's latest state is "
        "its row with the highest sequence. Partitioned by emission day.",
    ),
    LakeTable(
        "chargeback_windows",
        topics.CHARGEBACK,
        "ChargebackWindow",
        (("window_start_ms", "day"),),
        ("record_id",),
        "Every ChargebackWindow, windows and corrections, appended as on the topic. Records are additive "
        "partials: sum them per (window, namespace, node, gpu_model), counting each record_id once "
        "(see consumers/lake/query.py). Partitioned by window day.",
    ),
)

BY_NAME: Mapping[str, LakeTable] = {t.name: t for t in TABLES}
