"""Prices by time of use. A change applies to usage from its valid_from on, never to
replayed or corrected windows before it, and never depends on which instance emits a window."""

from __future__ import annotations

import pytest
import yaml

from gpupipe.domain.price_schedule import load_price_schedule, parse_price_schedule
from gpupipe.domain.prices import PriceTableError
from gpupipe_consumers.chargeback.windows import WindowEngine
from tests.unit.consumers.chargeback.test_windows import MIN, T0, sample

H = 60 * MIN
DOC = """
currency: USD
energy_per_kwh: 0.10
default_per_gpu_hour: 1.0
models: [{match: NVIDIA H200, per_gpu_hour: 4.0}]
changes:
  - valid_from: 2026-01-01T01:00:00Z
    models: [{match: NVIDIA H200, per_gpu_hour: 8.0}]
"""
SCHEDULE = parse_price_schedule(yaml.safe_load(DOC), "test")


def test_the_table_in_force_is_looked_up_by_time_of_use() -> None:
    assert T0 == 1_767_225_600_000  # 2026-01-01T00:00:00Z, the DOC's base
    assert SCHEDULE.at(T0).gpu_price("NVIDIA H200").per_gpu_hour == 4.0
    assert SCHEDULE.at(T0 + H - 1).gpu_price("NVIDIA H200").per_gpu_hour == 4.0
    assert SCHEDULE.at(T0 + H).gpu_price("NVIDIA H200").per_gpu_hour == 8.0
    assert SCHEDULE.at(T0 + H).energy_per_kwh == 0.10  # keys not changed are inherited


def engine() -> WindowEngine:
    return WindowEngine(H, 5 * MIN, SCHEDULE, instance_id="t")


def test_windows_and_late_corrections_keep_the_price_of_their_time() -> None:
    e = engine()
    out = []
    for k in range(0, 2 * 360):  # 00:00 .. 02:00, 10 s samples
        e.add(sample(T0 + k * 10_000), 0, k)
        if k == 400:  # 01:06:40, window 0 closed: a sample of 00:59:50 arrives very late
            e.add(sample(T0 + 359 * 10_000 - 5_000, uuid="GPU-late"), 0, 10_000)
        out += e.poll_closed()
    out += e.flush_all()
    by = {(r["kind"], r["window_start_ms"], r["namespace"]): r for r in out if r["namespace"] == "team-a"}
    assert by[("window", T0, "team-a")]["price_per_gpu_hour"] == 4.0
    assert by[("window", T0, "team-a")]["cost_allocation"] == pytest.approx(4.0)
    assert by[("window", T0 + H, "team-a")]["price_per_gpu_hour"] == 8.0
    assert by[("window", T0 + H, "team-a")]["cost_allocation"] == pytest.approx(8.0)
    (late,) = [r for r in out if r["kind"] == "correction"]
    assert late["window_start_ms"] == T0 and late["price_per_gpu_hour"] == 4.0  # not today's 8.0


def test_replay_and_a_rolling_restart_cannot_mix_prices_in_one_window() -> None:
    """Two instances (old pod, new pod) emitting the same hour from different partitions, one of them
    after a restart that replays the window: one price per window, whichever emits it."""
    old, new = engine(), engine()
    for k in range(360, 2 * 360 + 40):
        old.add(sample(T0 + k * 10_000, uuid="GPU-a"), 0, k)
        new.add(sample(T0 + k * 10_000, uuid="GPU-b"), 1, k)
    recs = [r for r in old.poll_closed() + new.poll_closed() if r["window_start_ms"] == T0 + H]
    assert len(recs) == 2 and {r["price_per_gpu_hour"] for r in recs} == {8.0}


def test_a_change_off_a_window_boundary_is_refused() -> None:
    doc = yaml.safe_load(DOC.replace("01:00:00Z", "01:30:00Z"))
    with pytest.raises(PriceTableError, match="window boundary"):
        WindowEngine(H, 5 * MIN, parse_price_schedule(doc, "t"), instance_id="t")
    WindowEngine(30 * MIN, 5 * MIN, parse_price_schedule(doc, "t"), instance_id="t")  # fine for 30m


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("{valid_from: 2025-01-01T00:00:00Z, currency: EUR}", "unknown keys"),
        ("{energy_per_kwh: 0.2}", "valid_from"),
        ("{valid_from: not-a-time}", "ISO-8601"),
        ("{valid_from: 1970-01-01T00:00:00Z}", "later than"),
        ("{valid_from: 2026-02-01T00:00:00Z, models: [{match: X, per_gpu_hour: -1}]}", "non-negative"),
    ],
)
def test_bad_changes_are_clear_errors(change: str, match: str, tmp_path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(f"currency: USD\nmodels: []\nchanges: [{change}]\n")
    with pytest.raises(PriceTableError, match=match):
        load_price_schedule(path)


def versions(n: int, last_price: float = 9.0) -> dict:
    """A schedule with ``n`` hourly changes, the last one at ``last_price``."""
    changes = [
        {
            "valid_from": f"2026-01-01T{h:02d}:00:00Z",
            "models": [{"match": "NVIDIA H200", "per_gpu_hour": 4.0 + h}],
        }
        for h in range(1, n)
    ]
    if changes:
        changes[-1]["models"][0]["per_gpu_hour"] = last_price
    return {**yaml.safe_load(DOC.split("changes:")[0]), "changes": changes}


def test_fingerprints_tell_from_when_two_schedules_price_differently() -> None:
    """D6: what checkpoints carry so that instances of a rolling update agree on prices."""
    from gpupipe.domain.price_schedule import divergence, fingerprint

    same = parse_price_schedule(yaml.safe_load(DOC.replace("4.0", "4.00")), "reformatted")
    assert divergence(fingerprint(SCHEDULE), fingerprint(same)) is None
    base = parse_price_schedule(yaml.safe_load(DOC.split("changes:")[0]), "no change")
    assert divergence(fingerprint(SCHEDULE), fingerprint(base)) == T0 + H  # from the change on
    cheaper = parse_price_schedule(yaml.safe_load(DOC.replace("4.0", "3.0")), "base edited")
    assert divergence(fingerprint(SCHEDULE), fingerprint(cheaper)) == 0  # from the beginning
    # Long schedules keep their newest versions only; the hash chain still covers the older ones.
    a, b = parse_price_schedule(versions(20), "a"), parse_price_schedule(versions(20, 10.0), "b")
    assert len(fingerprint(a)) == 16 and divergence(fingerprint(a), fingerprint(a)) is None
    assert divergence(fingerprint(a), fingerprint(b)) == T0 + 19 * H
    longer = parse_price_schedule(versions(21), "c")
    assert divergence(fingerprint(a), fingerprint(longer)) == T0 + 19 * H  # 19's price differs
