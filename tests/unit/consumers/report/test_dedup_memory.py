"""The idempotency key with the report's de-duplication, and the report in bounded memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.reader import Deduplicator, deduplicated
from gpupipe_consumers.report.workload_report import build_workload_report
from tests.synthetic_fleet import FleetSpec, generate_fleet
from tests.unit.consumers.chargeback.test_windows import T0, sample

H = 3_600_000


def run_engine(records: list, start_at: int = 0, poll_every: int = 500) -> list[dict]:
    eng = WindowEngine(H, 300_000, instance_id="x")
    out = []
    for i, r in enumerate(records[start_at:]):
        eng.add(r.sample, r.partition, r.offset)
        if i % poll_every == 0:
            out += eng.poll_closed()
    return out + eng.flush_all()


def test_re_emitted_output_is_counted_once() -> None:
    """An offset reset (metadata lost) re-processes the input: the same records come out again
    with the same record_id, and the report counts them once."""
    fleet = generate_fleet(FleetSpec(gpus=4, hours=2.5, seed=3))
    first = run_engine(fleet)
    assert all(r["record_id"] for r in first)
    assert len({r["record_id"] for r in first}) == len(first)
    again = run_engine(fleet)  # the whole input re-processed by a fresh instance
    assert sorted(r["record_id"] for r in again) == sorted(r["record_id"] for r in first)
    dedup = Deduplicator()
    both = list(deduplicated(((r, r["window_end_ms"]) for r in first + again), dedup))
    assert dedup.dropped == len(again)
    single = build_report(first, period="all")
    doubled = build_report(first + again, period="all")
    once = build_report(both, period="all")
    assert [r.cost for r in once] == pytest.approx([r.cost for r in single])
    assert sum(r.cost for r in doubled) == pytest.approx(2 * sum(r.cost for r in single))


def test_re_processed_corrections_are_the_same_records_whenever_committed() -> None:
    """A re-processing run commits at other moments: corrections are grouped by runs of late
    records (late_runs.py), not by commit, so they come out with the same record_ids."""
    fleet = generate_fleet(FleetSpec(gpus=8, hours=3, seed=3))
    first = run_engine(fleet)
    again = run_engine(fleet, poll_every=137)  # the same input, other commit boundaries
    corrections = [r for r in first if r["kind"] == "correction"]
    assert corrections and all(r["late_offsets"] for r in corrections)
    assert sorted(r["record_id"] for r in again) == sorted(r["record_id"] for r in first)
    dedup = Deduplicator()
    both = list(deduplicated(((r, r["window_end_ms"]) for r in first + again), dedup))
    assert dedup.dropped == len(again)
    single = build_report(first, period="all")
    once = build_report(both, period="all")
    assert [r.cost for r in once] == pytest.approx([r.cost for r in single])


def test_corrections_of_an_older_writer_grouped_per_commit_are_counted_once() -> None:
    """Writers before late runs grouped late samples per commit: a correction of theirs that sums
    several runs' samples makes the later, finer ones copies (all their late_offsets counted)."""
    e = WindowEngine(H, 300_000, instance_id="x")
    seq = [sample(T0), sample(T0 + 2 * H, uuid="GPU-b")]  # window T0 closes
    for k in range(1, 4):  # late samples of GPU-a, each run ended by GPU-b entering a new window
        seq += [sample(T0 + k * 10_000), sample(T0 + (2 + k) * H, uuid="GPU-b")]
    for off, smp in enumerate(seq):
        e.add(smp, 0, off)
    by_row: dict[tuple, list[dict]] = {}
    for r in e.poll_closed() + e.flush_all():
        if r["kind"] == "correction":
            row = (r["source_partition"], r["window_start_ms"], r["namespace"], r["node"], r["gpu_model"])
            by_row.setdefault(row, []).append(r)
    row, parts = max(by_row.items(), key=lambda kv: len(kv[1]))
    assert len(parts) > 1  # that row's late samples came in several runs
    sums = ("allocated_gpu_seconds", "used_gpu_seconds", "energy_joules", "cost_allocation", "cost_energy")
    old = {**parts[0], **{f: sum(p[f] for p in parts) for f in sums}}
    old["late_offsets"] = sorted(o for p in parts for o in p["late_offsets"])
    old["record_id"] = (
        old["record_id"].rsplit("|", 1)[0] + f"|{old['late_offsets'][0]}-{old['late_offsets'][-1]}"
    )
    dedup = Deduplicator()
    kept = list(deduplicated(((r, r["window_end_ms"]) for r in [old, *parts]), dedup))
    assert kept == [old] and dedup.dropped == len(parts)


def synthetic(n: int, days: int = 400) -> Iterator[tuple[dict, int]]:
    """``n`` records spread over ``days`` days (10 namespaces x 4 nodes per window)."""
    per_window = 40
    windows = max(1, n // per_window)
    step = days * 24 * H // windows
    step -= step % 60_000
    for w in range(windows):
        start = 1_767_225_600_000 + w * step
        for i in range(per_window):
            rec = {
                "kind": "window",
                "window_start_ms": start,
                "window_end_ms": start + H,
                "namespace": f"ns-{i % 10}",
                "team": None,
                "node": f"node-{i // 10}",
                "gpu_model": "NVIDIA H200",
                "allocated_gpu_seconds": 3600.0,
                "used_gpu_seconds": 1800.0,
                "idle_gpu_seconds": 0.0,
                "activity_unknown_gpu_seconds": 0.0,
                "energy_joules": 1.0,
                "cost_allocation": 4.0,
                "cost_energy": 0.0,
                "currency": "USD",
                "price_source": "exact",
                "record_id": f"window|0|{start}|ns-{i % 10}|node-{i // 10}|NVIDIA H200|0",
            }
            yield rec, start + H + 60_000


def by_owner(records: Any, **kw: Any) -> list:
    return build_workload_report(records, by=("namespace", "owner"), **kw)


def peak_bytes(n: int, builder: Any, period: str) -> tuple[int, float]:
    tracemalloc.start()
    try:
        rows = builder(deduplicated(synthetic(n)), period=period)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, sum(r.cost for r in rows)


@pytest.mark.parametrize(
    ("builder", "period"), [(build_report, "month"), (by_owner, "all")], ids=["namespace", "owner-all"]
)
def test_report_memory_does_not_grow_with_the_number_of_records(builder: Any, period: str) -> None:
    """400 days of records: peak memory for 4x the records stays about the same (rows and the
    de-duplication horizon, not the topic, bound it). The workload path (--by owner, label teams,
    --carbon) kept every record of the range in a list."""
    small_peak, small_cost = peak_bytes(10_000, builder, period)
    big_peak, big_cost = peak_bytes(40_000, builder, period)
    assert big_cost == pytest.approx(4 * small_cost, rel=1e-3)
    assert big_peak < 1.5 * small_peak, (small_peak, big_peak)
    assert big_peak < 10 * 2**20
