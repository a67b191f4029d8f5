"""A node clock running ahead, bounded by broker time (LogAppendTime record timestamps).

Two GPUs share one input partition for 3 hours at 10 s: ``good`` has a correct clock, ``fast`` runs
ahead. The record timestamp is the broker's append time (true time + 200 ms). Whatever ``fast``
does, ``good`` must be billed exactly, in final window records (no corrections), with its energy
from the counter; ``fast`` must be billed once per sample.
"""

from __future__ import annotations

import pytest

from gpupipe_consumers.chargeback.settings import ChargebackSettings
from tests.unit.consumers.chargeback.test_windows import MIN, T0, engine, sample, totals

H = 60 * MIN
TICKS = 3 * 360
LATENCY = 200


def run(skew_of: callable) -> tuple[list[dict], dict]:  # type: ignore[valid-type]
    e = engine(max_clock_skew_ms=ChargebackSettings().max_clock_skew_ms)
    out: list[dict] = []
    off = 0
    for k in range(TICKS):
        true = T0 + k * 10_000
        for uuid, ahead in (("GPU-good", 0), ("GPU-fast", skew_of(k))):
            s = sample(true + ahead, uuid, ns=uuid.lower(), power_w=300.0, total_energy_mj=k * 3_000_000)
            e.add(s, 0, off, record_ts_ms=true + LATENCY)
            off += 1
        if k % 6 == 5:  # one commit per minute of data
            out += e.poll_closed()
    out += e.flush_all()
    return out, dict(e.stats)


@pytest.mark.parametrize(
    "skew_of",
    [
        lambda k: 10 * MIN,  # a node 10 min ahead, all the time
        lambda k: 24 * H if k < 30 else 0,  # 24 h ahead for 5 min after boot, then NTP fixes it
    ],
    ids=["10min-ahead", "24h-burst"],
)
def test_a_clock_ahead_is_billed_once_by_broker_time(skew_of) -> None:
    out, stats = run(skew_of)
    assert [r for r in out if r["kind"] == "correction"] == []
    by_ns = totals(out, key=lambda r: (r["namespace"],))
    good = by_ns[("gpu-good",)]
    assert good["allocated_gpu_seconds"] == pytest.approx(TICKS * 10)
    estimated = sum(r["energy_estimated_joules"] for r in out if r["namespace"] == "gpu-good")
    assert estimated == pytest.approx(10 * 300.0)  # only the first sample: counters used throughout
    assert good["energy_joules"] == pytest.approx(TICKS * 10 * 300.0)
    fast = by_ns[("gpu-fast",)]
    assert fast["allocated_gpu_seconds"] == pytest.approx(TICKS * 10, rel=1e-3)
    assert fast["sample_count"] == TICKS
    assert stats["clock_ahead"] > 0 and stats.get("duplicate", 0) == 0
    # Every window is the broker's hour: nothing billed 24 h (or 10 min) in the future.
    assert {r["window_start_ms"] for r in out} == {T0, T0 + H, T0 + 2 * H}
