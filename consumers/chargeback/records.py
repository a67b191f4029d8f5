"""The additive aggregate behind one ChargebackWindow row, and the converter to the wire dict.

Kept apart from the window engine in the style of aggregators: ``GpuTimeAggregate.add`` folds a
contribution in, ``to_record`` produces the ``ChargebackWindow`` dict (field names exactly those of
``schemas/ChargebackWindow.avsc``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast

from gpupipe.domain.prices import PriceTable
from gpupipe_consumers.chargeback.accounting import Contribution
from gpupipe_consumers.chargeback.workloads import WorkloadKey, WorkloadSums
from gpupipe_consumers.chargeback.workloads import add as add_workload
from gpupipe_consumers.chargeback.workloads import to_records as workload_records
from gpupipe_schemas.records import ChargebackPriceSource, ChargebackRecordKind, ChargebackWindow

WINDOW: Final = "window"
CORRECTION: Final = "correction"

SECONDS_PER_HOUR = 3600.0
JOULES_PER_KWH = 3_600_000.0

RowKey = tuple[int, str, str, str]  # (window_start_ms, namespace, node, gpu_model)


class GpuTimeAggregate:
    """Sums of contributions for one (window, namespace, node, gpu_model)."""

    __slots__ = (
        "allocated_s",
        "energy_estimated_j",
        "energy_j",
        "idle_s",
        "lost_s",
        "mig_s",
        "samples",
        "shared_s",
        "unknown_s",
        "used_s",
        "workloads",
    )

    def __init__(self) -> None:
        self.allocated_s = 0.0
        self.used_s = 0.0
        self.idle_s = 0.0
        self.unknown_s = 0.0
        self.shared_s = 0.0
        self.mig_s = 0.0
        self.lost_s = 0.0
        self.energy_j = 0.0
        self.energy_estimated_j = 0.0
        self.samples = 0
        self.workloads: dict[WorkloadKey, WorkloadSums] | None = None

    def add(self, c: Contribution) -> None:
        self.allocated_s += c.allocated_s
        self.used_s += c.used_s
        self.idle_s += c.idle_s
        self.unknown_s += c.unknown_s
        self.shared_s += c.shared_s
        self.mig_s += c.mig_s
        self.lost_s += c.lost_s
        self.energy_j += c.energy_j
        self.energy_estimated_j += c.energy_estimated_j
        self.samples += 1
        if c.workload is not None:
            if self.workloads is None:
                self.workloads = {}
            add_workload(self.workloads, c.workload, c)


def to_record(
    key: RowKey,
    agg: GpuTimeAggregate,
    *,
    kind: ChargebackRecordKind,
    window_ms: int,
    prices: PriceTable,
    partition: int,
    instance_id: str,
    emitted_at_ms: int,
    team_of: Callable[[str], str | None] | None = None,
) -> ChargebackWindow:
    """The ChargebackWindow record of one aggregate."""
    start, namespace, node, model = key
    price = prices.gpu_price(model)
    cost_allocation = agg.allocated_s / SECONDS_PER_HOUR * price.per_gpu_hour
    cost_energy = agg.energy_j / JOULES_PER_KWH * prices.energy_per_kwh
    return {
        "kind": kind,
        "window_start_ms": start,
        "window_end_ms": start + window_ms,
        "namespace": namespace,
        "team": team_of(namespace) if team_of is not None else None,
        "node": node,
        "gpu_model": model,
        "allocated_gpu_seconds": agg.allocated_s,
        "used_gpu_seconds": agg.used_s,
        "idle_gpu_seconds": agg.idle_s,
        "activity_unknown_gpu_seconds": agg.unknown_s,
        "shared_gpu_seconds": agg.shared_s,
        "mig_gpu_seconds": agg.mig_s,
        "lost_gpu_seconds": agg.lost_s,
        "energy_joules": agg.energy_j,
        "energy_estimated_joules": agg.energy_estimated_j,
        "sample_count": agg.samples,
        "price_per_gpu_hour": price.per_gpu_hour,
        "price_per_kwh": prices.energy_per_kwh,
        "price_source": cast(ChargebackPriceSource, price.source),  # the price table's three kinds
        "cost_allocation": cost_allocation,
        "cost_energy": cost_energy,
        "cost_total": cost_allocation + cost_energy,
        "currency": prices.currency,
        "source_partition": partition,
        "instance_id": instance_id,
        "emitted_at_ms": emitted_at_ms,
        "workloads": workload_records(agg.workloads, price.per_gpu_hour, prices.energy_per_kwh),
    }
