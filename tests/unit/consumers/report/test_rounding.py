"""Rounding policy of the table, CSV and HTML reports: rounded rows add up to the rounded total,
in the currency's minor unit (largest remainder; ``consumers/report/rounding.py``)."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from decimal import Decimal

import pytest

from gpupipe.domain.teams import load_team_map
from gpupipe_consumers.report.chargeback_report import build_report, read_records_jsonl
from gpupipe_consumers.report.formats import render_report
from gpupipe_consumers.report.rounding import largest_remainder, minor_units
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "chargeback"


def _rows():
    records = read_records_jsonl((FIXTURES / "windows.jsonl").read_text().splitlines())
    return build_report(records, teams=load_team_map(FIXTURES / "teams.yaml"))


def _exact_total(rows) -> Decimal:
    return Decimal(str(sum(r.cost for r in rows))).quantize(Decimal("0.01"), rounding="ROUND_HALF_UP")


def test_table_rows_add_up_to_the_total_line() -> None:
    """The fixture's rows, each rounded on its own, showed 87.67 under a TOTAL of 87.68."""
    rows = _rows()
    lines = render_report(rows, "table").splitlines()
    body = [ln for ln in lines if ln[:4].isdigit()]
    total = next(ln for ln in lines if ln.startswith("TOTAL"))
    shown = sum(Decimal(ln.split()[-2]) for ln in body)
    assert Decimal(total.split()[-2]) == _exact_total(rows) == shown
    for i in range(-6, -2):  # the hour and kWh columns add up too
        assert sum(Decimal(ln.split()[i]) for ln in body) == Decimal(total.split()[i])


def test_csv_and_html_rows_add_up_to_the_rounded_total() -> None:
    rows = _rows()
    lines = list(csv.DictReader(io.StringIO(render_report(rows, "csv"))))
    assert all(re.fullmatch(r"-?\d+\.\d\d", ln["cost"]) for ln in lines)
    assert sum(Decimal(ln["cost"]) for ln in lines) == _exact_total(rows)
    for exact, ln in zip(rows, lines, strict=True):
        assert abs(Decimal(ln["cost"]) - Decimal(str(exact.cost))) <= Decimal("0.01")
    page = render_report(rows, "html")
    cells = re.findall(r'<td class="n">([\d,.]+)</td><td class="n">USD</td></tr>', page)
    assert len(cells) == len(rows)
    assert sum(Decimal(c.replace(",", "")) for c in cells) == _exact_total(rows)
    total = re.search(r'id="team-total-cost">([\d,.]+) USD', page)
    assert total is not None and Decimal(total.group(1).replace(",", "")) == _exact_total(rows)


def test_the_minor_unit_is_the_currencys() -> None:
    rows = [dataclasses.replace(r, currency="JPY", cost=r.cost * 150) for r in _rows()]
    lines = render_report(rows, "table").splitlines()
    total = next(ln for ln in lines if ln.startswith("TOTAL")).split()
    assert total[-1] == "JPY" and re.fullmatch(r"\d+", total[-2])
    body = [ln.split()[-2] for ln in lines if ln[:4].isdigit()]
    assert sum(int(v) for v in body) == int(total[-2]) == round(sum(r.cost for r in rows))
    assert (minor_units("usd"), minor_units("JPY"), minor_units("KWD"), minor_units("XYZ")) == (2, 0, 3, 2)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([1 / 3, 1 / 3, 1 / 3], [0.34, 0.33, 0.33]),  # naive: 0.99 against a total of 1.00
        ([0.005, 0.005, 0.0], [0.01, 0.0, 0.0]),  # the total 0.01, to the earlier row on a tie
        ([2.0, 0.0], [2.0, 0.0]),
        ([], []),
    ],
)
def test_largest_remainder(values: list[float], want: list[float]) -> None:
    assert largest_remainder(values, 2) == want
