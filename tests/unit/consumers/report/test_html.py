"""The HTML chargeback page: self-contained, the same totals as the table, a correct stacked chart."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from gpupipe.domain.teams import load_team_map
from gpupipe_consumers.report.chargeback_report import build_report, read_records_jsonl
from gpupipe_consumers.report.formats import FORMATS, render_report
from gpupipe_consumers.report.html_report import MAX_SERIES, OTHER, render_html, stacked_chart
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "chargeback"
T0 = 1_767_225_600_000
H = 3_600_000


def _rows(**kw):
    records = read_records_jsonl((FIXTURES / "windows.jsonl").read_text().splitlines())
    kw.setdefault("teams", load_team_map(FIXTURES / "teams.yaml"))
    return build_report(records, start_ms=T0, end_ms=T0 + 2 * H, **kw)


def _card(page: str, cid: str) -> str:
    m = re.search(rf'id="{cid}"><div class="k">[^<]*</div><div class="v">([^<]*)</div>', page)
    assert m, cid
    return m.group(1)


def test_html_is_a_format_of_the_report_command():
    assert "html" in FORMATS
    assert render_report(_rows(), "html").startswith("<!DOCTYPE html>")


def test_page_loads_nothing_from_anywhere():
    page = render_html(_rows(by=("team",), period="hour"))
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert not re.search(r"\b(src|href)\s*=", page)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    assert "@media print" in page and "break-inside:avoid" in page


def test_headline_totals_match_the_table():
    rows = _rows(by=("team",), period="all")
    table_total = next(x for x in render_report(rows, "table").splitlines() if x.startswith("TOTAL")).split()
    page = render_html(rows)
    assert _card(page, "total-cost") == f"{float(table_total[-2]):,.2f} USD"
    assert _card(page, "total-gpu-hours") == f"{float(table_total[-6]):,.2f}"
    # idle share is over pod-allocated hours; unallocated share over everything observed
    pods = [r for r in rows if not r.is_pseudo]
    unalloc = sum(r.gpu_hours_allocated for r in rows if r.team == "__unallocated__")
    idle = sum(r.gpu_hours_idle for r in pods) / sum(r.gpu_hours_allocated for r in pods)
    assert _card(page, "idle-share") == f"{100 * idle:.1f}%"
    everything = sum(r.gpu_hours_allocated for r in rows)
    assert _card(page, "unallocated-share") == f"{100 * unalloc / everything:.1f}%"
    for team in ("ml-platform", "ml-serving", "research", "__unallocated__"):
        assert f'data-team="{team}"' in page
    assert "NVIDIA H200" in page and "Cost per GPU model" in page
    assert "Acme X1 *" in page and "billed at the default price" in page


def test_cost_per_model_adds_up():
    rows = _rows(by=("team",), period="all")
    page = render_html(rows)
    table = page[page.index('id="models"') : page.index("</table>", page.index('id="models"'))]
    costs = [float(c.replace(",", "")) for c in re.findall(r'<td class="n">([\d,.]+) USD</td>', table)]
    per_model = costs[0::2]  # cost, then cost per GPU-hour, per model
    assert sum(per_model) == pytest.approx(sum(r.cost for r in rows), abs=0.01 * len(per_model))


def test_stacked_bars_are_proportional_and_stack():
    rows = _rows(by=("team",), period="hour")
    order = sorted({r.team for r in rows})
    svg = stacked_chart(rows, order, dict.fromkeys(order, "#000"))
    rects = re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="[\d.]+" height="([\d.]+)"[^>]*><title>', svg)
    per_bar: dict[str, list[tuple[float, float]]] = {}
    for x, y, h in rects:
        per_bar.setdefault(x, []).append((float(y), float(h)))
    assert len(per_bar) == 2  # two hours
    sums = []
    for segs in per_bar.values():
        segs.sort(reverse=True)  # bottom first
        for (y0, _), (y1, h1) in itertools.pairwise(segs):
            assert y1 + h1 == pytest.approx(y0, abs=0.02)  # each segment sits on the one below
        sums.append(sum(h for _, h in segs))
    hours = {}
    for r in rows:
        hours[r.window_start_ms] = hours.get(r.window_start_ms, 0.0) + r.gpu_hours_allocated
    a, b = (hours[k] for k in sorted(hours))
    assert sums[0] / sums[1] == pytest.approx(a / b, rel=1e-3)


def test_many_teams_fold_into_other_in_the_chart():
    base = _rows(by=("team",), period="all")[0]
    rows = [replace(base, team=f"team-{i:02d}", gpu_hours_allocated=1.0 + i) for i in range(MAX_SERIES + 4)]
    page = render_html(rows)
    at = page.index('class="legend"')
    legend = page[at : page.index("</div>", at)]
    assert f"> {OTHER}</span>" in legend and "team-00" not in legend and f"team-{MAX_SERIES + 3}" in legend
    assert 'data-team="team-00"' in page  # still in the totals table


def test_names_are_escaped_and_empty_reports_render():
    base = _rows(by=("team",), period="all")[0]
    page = render_html([replace(base, team="<img src=x onerror=alert(1)>")])
    assert "<img" not in page and "&lt;img src=x" in page
    empty = render_html([])
    assert "no data" in empty and _card(empty, "total-cost") == "0.00" and empty.endswith("</html>\n")


def _bar_heights(svg: str) -> dict[float, float]:
    """Total height of each bar (by x) in a stacked chart."""
    out: dict[float, float] = {}
    for x, h in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="[\d.]+" height="([\d.]+)"', svg):
        out[float(x)] = out.get(float(x), 0.0) + float(h)
    return out


def _svg(page: str, svg_id: str) -> str:
    at = page.index(f'<svg id="{svg_id}"')
    return page[at : page.index("</svg>", at)]


def test_cost_over_time_is_charted_per_period():
    rows = _rows(by=("team",), period="hour")
    page = render_html(rows)
    assert "Cost over the period" in page
    cost = _bar_heights(_svg(page, "cost-chart"))
    per_hour: dict[int, float] = {}
    for r in rows:
        per_hour[r.window_start_ms] = per_hour.get(r.window_start_ms, 0.0) + r.cost
    a, b = (per_hour[k] for k in sorted(per_hour))
    first, second = (cost[x] for x in sorted(cost))
    assert first / second == pytest.approx(a / b, rel=1e-3)
    assert "cost (USD)" in _svg(page, "cost-chart") and " USD</title>" in _svg(page, "cost-chart")
    # The GPU-hours chart is unchanged beside it: its bars follow hours, not money.
    hours = _bar_heights(_svg(page, "chart"))
    assert sorted(hours) == sorted(cost)


def test_a_report_in_two_currencies_charts_the_larger_and_says_so():
    rows = _rows(by=("team",), period="hour")
    euro = [replace(r, currency="EUR", cost=r.cost / 100) for r in rows[:2]]
    page = render_html([*rows[2:], *euro])
    chart = _svg(page, "cost-chart")
    assert "cost (USD)" in chart and " EUR</title>" not in chart
    assert "In USD only; rows billed in EUR are in the tables." in page
    assert "EUR" in page[page.index('id="total-cost"') :]  # the headline keeps both


def test_an_empty_report_has_no_cost_chart():
    assert 'id="cost-chart"' not in render_html([])
