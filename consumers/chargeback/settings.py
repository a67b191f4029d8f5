"""What ``service.py`` needs to build and feed the chargeback engine, without any Kafka import.

* :class:`ChargebackSettings`: the knobs, validated at startup.
* :func:`build_engine`: a :class:`~gpupipe_consumers.chargeback.windows.WindowEngine` from settings.
* :func:`projected_sample_schema`: a reader schema holding only the GpuSample fields chargeback
  reads, for ``AvroCodec(reader_schemas={"GpuSample": ...})`` (fastavro then skips the rest).

The transaction protocol (commit checkpoints, restore and replay on start, drop on revoke) is
described in ``windows.py``; in short, per batch::

    for msg in batch:
        if decoded: engine.add(record, msg.partition(), msg.offset(), msg.timestamp()[1])
        elif not engine.is_replay(p, msg.offset()): dead-letter it
    records = engine.poll_closed()
    cps = {p: engine.checkpoint(p, next_offset=consumer_position[p]) for p in assigned}
    begin; produce(records); send_offsets_to_transaction(
        [TopicPartition(topic, p, cp.offset, cp.to_metadata()) for p, cp in cps.items() if cp], ...);
    commit   # on abort: drop every partition, restore from committed checkpoints, seek there

and on assignment: ``engine.restore(p, Checkpoint.from_metadata(committed.offset, committed.metadata))``,
consuming from the committed offset.

Teams: records carry ``team`` only if the engine is given ``team_of``; pass
``gpupipe.domain.teams.load_team_map(path).match`` (None for unmapped namespaces), or nothing and
let reports map namespaces (they do anyway, and their mapping wins).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpupipe.domain.price_schedule import PriceSchedule
from gpupipe.domain.prices import PriceTable
from gpupipe_consumers.chargeback.accounting import AccountingConfig
from gpupipe_consumers.chargeback.late_runs import GAP_MS as LATE_RUN_GAP_MS
from gpupipe_consumers.chargeback.windows import (
    DEFAULT_GRACE_MS,
    DEFAULT_MAX_GPUS,
    DEFAULT_WINDOW_MS,
    Checkpoint,
    WindowEngine,
)

__all__ = ["SAMPLE_FIELDS", "ChargebackSettings", "Checkpoint", "build_engine", "projected_sample_schema"]

SAMPLE_FIELDS = (
    "timestamp_ms",
    "hostname",
    "uuid",
    "model_name",
    "mig",
    "mig_enabled",
    "allocations",
    "processes",
    "interval_ms",
    "gpu_lost",
    "gpu_util_ratio",
    "sm_active_ratio",
    "power_w",
    "total_energy_mj",
    "allocations_known",
    "mig_configured_fraction",
    "shared_replicas",
    "mig_parent_energy_mj",
    "mig_energy_by_slice",
)
"""GpuSample fields the accounting reads; everything else may be skipped when decoding."""


@dataclass(frozen=True, slots=True)
class ChargebackSettings:
    window_ms: int = DEFAULT_WINDOW_MS
    grace_ms: int = DEFAULT_GRACE_MS
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    max_clock_skew_ms: int | None = 60_000
    """Samples stamped further ahead of their Kafka record timestamp (broker time with LogAppendTime)
    are accounted at the latter: a sample can never be newer than its append to the log."""
    late_run_gap_ms: int = LATE_RUN_GAP_MS
    """Quiet time in record timestamps that ends a run of late records (late_runs.py); the same in
    every run over the same input, or re-processed corrections are grouped differently."""
    max_gpus: int = DEFAULT_MAX_GPUS
    """GPUs held at most; a sample of another is dead-lettered (windows.py, "Bounded state")."""


def build_engine(
    settings: ChargebackSettings,
    prices: PriceTable | PriceSchedule,
    instance_id: str,
    team_of: Callable[[str], str | None] | None = None,
) -> WindowEngine:
    return WindowEngine(
        settings.window_ms,
        settings.grace_ms,
        prices,
        instance_id,
        accounting=settings.accounting,
        team_of=team_of,
        max_clock_skew_ms=settings.max_clock_skew_ms,
        late_run_gap_ms=settings.late_run_gap_ms,
        max_gpus=settings.max_gpus,
    )


def projected_sample_schema(sample_schema: dict[str, Any]) -> dict[str, Any]:
    """The GpuSample schema (its raw JSON dict) cut down to :data:`SAMPLE_FIELDS`, for decoding."""
    projected = copy.deepcopy(sample_schema)
    projected["fields"] = [f for f in projected["fields"] if f["name"] in SAMPLE_FIELDS]
    missing = set(SAMPLE_FIELDS) - {f["name"] for f in projected["fields"]}
    if missing:
        from gpupipe_consumers.chargeback.errors import ChargebackConfigError

        raise ChargebackConfigError(f"GpuSample schema lacks fields chargeback needs: {sorted(missing)}")
    return projected
