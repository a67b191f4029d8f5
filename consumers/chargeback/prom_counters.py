"""Prometheus counters of the chargeback windows the service commits, for dashboards.

Dashboards (deploy/grafana, the Chargeback dashboard) chart GPU-hours and cost per namespace, team
and GPU model over time from these counters, fed only from ChargebackWindow records the service
has *committed* (windows and corrections), so over a period they add up to what ``gpupipe report
chargeback`` sums from the topic (per instance: sum over instances in PromQL).

``increase()`` ignores what a series held at its first scrape. A series that appears already
counting would lose its first window, so :meth:`WindowCounters.prime` creates each (namespace,
team, model) at 0 while its first window is still open (an hour before it first grows).

Labels: ``namespace``, ``team`` (the record's team, else the namespace: what reports show when no
mapping matches), ``gpu_model``; cost also ``currency``. Pseudo-namespaces (``__unallocated__``,
``__mig_shared__``) are series of their own, as in reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

LABELS = ("namespace", "team", "gpu_model")


class WindowCounters:
    def __init__(self, registry: CollectorRegistry, currency: str = "") -> None:
        self.currency = currency
        self._seen: set[tuple[str, str, str]] = set()
        self.allocated = Counter(
            "gpupipe_chargeback_allocated_gpu_seconds",
            "GPU-seconds allocated (held by pods; capacity for __unallocated__) in committed windows.",
            LABELS,
            registry=registry,
        )
        self.used = Counter(
            "gpupipe_chargeback_used_gpu_seconds",
            "GPU-seconds used (allocated, weighted by activity) in committed windows.",
            LABELS,
            registry=registry,
        )
        self.idle = Counter(
            "gpupipe_chargeback_idle_gpu_seconds",
            "GPU-seconds allocated but inactive in committed windows.",
            LABELS,
            registry=registry,
        )
        self.energy = Counter(
            "gpupipe_chargeback_energy_joules",
            "GPU energy in committed windows.",
            LABELS,
            registry=registry,
        )
        self.cost = Counter(
            "gpupipe_chargeback_cost",
            "Cost (allocation + energy) in committed windows, in the price table's currency.",
            (*LABELS, "currency"),
            registry=registry,
        )

    def _children(self, key: tuple[str, str, str], currency: str) -> tuple[Any, ...]:
        return (
            self.allocated.labels(*key),
            self.used.labels(*key),
            self.idle.labels(*key),
            self.energy.labels(*key),
            self.cost.labels(*key, currency),
        )

    def prime(self, rows: Iterable[tuple[str, str]], team_of: Callable[[str], str | None] | None) -> None:
        """Create the series of open windows' (namespace, gpu_model) at 0 if they do not exist yet."""
        for namespace, model in rows:
            team = (team_of(namespace) if team_of is not None else None) or namespace
            key = (namespace, team, model)
            if key not in self._seen:
                self._seen.add(key)
                self._children(key, self.currency)

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        """Count committed ChargebackWindow records (windows and corrections)."""
        for rec in records:
            key = (rec["namespace"], rec.get("team") or rec["namespace"], rec["gpu_model"])
            self._seen.add(key)
            alloc, used, idle, energy, cost = self._children(key, rec.get("currency") or self.currency)
            alloc.inc(max(rec["allocated_gpu_seconds"], 0.0))
            used.inc(max(rec["used_gpu_seconds"], 0.0))
            idle.inc(max(rec["idle_gpu_seconds"], 0.0))
            energy.inc(max(rec["energy_joules"], 0.0))
            cost.inc(max(rec["cost_total"], 0.0))
