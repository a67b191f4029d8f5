"""Report formats against golden files, plus the structural rules of each format.

Regenerate the golden files after an intended change, and review the diff:
``GPUPIPE_UPDATE_GOLDEN=1 pytest tests/unit/consumers/report/test_formats.py``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re

import pytest

from gpupipe.domain.teams import load_team_map
from gpupipe_consumers.report.chargeback_report import build_report, read_records_jsonl
from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_consumers.report.formats import COLUMNS, FOCUS_COLUMNS, FORMATS, FocusOptions, render_report
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "chargeback"
T0 = 1_767_225_600_000
H = 3_600_000
UPDATE = os.environ.get("GPUPIPE_UPDATE_GOLDEN") == "1"


def _rows(**kw):
    records = read_records_jsonl((FIXTURES / "windows.jsonl").read_text().splitlines())
    kw.setdefault("teams", load_team_map(FIXTURES / "teams.yaml"))
    return build_report(records, start_ms=T0, end_ms=T0 + 2 * H, **kw)


GOLDEN = [
    ("table", {}, "report.table.txt"),
    ("csv", {}, "report.csv"),
    ("json", {}, "report.json"),
    ("jsonl", {"by": ("team",), "period": "all"}, "report-by-team.jsonl"),
    ("table", {"by": ("team",), "period": "all"}, "report-by-team.table.txt"),
    ("focus", {"billing_lag_ms": 86_400_000}, "report.focus.csv"),
    ("focus", {"billing_lag_ms": 86_400_000, "by": ("team",)}, "report-by-team-split.focus.csv"),
]


@pytest.mark.parametrize(("fmt", "kwargs", "golden"), GOLDEN, ids=[g for _, _, g in GOLDEN])
def test_golden(fmt, kwargs, golden):
    text = render_report(_rows(**kwargs), fmt)
    path = FIXTURES / golden
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


def test_every_format_renders_an_empty_report():
    for fmt in FORMATS:
        text = render_report([], fmt)
        assert text.endswith("\n") or (fmt == "jsonl" and text == "")


def test_unknown_format():
    with pytest.raises(ReportOptionError):
        render_report([], "xml")


def test_table_is_aligned_with_a_totals_row():
    lines = render_report(_rows(), "table").splitlines()
    header, rule = lines[0], lines[1]
    assert header.startswith("WINDOW START") and set(rule) <= {"-", " "}
    total = next(line for line in lines if line.startswith("TOTAL"))
    body = [line for line in lines[2:] if not line.startswith(("-", "TOTAL", "*"))]
    cost_end = header.index("COST") + len("COST")
    assert all(line[cost_end - 1].isdigit() for line in [*body, total])  # right-aligned numbers
    assert "Acme X1 *" in "\n".join(body) and lines[-1].startswith("* GPU model not in the price table")
    assert "__unallocated__" in body[-1] or "__mig_shared__" in body[-1]


def test_csv_and_json_agree():
    rows = _rows()
    parsed_csv = list(csv.DictReader(io.StringIO(render_report(rows, "csv"))))
    parsed_json = json.loads(render_report(rows, "json"))
    assert list(parsed_csv[0]) == list(COLUMNS) == list(parsed_json[0])
    assert len(parsed_csv) == len(parsed_json) == len(rows)
    for c, j in zip(parsed_csv, parsed_json, strict=True):
        assert float(c["cost"]) == pytest.approx(j["cost"], abs=0.01)  # CSV: rounded to cents
        assert c["namespace"] == j["namespace"]
    lines = render_report(rows, "jsonl").splitlines()
    assert [json.loads(line) for line in lines] == parsed_json


def _focus(**kw):
    return list(csv.DictReader(io.StringIO(render_report(_rows(**kw), "focus", focus=FocusOptions()))))


def test_focus_columns_and_rules():
    header = render_report(_rows(), "focus").splitlines()[0].split(",")
    assert header == list(FOCUS_COLUMNS)
    first_custom = next(i for i, c in enumerate(header) if c.startswith("x_"))
    assert all(c.startswith("x_") for c in header[first_custom:])  # custom columns after FOCUS ones
    stamp = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
    lines = _focus()
    assert lines
    for line in lines:
        for col in ("ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodStart", "BillingPeriodEnd"):
            assert stamp.match(line[col]), col
        assert line["ChargePeriodStart"] < line["ChargePeriodEnd"]
        assert line["BillingPeriodStart"] <= line["ChargePeriodStart"] < line["BillingPeriodEnd"]
        assert line["ChargeCategory"] == "Usage" and line["ChargeClass"] == ""
        assert line["BillingCurrency"] == "USD"
        for col in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost"):
            assert line[col] == line["BilledCost"]
        assert float(line["ListCost"]) == pytest.approx(
            float(line["ListUnitPrice"]) * float(line["PricingQuantity"]), abs=1e-5
        )
        assert (line["ConsumedQuantity"] == "") == (line["ConsumedUnit"] == "")
        assert line["ConsumedUnit"] in ("GPU-Hours", "kWh")
        tags = json.loads(line["Tags"])
        assert all(k.startswith("gpupipe/") and isinstance(v, str) for k, v in tags.items())
        assert line["ServiceCategory"] == "Compute" and line["ServiceSubcategory"] == "Containers"
        assert line["ChargeDescription"]


def test_focus_costs_add_up_to_the_report():
    rows = _rows()
    assert sum(float(line["BilledCost"]) for line in _focus()) == pytest.approx(
        sum(r.cost for r in rows), abs=1e-4
    )
    gpu = [line for line in _focus() if line["ConsumedUnit"] == "GPU-Hours"]
    assert sum(float(line["x_GpuHoursAllocated"]) for line in gpu) == pytest.approx(
        sum(r.gpu_hours_allocated for r in rows)
    )
    # a row with energy but no GPU time (MIG-mode GPUs' energy) gets only an energy charge
    mig = [line for line in _focus() if line["x_Namespace"] == "__mig_shared__"]
    assert [line["ConsumedUnit"] for line in mig] == ["kWh"]


def test_focus_in_period_corrections_are_not_flagged():
    """FOCUS: ChargeClass MUST be null for a correction within the current billing period (D5)."""
    lines = _focus(split_corrections=True) + _focus(billing_lag_ms=86_400_000)
    assert lines and {line["ChargeClass"] for line in lines} == {""}
