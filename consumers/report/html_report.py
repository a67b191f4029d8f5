"""Render report rows as one self-contained HTML page for the people who read chargeback.

Team leads and finance read chargeback on a page, not in a terminal. The page has no external
resource at all (no script, font, stylesheet or image fetched): charts are inline SVG built here,
so the file can be mailed, archived or opened offline, and it prints (``@media print`` rules keep
cards and charts whole on a page). Pure string building, like the other formats.

What it shows, from whatever rows the report was asked for (``--by`` and ``--period``):

* headline figures: total cost, GPU-hours allocated and used, the *idle share* (allocated to a
  pod but inactive, over GPU-hours allocated to pods) and the *unallocated share* (capacity no pod
  held, over all GPU-hours observed);
* totals per team (the row's team; its namespace or node when the report has no team column);
* stacked bar charts of GPU-hours and of cost per period, one colour per team, unallocated
  capacity in grey (cost in one currency: a report in several charts its largest and says so);
* cost per GPU model;
* the full table of rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gpupipe_consumers.report.chargeback_report import ReportRow
from gpupipe_consumers.report.html_parts import CSS as _CSS
from gpupipe_consumers.report.html_parts import PALETTE, axis_end, y_grid
from gpupipe_consumers.report.html_parts import axis_ticks as _ticks
from gpupipe_consumers.report.html_parts import bar as _bar
from gpupipe_consumers.report.html_parts import day as _day
from gpupipe_consumers.report.html_parts import escape as _e
from gpupipe_consumers.report.html_parts import swatch as _swatch
from gpupipe_consumers.report.rounding import minor_units
from gpupipe_schemas.meaning import PSEUDO_NAMESPACES

UNALLOCATED = "__unallocated__"

PSEUDO_COLOURS = {UNALLOCATED: "#B0B0B0", "__mig_shared__": "#DADADA"}
OTHER = "other"
MAX_SERIES = 11  # more teams than this: the smallest are summed as "other" in the chart


@dataclass(slots=True)
class _Totals:
    alloc: float = 0.0
    used: float = 0.0
    idle: float = 0.0
    energy: float = 0.0
    cost: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, r: ReportRow) -> None:
        self.alloc += r.gpu_hours_allocated
        self.used += r.gpu_hours_used
        self.idle += r.gpu_hours_idle
        self.energy += r.energy_kwh
        self.cost[r.currency] += r.cost


def who(r: ReportRow) -> str:
    """The name a row is charged to on the page: its team, else namespace, else node."""
    return r.team or r.namespace or r.node or "all"


def _money(cost: dict[str, float]) -> str:
    parts = [f"{v:,.{minor_units(cur)}f} {cur}" for cur, v in sorted(cost.items()) if cur]
    return " + ".join(parts) if parts else "0.00"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "n/a"


def _order(totals: dict[str, _Totals]) -> list[str]:
    """Teams by GPU-hours allocated, biggest first; pseudo-namespaces last."""
    return sorted(totals, key=lambda k: (k in PSEUDO_NAMESPACES, -totals[k].alloc, k))


def _colours(names: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    for n in names:
        if n in PSEUDO_COLOURS:
            out[n] = PSEUDO_COLOURS[n]
        elif n == OTHER:
            out[n] = "#7F7F7F"
        else:
            out[n] = PALETTE[i % len(PALETTE)]
            i += 1
    return out


def render_html(rows: Sequence[ReportRow], *, title: str = "GPU chargeback report") -> str:
    """The whole page (``<!DOCTYPE html>`` ... ``</html>``), ending with a newline."""
    per_team: dict[str, _Totals] = defaultdict(_Totals)
    per_model: dict[str, _Totals] = defaultdict(_Totals)
    grand = _Totals()
    for r in rows:
        per_team[who(r)].add(r)
        per_model[r.gpu_model].add(r)
        grand.add(r)
    real = [t for name, t in per_team.items() if name not in PSEUDO_NAMESPACES]
    pod_alloc = sum(t.alloc for t in real)
    pod_idle = sum(t.idle for t in real)
    unalloc = per_team[UNALLOCATED].alloc if UNALLOCATED in per_team else 0.0
    start = min((r.window_start_ms for r in rows), default=None)
    end = max((r.window_end_ms for r in rows), default=None)
    span = f"{_day(start)} to {_day(end)} UTC" if start is not None and end is not None else "no data"
    order = _order(per_team)
    colours = _colours(order)

    cards = "".join(
        f'<div class="card" id="{cid}"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div></div>'
        for cid, k, v in (
            ("total-cost", "Total cost", _money(grand.cost)),
            ("total-gpu-hours", "GPU-hours allocated", f"{grand.alloc:,.2f}"),
            ("total-used", "GPU-hours used", f"{grand.used:,.2f}"),
            ("idle-share", "Idle share (allocated, inactive)", _pct(pod_idle, pod_alloc)),
            ("unallocated-share", "Unallocated share of capacity", _pct(unalloc, grand.alloc)),
        )
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<header><h1>{_e(title)}</h1><p class='sub'>{_e(span)} &middot; {len(rows)} rows</p></header>",
        f'<section class="cards">{cards}</section>',
        '<section class="keep"><h2>Totals per team</h2>',
        _team_table(order, per_team, grand, colours),
        "</section>",
        '<section class="keep"><h2>GPU-hours allocated over the period</h2>',
        stacked_chart(rows, order, colours),
        "</section>",
        _cost_section(rows, order, colours, grand),
        '<section class="keep"><h2>Cost per GPU model</h2>',
        _model_table(per_model, grand),
        "</section>",
        "<section><h2>All rows</h2>",
        _rows_table(rows),
        "</section>",
        "<footer>Generated by <code>gpupipe report chargeback --format html</code>. Idle share: GPU-hours "
        "allocated to pods with no activity over GPU-hours allocated to pods. Unallocated share: capacity "
        "no pod held (<code>__unallocated__</code>) over all GPU-hours observed."
        + (
            " * GPU model not in the price table: billed at the default price."
            if any(r.default_price for r in rows)
            else ""
        )
        + "</footer>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _team_table(
    order: list[str], per_team: dict[str, _Totals], grand: _Totals, colours: dict[str, str]
) -> str:
    top = max((t.alloc for t in per_team.values()), default=0.0)
    body = []
    for name in order:
        t = per_team[name]
        body.append(
            f'<tr data-team="{_e(name)}"><td>{_swatch(colours[name])} {_e(name)}</td>'
            f'<td class="n">{t.alloc:,.2f}</td><td>{_bar(t.alloc, top, colours[name])}</td>'
            f'<td class="n">{t.used:,.2f}</td><td class="n">{t.idle:,.2f}</td>'
            f'<td class="n">{_pct(t.alloc, grand.alloc)}</td>'
            f'<td class="n">{t.energy:,.2f}</td><td class="n">{_e(_money(t.cost))}</td></tr>'
        )
    foot = (
        f'<tr class="total"><td>Total</td><td class="n">{grand.alloc:,.2f}</td><td></td>'
        f'<td class="n">{grand.used:,.2f}</td><td class="n">{grand.idle:,.2f}</td><td class="n">100%</td>'
        f'<td class="n">{grand.energy:,.2f}</td><td class="n" id="team-total-cost">{_e(_money(grand.cost))}'
        "</td></tr>"
    )
    return (
        '<table id="teams"><thead><tr><th>Team</th><th class="n">GPU-h allocated</th><th></th>'
        '<th class="n">GPU-h used</th><th class="n">GPU-h idle</th><th class="n">Share</th>'
        '<th class="n">Energy kWh</th><th class="n">Cost</th></tr></thead>'
        f"<tbody>{''.join(body)}</tbody><tfoot>{foot}</tfoot></table>"
    )


def _model_table(per_model: dict[str, _Totals], grand: _Totals) -> str:
    models = sorted(per_model, key=lambda m: (-sum(per_model[m].cost.values()), m))
    top = max((sum(t.cost.values()) for t in per_model.values()), default=0.0)
    body = "".join(
        f'<tr><td>{_e(m)}</td><td class="n">{per_model[m].alloc:,.2f}</td>'
        f'<td class="n">{_e(_money(per_model[m].cost))}</td>'
        f"<td>{_bar(sum(per_model[m].cost.values()), top, '#0072B2')}</td>"
        f'<td class="n">{_e(_per_hour(per_model[m]))}</td></tr>'
        for m in models
    )
    return (
        '<table id="models"><thead><tr><th>GPU model</th><th class="n">GPU-h allocated</th>'
        '<th class="n">Cost</th><th></th><th class="n">Cost per GPU-hour</th></tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def _per_hour(t: _Totals) -> str:
    if t.alloc <= 0 or len(t.cost) != 1:
        return ""
    ((cur, v),) = t.cost.items()
    return f"{v / t.alloc:,.2f} {cur}"


def _rows_table(rows: Sequence[ReportRow]) -> str:
    dims = [n for n in ("namespace", "team", "node") if any(getattr(r, n) is not None for r in rows)]
    split = any(r.kind != "total" for r in rows)
    head = ["Window start", "Window end", *(d.capitalize() for d in dims), "GPU model"]
    if split:
        head.append("Kind")
    nums = ["GPU-h alloc", "GPU-h used", "GPU-h idle", "Energy kWh", "Cost", "Cur"]
    out = ["<table id='rows'><thead><tr>"]
    out += [f"<th>{_e(h)}</th>" for h in head]
    out += [f'<th class="n">{_e(h)}</th>' for h in nums]
    out.append("</tr></thead><tbody>")
    for r in rows:
        cells = [_day(r.window_start_ms), _day(r.window_end_ms), *(getattr(r, d) or "" for d in dims)]
        cells.append(r.gpu_model + (" *" if r.default_price else ""))
        if split:
            cells.append(r.kind)
        out.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells))
        out.append(
            "".join(
                f'<td class="n">{v:,.2f}</td>'
                for v in (r.gpu_hours_allocated, r.gpu_hours_used, r.gpu_hours_idle, r.energy_kwh)
            )
            + f'<td class="n">{r.cost:,.{minor_units(r.currency)}f}</td>'
            + f'<td class="n">{_e(r.currency)}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _cost_section(
    rows: Sequence[ReportRow], order: list[str], colours: dict[str, str], grand: _Totals
) -> str:
    """Cost per period, stacked like the GPU-hours: money in the chart's one currency."""
    if not grand.cost:
        return ""
    currency = max(sorted(grand.cost), key=lambda c: grand.cost[c])
    others = sorted(c for c in grand.cost if c != currency and c)
    note = ""
    if others:
        billed = _e(", ".join(others))
        note = f"<p class='sub'>In {_e(currency)} only; rows billed in {billed} are in the tables.</p>"
    chart = stacked_chart(
        [r for r in rows if r.currency == currency],
        order,
        colours,
        value=lambda r: r.cost,
        unit=currency,
        y_label=f"cost ({currency})",
        svg_id="cost-chart",
        what="cost",
    )
    return f'<section class="keep"><h2>Cost over the period</h2>{note}{chart}</section>'


def stacked_chart(
    rows: Sequence[ReportRow],
    order: list[str],
    colours: dict[str, str],
    width: int = 920,
    height: int = 300,
    *,
    value: Callable[[ReportRow], float] = lambda r: r.gpu_hours_allocated,
    unit: str = "GPU-h",
    y_label: str = "GPU-hours",
    svg_id: str = "chart",
    what: str = "GPU-hours allocated",
) -> str:
    """Inline SVG: one stacked bar per period, ``value`` per team (biggest team at the bottom)."""
    series = list(order)
    keep = set(series)
    if len([s for s in series if s not in PSEUDO_NAMESPACES]) > MAX_SERIES:
        real = [s for s in series if s not in PSEUDO_NAMESPACES]
        keep = set(real[:MAX_SERIES]) | {s for s in series if s in PSEUDO_NAMESPACES}
        series = [*real[:MAX_SERIES], OTHER, *(s for s in series if s in PSEUDO_NAMESPACES)]
        colours = {**colours, OTHER: "#7F7F7F"}
    buckets: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        name = who(r) if who(r) in keep else OTHER
        buckets[(r.window_start_ms, r.window_end_ms)][name] += value(r)
    keys = sorted(buckets)
    left, right, top, bottom = 60, 10, 10, 40
    pw, ph = width - left - right, height - top - bottom
    peak = max((sum(b.values()) for b in buckets.values()), default=0.0)
    step, ticks = _ticks(peak)
    scale_top = step * ticks
    out = [
        f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="100%" role="img" aria-label="{_e(what)} per period, stacked by team">'
    ]
    out += y_grid(left, top, pw, ph, step, ticks)
    n = len(keys)
    slot = pw / n if n else pw
    bar_w = max(1.0, slot * 0.8)
    label_every = max(1, n // 8)
    for i, k in enumerate(keys):
        x = left + i * slot + (slot - bar_w) / 2
        y = top + ph
        for name in series:
            v = buckets[k].get(name, 0.0)
            if v <= 0 or scale_top <= 0:
                continue
            h = ph * v / scale_top
            y -= h
            out.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{h:.2f}" fill="{colours[name]}">'
                f"<title>{_e(name)} {_e(_day(k[0]))}: {v:,.2f} {_e(unit)}</title></rect>"
            )
        if i % label_every == 0:
            out.append(
                f'<text x="{left + i * slot + slot / 2:.1f}" y="{top + ph + 16}" text-anchor="middle" '
                f'class="ax">{_e(_day(k[0]))}</text>'
            )
    out.append(axis_end(left, top, pw, ph, y_label))
    legend = "".join(
        f'<span class="lg">{_swatch(colours[s])} {_e(s)}</span>'
        for s in series
        if any(b.get(s, 0.0) > 0 for b in buckets.values())
    )
    return "".join(out) + f'<div class="legend">{legend}</div>'
