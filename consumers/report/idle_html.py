"""The idle-GPU report as one self-contained page, for the team lead who has to act on it.

Like the chargeback page (no script, font or image fetched; it prints), built from the same pieces
(:mod:`gpupipe_consumers.report.html_parts`). What it shows, from the recommendations the report selected:

* the span of the data (first idle sample to the last one seen) and the ``--since`` cut-off;
* headline figures: GPU-hours idle, the cost wasted (already billed by chargeback as idle
  allocated time), the recommendations still open and what acting on them saves per hour;
* GPU-hours idle per day, stacked by the report's grouping (each streak spread evenly over its
  days: a recommendation carries its total, not its history);
* the groups, the ten owners (top controllers) that waste most, and what each suggested action
  means, in the contract's own words (the ``RecommendedAction`` enum's documentation).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from gpupipe_consumers.report.html_parts import (
    CSS,
    PALETTE,
    axis_end,
    axis_ticks,
    bar,
    breakable,
    day,
    escape,
    swatch,
    y_grid,
)
from gpupipe_consumers.report.idle_report import IdleRow, build_idle_report
from gpupipe_schemas import catalog

DAY_MS = 86_400_000
MAX_SERIES = 8  # more groups than this: the smallest are summed as "other" in the chart
TOP_OWNERS = 10
OTHER = "other"


def action_meanings() -> dict[str, str]:
    """``action -> what it means``, parsed from the GpuRecommendation schema's enum documentation."""
    schema = catalog.current("GpuRecommendation").raw
    (field,) = [f for f in schema["fields"] if f["name"] == "action"]
    doc = field["type"]["doc"]
    symbols = [s for s in field["type"]["symbols"] if s != "unknown"]
    out: dict[str, str] = {}
    for m in re.finditer(r"(\w+): (.+?)(?=; \w+: |\. The |$)", doc):
        if m.group(1) in symbols:
            out[m.group(1)] = m.group(2).rstrip(".")
    return out


def _money(amounts: dict[str, float]) -> str:
    parts = [f"{v:,.2f} {cur}" for cur, v in sorted(amounts.items()) if cur]
    return " + ".join(parts) if parts else "0.00"


def _daily(records: Sequence[dict[str, Any]], group_of: dict[str, str]) -> dict[int, dict[str, float]]:
    """GPU-hours idle per UTC day and group, each streak spread evenly over its span."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        start, end, hours = (
            r["idle_since_ms"],
            max(r["last_seen_ms"], r["idle_since_ms"]),
            r["gpu_hours_idle"],
        )
        group = group_of.get(r["recommendation_id"], OTHER)
        if end == start:
            out[start // DAY_MS * DAY_MS][group] += hours
            continue
        d = start // DAY_MS * DAY_MS
        while d < end:
            overlap = min(end, d + DAY_MS) - max(start, d)
            out[d][group] += hours * overlap / (end - start)
            d += DAY_MS
    return out


def _chart(daily: dict[int, dict[str, float]], series: list[str], colours: dict[str, str], by: str) -> str:
    width, height, left, right, top, bottom = 920, 260, 60, 10, 10, 40
    pw, ph = width - left - right, height - top - bottom
    days = sorted(daily)
    peak = max((sum(v.values()) for v in daily.values()), default=0.0)
    step, ticks = axis_ticks(peak)
    scale = step * ticks
    out = [
        f'<svg id="chart" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="GPU-hours idle per day, stacked by {escape(by)}">'
    ]
    out += y_grid(left, top, pw, ph, step, ticks)
    slot = pw / len(days) if days else pw
    bar_w = max(1.0, slot * 0.8)
    for i, d in enumerate(days):
        x, y = left + i * slot + (slot - bar_w) / 2, top + ph
        for name in series:
            v = daily[d].get(name, 0.0)
            if v <= 0 or scale <= 0:
                continue
            h = ph * v / scale
            y -= h
            out.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{h:.2f}" fill="{colours[name]}">'
                f"<title>{escape(name)} {escape(day(d)[:10])}: {v:,.2f} GPU-h idle</title></rect>"
            )
        if i % max(1, len(days) // 8) == 0:
            out.append(
                f'<text x="{left + i * slot + slot / 2:.1f}" y="{top + ph + 16}" text-anchor="middle" '
                f'class="ax">{escape(day(d)[:10])}</text>'
            )
    out.append(axis_end(left, top, pw, ph, "GPU-hours idle"))
    legend = "".join(f'<span class="lg">{swatch(colours[s])} {escape(s)}</span>' for s in series)
    return "".join(out) + f'<div class="legend">{legend}</div>'


def _group_table(rows: Sequence[IdleRow], colours: dict[str, str], title: str, attr: str) -> str:
    peak = max((r.cost_wasted or r.gpu_hours_idle for r in rows), default=0.0)
    head = "".join(
        f"<th{c}>{escape(h)}</th>"
        for h, c in (
            (title, ""),
            ("recommendations", ' class="n"'),
            ("open", ' class="n"'),
            ("pods", ' class="n"'),
            ("GPU-h idle", ' class="n"'),
            ("cost wasted", ' class="n"'),
            ("", ""),
            ("saves per hour (open)", ' class="n"'),
            ("suggested", ""),
        )
    )
    body = []
    for r in rows:
        action, target = r.top()
        colour = colours.get(r.group, "#7F7F7F")
        body.append(
            f'<tr {attr}="{escape(r.group)}"><td>{swatch(colour)} {breakable(r.group)}</td>'
            f'<td class="n">{r.recommendations}</td><td class="n">{r.open}</td>'
            f'<td class="n">{len(r.pods)}</td><td class="n">{r.gpu_hours_idle:,.2f}</td>'
            f'<td class="n">{r.cost_wasted:,.2f} {escape(r.currency)}</td>'
            f"<td>{bar(r.cost_wasted or r.gpu_hours_idle, peak, colour)}</td>"
            f'<td class="n">{r.saving_per_hour:,.2f} {escape(r.currency)}</td>'
            f"<td>{escape(action)} {breakable(target)}</td></tr>"
        )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_idle_html(
    rows: Sequence[IdleRow], records: Sequence[dict[str, Any]], *, since_ms: int | None = None
) -> str:
    """The page for ``rows`` (the report, grouped) and ``records`` (the latest revisions behind them)."""
    by = rows[0].by if rows else "team"
    order = [r.group for r in rows]
    series = order[:MAX_SERIES] + ([OTHER] if len(order) > MAX_SERIES else [])
    colours = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(order[:MAX_SERIES])} | {OTHER: "#7F7F7F"}
    kept = set(order[:MAX_SERIES])
    # each pod to the first row that holds it, then each record to its pod's: one pass over each
    pod_group: dict[tuple[str, str], str] = {}
    for r in rows:
        for pod in r.pods:
            pod_group.setdefault(pod, r.group if r.group in kept else OTHER)
    group_of = {
        rec["recommendation_id"]: pod_group[(rec["namespace"], rec["pod"])]
        for rec in records
        if (rec["namespace"], rec["pod"]) in pod_group
    }
    used = [r for r in records if r["recommendation_id"] in group_of]
    wasted: dict[str, float] = defaultdict(float)
    saving: dict[str, float] = defaultdict(float)
    for r in rows:
        wasted[r.currency] += r.cost_wasted
        saving[r.currency] += r.saving_per_hour
    hours = sum(r.gpu_hours_idle for r in rows)
    open_now = sum(r.open for r in rows)
    if used:
        first, last = min(r["idle_since_ms"] for r in used), max(r["last_seen_ms"] for r in used)
        span = f"{day(first)} to {day(last)} UTC"
    else:
        span = "no data"
    since = f" &middot; streaks seen since {escape(day(since_ms))} UTC" if since_ms is not None else ""
    cards = "".join(
        f'<div class="card"><div class="k">{escape(k)}</div><div class="v" id="{i}">{escape(v)}</div></div>'
        for i, k, v in (
            ("total-idle", "GPU-hours idle", f"{hours:,.2f}"),
            ("total-wasted", "cost wasted (billed as idle)", _money(wasted)),
            (
                "total-open",
                "recommendations open",
                f"{open_now:,} of {sum(r.recommendations for r in rows):,}",
            ),
            ("total-saving", "saved per hour if the open ones are acted on", _money(saving)),
        )
    )
    owners = build_idle_report(used, by="owner", top=TOP_OWNERS) if by != "owner" else []
    meanings = action_meanings()
    actions: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for rec in used:
        a = actions[rec["action"]]
        a[0] += 1
        a[1] += rec["cost_wasted"]
        if rec["status"] == "firing":
            a[2] += rec.get("saving_per_hour") or 0.0
    action_rows = "".join(
        f'<tr data-action="{escape(name)}"><td><b>{escape(name)}</b></td>'
        f"<td>{escape(meanings.get(name, ''))}</td>"
        f'<td class="n">{int(n)}</td><td class="n">{cost:,.2f}</td><td class="n">{save:,.2f}</td></tr>'
        for name, (n, cost, save) in sorted(actions.items(), key=lambda kv: -kv[1][1])
    )
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>gpupipe idle GPUs</title>',
        f"<style>{CSS}</style></head><body>",
        f'<header><h1>Idle GPUs by {escape(by)}</h1><p class="sub" id="span">{escape(span)}{since} '
        f"&middot; {len(used)} recommendations</p></header>",
        f'<section class="cards keep">{cards}</section>',
    ]
    if not rows:
        parts.append("<p>No idle GPUs in the period.</p>")
    else:
        parts += [
            f'<section class="keep"><h2>GPU-hours idle per day, by {escape(by)}</h2>',
            _chart(_daily(used, group_of), series, colours, by),
            "</section>",
            f'<section class="keep"><h2>Per {escape(by)}</h2>',
            _group_table(rows, colours, by, "data-group"),
            "</section>",
        ]
        if owners:
            parts += [
                f'<section class="keep"><h2>The {len(owners)} owners that waste most</h2>',
                _group_table(owners, {}, "owner (namespace/kind/name)", "data-owner"),
                "</section>",
            ]
        parts += [
            '<section class="keep"><h2>What the suggestions mean</h2><table><thead><tr><th>action</th>'
            '<th>what to do</th><th class="n">recommendations</th><th class="n">cost wasted</th>'
            '<th class="n">saves per hour (open)</th></tr></thead>'
            f"<tbody>{action_rows}</tbody></table></section>",
        ]
    parts.append(
        "<footer>The waste is cost chargeback has already billed: GPU-hours a pod held while idle, at the "
        "price table's GPU-hour price. A recommendation carries its streak's total, so the chart spreads "
        "each streak evenly over its days. Generated by gpupipe report idle.</footer></body></html>"
    )
    return "\n".join(parts) + "\n"
