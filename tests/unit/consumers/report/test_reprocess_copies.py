"""Records re-emitted by a reprocess (an offset reset) are billed once, in every report.

* FOCUS bills a record written after its month was invoiced in a later month: a copy of a 27
  February window written on 2 March (default ``--invoice-lag`` 1 day, samples retained 3 days) is
  late, and the March invoice must read back far enough to find the original and drop the copy.
"""

from __future__ import annotations

from typing import Any

from gpupipe.common.durations import parse_iso_ms
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.reader import Deduplicator, deduplicated, read_from_ms
from tests.synthetic_fleet import FleetSpec, generate_fleet

H, DAY = 3_600_000, 86_400_000
FEB, MAR, APR = (
    parse_iso_ms(s) for s in ("2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z")
)


def a_window() -> dict[str, Any]:
    eng = WindowEngine(H, 300_000, instance_id="x")
    for r in generate_fleet(FleetSpec(gpus=1, hours=2, seed=3)):
        eng.add(r.sample, r.partition, r.offset)
    return next(r for r in eng.flush_all() if r["kind"] == "window")


def invoice(topic: list[tuple[dict[str, Any], int]], start: int, end: int) -> tuple[float, int]:
    """(GPU-hours, copies dropped) of the FOCUS invoice of [start, end), reading the topic as the
    report does: from the offsets for ``read_from_ms`` on."""
    since = read_from_ms(start, billing=True)
    assert since is not None
    dedup = Deduplicator()
    seen = [(dict(r), ts) for r, ts in topic if ts >= since]
    rows = build_report(
        deduplicated(seen, dedup), start_ms=start, end_ms=end, period="all", billing_lag_ms=DAY
    )
    return sum(r.gpu_hours_allocated for r in rows), dedup.dropped


def test_a_copy_written_after_the_invoice_is_not_billed_again_next_month() -> None:
    rec = a_window()
    feb27 = parse_iso_ms("2026-02-27T10:00:00Z")
    orig = {**rec, "window_start_ms": feb27, "window_end_ms": feb27 + H, "emitted_at_ms": feb27 + H}
    copy = dict(orig)  # the same record_id, re-emitted by a reprocess on 2 March
    topic = [(orig, feb27 + H + 300_000), (copy, parse_iso_ms("2026-03-02T09:00:00Z"))]
    gpu_h = rec["allocated_gpu_seconds"] / 3600
    assert invoice(topic, FEB, MAR) == (gpu_h, 1)
    assert invoice(topic, MAR, APR) == (0.0, 1)  # read back to 27 February: the copy is dropped


def test_only_billing_mode_reads_further_back() -> None:
    assert read_from_ms(MAR) == MAR - DAY
    assert read_from_ms(MAR, billing=True) == MAR - DAY - 5 * DAY
    assert read_from_ms(None, billing=True) is None
    assert read_from_ms(DAY, billing=True) == 0
