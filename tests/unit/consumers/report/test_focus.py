"""The FOCUS export against the FOCUS 1.3 column list and allowed values (tests/fixtures/focus, with
its sources), and the billing-period rules: ChargeClass null in period, late corrections
billed in the period in which they were recorded, charge periods inside the billing period."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest

from gpupipe_consumers.report.chargeback_report import RECORDED_AT, build_report
from gpupipe_consumers.report.formats import FocusOptions, render_report
from gpupipe_consumers.report.workload_report import build_workload_report
from tests.paths import TESTS

SPEC = TESTS / "fixtures" / "focus"
DAY = 86_400_000
H = 3_600_000
OCT = 1_790_812_800_000  # 2026-10-01T00:00:00Z
NOV = OCT + 31 * DAY
DEC = NOV + 30 * DAY


def spec_columns() -> dict[str, str]:
    with (SPEC / "focus-1.3-cost-and-usage-columns.csv").open() as f:
        return {row["ColumnId"]: row["FeatureLevel"] for row in csv.DictReader(f)}


def rec(
    ws: int, ns: str, gpu_s: float, *, kind: str = "window", emitted: int | None = None, **kw: Any
) -> dict:
    out = {
        "kind": kind,
        "window_start_ms": ws,
        "window_end_ms": ws + H,
        "namespace": ns,
        "team": None,
        "node": "node-1",
        "gpu_model": "NVIDIA H200",
        "allocated_gpu_seconds": gpu_s,
        "used_gpu_seconds": gpu_s / 2,
        "idle_gpu_seconds": 0.0,
        "activity_unknown_gpu_seconds": 0.0,
        "energy_joules": gpu_s * 300,
        "cost_allocation": gpu_s / 3600 * 4.0,
        "cost_energy": gpu_s * 300 / 3.6e6 * 0.1,
        "price_per_gpu_hour": 4.0,
        "price_per_kwh": 0.1,
        "price_source": "exact",
        "currency": "USD",
        "emitted_at_ms": emitted if emitted is not None else ws + H + 300_000,
    }
    out.update(kw)
    return out


RECORDS = [
    rec(OCT + 10 * DAY, "ml", 3600.0),
    rec(OCT + 10 * DAY, "__unallocated__", 1800.0),
    rec(OCT + 10 * DAY, "web", 1800.0),
    # a correction within October (recorded an hour later): same billing period, ChargeClass null
    rec(OCT + 10 * DAY, "ml", 36.0, kind="correction", emitted=OCT + 10 * DAY + 3 * H),
    rec(OCT + 31 * DAY - H, "ml", 3600.0),  # the last hour of October, emitted 5 minutes into November
    rec(NOV + 2 * DAY, "ml", 3600.0),
    # a correction of October recorded on 5 November, after October was invoiced
    rec(OCT + 20 * DAY, "ml", 360.0, kind="correction", emitted=NOV + 5 * DAY),
]


def by_owner(records: list[dict], **kw: Any) -> list:
    """The FOCUS export through the workload path (``--by namespace,owner``, ``--carbon``, label
    teams take it): it must bill by the same periods (it billed by window start)."""
    return build_workload_report(records, by=("namespace", "owner"), **kw)


def focus(
    start: int | None,
    end: int | None,
    period: str = "window",
    records: list[dict] | None = None,
    builder: Any = build_report,
    **kw: Any,
) -> list[dict[str, str]]:
    rows = builder(
        RECORDS if records is None else records,
        start_ms=start,
        end_ms=end,
        period=period,
        billing_lag_ms=DAY,
        **kw,
    )
    return list(csv.DictReader(io.StringIO(render_report(rows, "focus", focus=FocusOptions()))))


BUILDERS = pytest.mark.parametrize("builder", [build_report, by_owner], ids=["namespace", "owner"])


def test_columns_follow_the_focus_1_3_column_list() -> None:
    spec = spec_columns()
    header = render_report([], "focus").splitlines()[0].split(",")
    ours = [c for c in header if not c.startswith("x_")]
    assert header[: len(ours)] == ours  # custom x_ columns after the FOCUS ones
    assert set(ours) <= set(spec), set(ours) - set(spec)
    mandatory = {c for c, level in spec.items() if level == "Mandatory"}
    assert mandatory <= set(ours), mandatory - set(ours)
    split_cost = {
        "AllocatedMethodId",
        "AllocatedMethodDetails",
        "AllocatedResourceId",
        "AllocatedResourceName",
    }
    assert split_cost | {"AllocatedTags"} <= set(ours)  # split cost allocation for shared GPUs


def test_values_are_allowed_and_consistent() -> None:
    allowed = json.loads((SPEC / "enumerations.json").read_text())
    lines = focus(OCT, DEC)
    assert lines
    for line in lines:
        for col, values in allowed.items():
            if col == "ChargeClass":
                assert line[col] in ("", *values)
            else:
                assert line[col] in values, (col, line[col])
        assert line["ServiceProviderName"] and line["HostProviderName"]
        details = json.loads(line["AllocatedMethodDetails"])
        (element,) = details["Elements"]
        assert 0 <= element["AllocatedRatio"] <= 1 and element["UsageUnit"] in ("GPU-Hours", "kWh")
        if line["x_Namespace"].startswith("__"):  # the unallocated portion of the origin charge
            assert line["AllocatedResourceId"] == ""
        else:
            assert line["AllocatedResourceId"] and line["AllocatedMethodId"]
        json.loads(line["AllocatedTags"])
    # Allocated ratios of one origin charge add up to 1.
    by_origin: dict[tuple, float] = {}
    for line in lines:
        if line["ConsumedUnit"] == "GPU-Hours":
            k = (
                line["BillingPeriodStart"],
                line["ChargePeriodStart"],
                line["ChargeClass"],
                line["ResourceId"],
            )
            by_origin[k] = (
                by_origin.get(k, 0.0)
                + json.loads(line["AllocatedMethodDetails"])["Elements"][0]["AllocatedRatio"]
            )
    assert all(v == pytest.approx(1.0, abs=1e-5) for v in by_origin.values())


@BUILDERS
def test_late_corrections_are_billed_in_the_period_in_which_they_were_recorded(builder: Any) -> None:
    october = focus(OCT, NOV, builder=builder)
    november = focus(NOV, DEC, builder=builder)
    assert all(line["ChargeClass"] == "" for line in october)  # the in-period correction is merged
    ml_oct = [ln for ln in october if ln["x_Namespace"] == "ml" and ln["ConsumedUnit"] == "GPU-Hours"]
    assert sum(float(ln["ConsumedQuantity"]) for ln in ml_oct) == pytest.approx(1.01 + 1.0)
    (corr,) = [
        ln for ln in november if ln["ChargeClass"] == "Correction" and ln["ConsumedUnit"] == "GPU-Hours"
    ]
    assert corr["BillingPeriodStart"] == "2026-11-01T00:00:00Z"
    assert corr["ChargePeriodStart"] == "2026-10-21T00:00:00Z"  # the corrected charge period
    assert float(corr["ConsumedQuantity"]) == pytest.approx(0.1)
    # Re-running October after November started gives the same October (the correction is not there).
    assert focus(OCT, NOV, builder=builder) == october
    # The window of October's last hour, emitted on 1 November, is still October's.
    assert any(ln["ChargePeriodStart"] == "2026-10-31T23:00:00Z" for ln in october)


@BUILDERS
def test_period_all_never_charges_outside_the_billing_period(builder: Any) -> None:
    lines = focus(OCT, DEC, period="all", builder=builder)
    assert lines
    for line in lines:
        if line["ChargeClass"] == "":
            assert line["BillingPeriodStart"] <= line["ChargePeriodStart"] < line["ChargePeriodEnd"]
            assert line["ChargePeriodEnd"] <= line["BillingPeriodEnd"]
    assert {ln["BillingPeriodStart"] for ln in lines} == {"2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z"}


@BUILDERS
def test_sku_price_id_is_the_price_table_entry(builder: Any) -> None:
    lines = [ln for ln in focus(OCT, DEC, builder=builder) if ln["ConsumedUnit"] == "GPU-Hours"]
    assert {ln["SkuPriceId"] for ln in lines} == {"gpu-hour/NVIDIA H200/4.000000"}
    assert all(ln["ListUnitPrice"] == "4.000000" for ln in lines)


@BUILDERS
def test_a_record_written_after_the_invoice_is_billed_when_written_not_by_its_watermark(
    builder: Any,
) -> None:
    """D5: chargeback fell three days behind (an outage): the window of 31 October 22:00 is written
    on 3 November, after October was invoiced, yet it carries the partition's event-time watermark
    of 31 October as emitted_at_ms. Its Kafka timestamp says when it was written: it belongs to
    November's export, as a correction of October's charge period, and never to October's (which
    was cut on 2 November and must not change afterwards)."""
    late = rec(NOV - 2 * H, "ml", 1800.0, emitted=NOV - 50 * 60_000)
    late[RECORDED_AT] = NOV + 3 * DAY
    on_time = rec(NOV - 3 * H, "ml", 3600.0, emitted=NOV - 2 * H + 300_000)
    on_time[RECORDED_AT] = NOV - 2 * H + 301_000
    records = [on_time, late]
    october = focus(OCT, NOV, records=records, builder=builder)
    november = focus(NOV, DEC, records=records, builder=builder)
    gpu = "GPU-Hours"
    assert [(ln["ChargePeriodStart"], ln["ChargeClass"]) for ln in october if ln["ConsumedUnit"] == gpu] == [
        ("2026-10-31T21:00:00Z", "")
    ]
    (corr,) = [ln for ln in november if ln["ConsumedUnit"] == gpu]
    assert (corr["BillingPeriodStart"], corr["ChargePeriodStart"], corr["ChargeClass"]) == (
        "2026-11-01T00:00:00Z",
        "2026-10-31T22:00:00Z",
        "Correction",
    )
    assert float(corr["ConsumedQuantity"]) == pytest.approx(0.5)
