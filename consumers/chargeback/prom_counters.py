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

Bounded: past ``max_series`` label sets, new ones are counted under namespace and team
``__overflow__`` (per model), so totals stay right while forged namespaces cannot grow the
exposition without end; each overflowing record is counted and the first one logged.

Once, as the report does: after an offset reset (or a mirror failover) a partition restarts from
offsets without our checkpoint and re-emits windows an earlier process already counted, under the
same ``record_id``; so does one whose committed offset is gone (the group's offsets expired or were
deleted) while the output topic holds records. Such a partition's records are *held*
(:meth:`WindowCounters.hold`) until the ids already on the output topic are known
(:meth:`WindowCounters.release`); those are not counted again
(``gpupipe_chargeback_counter_duplicates``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

LABELS = ("namespace", "team", "gpu_model")
#: (namespace, team, model) label sets kept; a fleet's real ones are a few thousand at most.
MAX_SERIES = 10_000
#: Records held per partition while its emitted ids are read; past it they are counted unchecked.
MAX_HELD = 200_000
OVERFLOW = "__overflow__"

log = logging.getLogger("gpupipe.chargeback")


def _counted(v: float) -> float:
    """What a counter may add: positive and finite (NaN compares false, so it adds nothing)."""
    return v if 0.0 < v < float("inf") else 0.0


class WindowCounters:
    def __init__(
        self,
        registry: CollectorRegistry,
        currency: str = "",
        max_series: int = MAX_SERIES,
        max_held: int = MAX_HELD,
    ) -> None:
        self.currency = currency
        self.max_series = max_series
        self.max_held = max_held
        self._seen: set[tuple[str, str, str]] = set()
        # The loop thread adds; the reader of emitted ids releases (see the module doc).
        self._lock = threading.Lock()
        self._held: dict[int, list[Mapping[str, Any]]] = {}
        self._emitted: dict[int, set[str]] = {}
        self.overflow_records = 0
        self.duplicates = Counter(
            "gpupipe_chargeback_counter_duplicates",
            "Committed records not counted again: re-emitted after an offset reset, counted before.",
            registry=registry,
        )
        self.overflowed = Counter(
            "gpupipe_chargeback_series_overflow_records",
            f"Committed records counted under namespace {OVERFLOW}: past the cap on label sets.",
            registry=registry,
        )
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

    def _key(self, key: tuple[str, str, str]) -> tuple[str, str, str]:
        if key in self._seen or len(self._seen) < self.max_series:
            self._seen.add(key)
            return key
        if not self.overflow_records:
            log.warning(
                "chargeback counters at their cap: new namespaces counted as %s",
                OVERFLOW,
                extra={"max_series": self.max_series},
            )
        self.overflow_records += 1
        self.overflowed.inc()
        over = (OVERFLOW, OVERFLOW, key[2])
        self._seen.add(over)
        return over

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
        with self._lock:
            self._prime(rows, team_of)

    def _prime(self, rows: Iterable[tuple[str, str]], team_of: Callable[[str], str | None] | None) -> None:
        for namespace, model in rows:
            team = (team_of(namespace) if team_of is not None else None) or namespace
            key = (namespace, team, model)
            if key not in self._seen and len(self._seen) < self.max_series:
                self._seen.add(key)
                self._children(key, self.currency)

    def hold(self, partition: int) -> None:
        """Hold ``partition``'s records uncounted until :meth:`release`."""
        with self._lock:
            self._held.setdefault(partition, [])

    def release(self, partition: int, emitted: set[str] | None) -> int:
        """Count ``partition``'s held records, skipping ``emitted`` (ids an earlier process counted;
        None: unknown, count all), and skip those ids from now on too. Returns records counted."""
        with self._lock:
            held = self._held.pop(partition, [])
            if emitted:
                self._emitted[partition] = set(emitted)
            return self._count(held)

    def held(self) -> dict[int, int]:
        with self._lock:
            return {p: len(recs) for p, recs in self._held.items()}

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Count committed ChargebackWindow records (windows and corrections)."""
        with self._lock:
            held = self._held
            if not held:
                self._count(records)
                return
            now: list[Mapping[str, Any]] = []
            for rec in records:
                part = rec.get("source_partition")
                if part is None or (pending := held.get(part)) is None:
                    now.append(rec)
                    continue
                pending.append(rec)
                if len(pending) > self.max_held:
                    log.warning(
                        "chargeback counters: too many records held while the emitted ids are read; "
                        "counting partition %s without the check",
                        part,
                    )
                    self._count(held.pop(part))
            self._count(now)

    def _count(self, records: Iterable[Mapping[str, Any]]) -> int:
        n = 0
        emitted = self._emitted
        for rec in records:
            if emitted:
                ids = emitted.get(rec.get("source_partition"))  # type: ignore[arg-type]
                if ids and rec.get("record_id") in ids:
                    ids.discard(rec["record_id"])  # re-emitted once: never again
                    self.duplicates.inc()
                    continue
            n += 1
            key = self._key((rec["namespace"], rec.get("team") or rec["namespace"], rec["gpu_model"]))
            alloc, used, idle, energy, cost = self._children(key, rec.get("currency") or self.currency)
            alloc.inc(_counted(rec["allocated_gpu_seconds"]))
            used.inc(_counted(rec["used_gpu_seconds"]))
            idle.inc(_counted(rec["idle_gpu_seconds"]))
            energy.inc(_counted(rec["energy_joules"]))
            cost.inc(_counted(rec["cost_total"]))
        return n
