"""Chargeback's Prometheus counters: fed from committed windows, primed at 0, equal to the report."""

from __future__ import annotations

from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry

from gpupipe_consumers.chargeback.prom_counters import WindowCounters
from gpupipe_consumers.report.chargeback_report import build_report
from scripts.report_example_data import simulated_windows


def _samples(reg: CollectorRegistry, name: str) -> dict[tuple, float]:
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_counters_add_up_to_the_report_per_team_and_model():
    records = simulated_windows(3, nodes=2)
    reg = CollectorRegistry()
    counters = WindowCounters(reg, "USD")
    counters.add(records)
    rows = build_report(records, by=("namespace",), period="all")
    want_cost: dict[tuple[str, str], float] = defaultdict(float)
    want_alloc: dict[str, float] = defaultdict(float)
    for r in rows:
        want_cost[(r.namespace, r.gpu_model)] += r.cost
        want_alloc[r.namespace] += r.gpu_hours_allocated * 3600
    got_cost: dict[tuple[str, str], float] = defaultdict(float)
    for labels, v in _samples(reg, "gpupipe_chargeback_cost_total").items():
        d = dict(labels)
        assert d["currency"] == "USD" and d["team"] == d["namespace"]  # no team mapping here
        got_cost[(d["namespace"], d["gpu_model"])] += v
    assert got_cost.keys() == want_cost.keys()
    for k, v in want_cost.items():
        assert got_cost[k] == pytest.approx(v, rel=1e-9)
    got_alloc: dict[str, float] = defaultdict(float)
    for labels, v in _samples(reg, "gpupipe_chargeback_allocated_gpu_seconds_total").items():
        got_alloc[dict(labels)["namespace"]] += v
    assert got_alloc == pytest.approx(dict(want_alloc), rel=1e-9)
    assert "__unallocated__" in got_alloc


def test_prime_creates_series_at_zero_once_and_maps_teams():
    reg = CollectorRegistry()
    counters = WindowCounters(reg, "EUR")
    counters.prime([("ml-train", "NVIDIA H200"), ("__unallocated__", "NVIDIA H200")], {"ml-train": "ml"}.get)
    cost = _samples(reg, "gpupipe_chargeback_cost_total")
    assert set(cost.values()) == {0.0} and len(cost) == 2
    teams = {dict(k)["namespace"]: dict(k)["team"] for k in cost}
    assert teams == {"ml-train": "ml", "__unallocated__": "__unallocated__"}
    rec = {
        "namespace": "ml-train", "team": "ml", "gpu_model": "NVIDIA H200", "currency": "EUR",
        "allocated_gpu_seconds": 3600.0, "used_gpu_seconds": 1800.0, "idle_gpu_seconds": 0.0,
        "energy_joules": 3.6e6, "cost_total": 4.25,
    }  # fmt: skip
    counters.add([rec])
    counters.prime([("ml-train", "NVIDIA H200")], {"ml-train": "ml"}.get)  # no reset
    cost = _samples(reg, "gpupipe_chargeback_cost_total")
    key = (("currency", "EUR"), ("gpu_model", "NVIDIA H200"), ("namespace", "ml-train"), ("team", "ml"))
    assert cost[key] == 4.25
    assert _samples(reg, "gpupipe_chargeback_used_gpu_seconds_total")[key[1:]] == 1800.0


def test_engine_lists_the_rows_of_open_windows():
    from gpupipe_consumers.chargeback.windows import WindowEngine
    from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
    from gpupipe_schemas.meaning import gpu_key
    from tests.synthetic_fleet import partition_of

    fleet = SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=8, seed=11, interval_ms=60_000))
    engine = WindowEngine()
    offsets: dict[int, int] = defaultdict(int)
    models, namespaces = set(), set()
    for k in range(10):  # ten minutes: the first hour's window stays open
        samples, _ = fleet.tick(1_795_000_000_000 - 1_795_000_000_000 % 3_600_000 + k * 60_000)
        for s in samples:
            p = partition_of(gpu_key(s), 3)
            engine.add(s, p, offsets[p])
            offsets[p] += 1
            models.add(s["model_name"])
            namespaces |= {a["namespace"] for a in s.get("allocations") or ()}
    rows = engine.open_rows()
    assert engine.poll_closed() == [] and rows
    assert {m for _, m in rows} == models and namespaces <= {ns for ns, _ in rows}


def test_past_the_cap_new_namespaces_count_as_overflow_and_totals_hold() -> None:
    records = simulated_windows(3, nodes=2)
    namespaces = sorted({r["namespace"] for r in records})
    assert len(namespaces) > 3
    reg = CollectorRegistry()
    counters = WindowCounters(reg, "USD", max_series=3)
    counters.add(records)
    costs = _samples(reg, "gpupipe_chargeback_cost_total")
    assert len(costs) <= 3 + len({r["gpu_model"] for r in records})
    assert "__overflow__" in {dict(labels)["namespace"] for labels in costs}
    assert sum(costs.values()) == pytest.approx(sum(r["cost_total"] for r in records), rel=1e-9)
    assert (
        reg.get_sample_value("gpupipe_chargeback_series_overflow_records_total")
        == counters.overflow_records
        > 0
    )


def test_a_non_finite_record_adds_nothing() -> None:
    rec = simulated_windows(1, nodes=1)[0]
    reg = CollectorRegistry()
    counters = WindowCounters(reg, "USD")
    counters.add([{**rec, "cost_total": float("nan"), "energy_joules": float("inf")}])
    assert set(_samples(reg, "gpupipe_chargeback_cost_total").values()) == {0.0}
    assert set(_samples(reg, "gpupipe_chargeback_energy_joules_total").values()) == {0.0}
