"""Top idle-GPU wasters from GpuRecommendation records. Pure: records in, rows and text out.

Every recommendation is reduced to its latest revision (highest ``sequence`` per id: delivery is at
least once, and each revision carries the totals so far). Those whose streak was still going at or
after ``since_ms`` (``last_seen_ms >= since_ms``) are grouped by the chosen dimension and summed:

* ``team``: the team mapping's rule for the namespace or the pod's labels, else the record's own
  ``team``, else the namespace (as chargeback reports do);
* ``namespace``; ``owner``: ``namespace/Kind/name`` of the pod's top controller (a pod without a
  known owner is its own: ``namespace/Pod/name``); ``pod``: one row per pod.

Rows are sorted by wasted cost, then GPU-hours, largest first. The waste is money chargeback has
already billed (idle allocated time); the FOCUS output therefore puts it in ``x_`` columns with
``BilledCost`` 0, so loading it next to a chargeback export never bills anything twice.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_consumers.report.formats import FocusOptions, _csv, _fmt, _num, iso

IDLE_DIMENSIONS = ("team", "namespace", "owner", "pod")
IDLE_COLUMNS = (
    "group",
    "by",
    "recommendations",
    "open",
    "pods",
    "gpu_hours_idle",
    "cost_wasted",
    "saving_per_hour",
    "currency",
    "top_action",
    "top_target",
    "first_idle",
    "last_seen",
)


@dataclass(slots=True)
class IdleRow:
    group: str
    by: str
    currency: str
    recommendations: int = 0
    open: int = 0
    pods: set[tuple[str, str]] = field(default_factory=set)
    gpu_hours_idle: float = 0.0
    cost_wasted: float = 0.0
    saving_per_hour: float = 0.0
    actions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (action, target) -> cost
    first_idle_ms: int = 0
    last_seen_ms: int = 0

    def top(self) -> tuple[str, str]:
        if not self.actions:
            return "", ""
        return max(self.actions.items(), key=lambda kv: (kv[1], kv[0]))[0]


def latest_revisions(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    latest: dict[str, dict[str, Any]] = {}
    for r in records:
        prev = latest.get(r["recommendation_id"])
        if prev is None or r["sequence"] > prev["sequence"]:
            latest[r["recommendation_id"]] = r
    return list(latest.values())


def owner_of(rec: dict[str, Any]) -> str:
    if rec.get("owner_name"):
        return f"{rec['namespace']}/{rec.get('owner_kind') or 'Unknown'}/{rec['owner_name']}"
    return f"{rec['namespace']}/Pod/{rec['pod']}"


def build_idle_report(
    records: Iterable[dict[str, Any]],
    *,
    by: str = "team",
    since_ms: int | None = None,
    team_of: Callable[[str, dict[str, str]], str | None] = lambda _ns, _labels: None,
    top: int | None = None,
) -> list[IdleRow]:
    if by not in IDLE_DIMENSIONS:
        raise ReportOptionError(f"--by must be one of {', '.join(IDLE_DIMENSIONS)}, got {by!r}")
    rows: dict[tuple[str, str], IdleRow] = {}
    for r in selected(records, since_ms):
        labels = r.get("labels") or {}
        if by == "team":
            group = team_of(r["namespace"], labels) or r.get("team") or r["namespace"]
        elif by == "namespace":
            group = r["namespace"]
        elif by == "owner":
            group = owner_of(r)
        else:
            group = f"{r['namespace']}/{r['pod']}"
        row = rows.get((group, r["currency"]))
        if row is None:
            row = rows[(group, r["currency"])] = IdleRow(
                group, by, r["currency"], first_idle_ms=r["idle_since_ms"]
            )
        row.recommendations += 1
        row.open += r["status"] == "firing"
        row.pods.add((r["namespace"], r["pod"]))
        row.gpu_hours_idle += r["gpu_hours_idle"]
        row.cost_wasted += r["cost_wasted"]
        if r["status"] == "firing":
            row.saving_per_hour += r.get("saving_per_hour") or 0.0
        row.actions[(r["action"], r.get("target") or "")] += r["cost_wasted"] or r["gpu_hours_idle"]
        row.first_idle_ms = min(row.first_idle_ms, r["idle_since_ms"])
        row.last_seen_ms = max(row.last_seen_ms, r["last_seen_ms"])
    out = sorted(rows.values(), key=lambda x: (-x.cost_wasted, -x.gpu_hours_idle, x.group))
    return out[:top] if top else out


def idle_row_dict(row: IdleRow) -> dict[str, Any]:
    action, target = row.top()
    return {
        "group": row.group,
        "by": row.by,
        "recommendations": row.recommendations,
        "open": row.open,
        "pods": len(row.pods),
        "gpu_hours_idle": _num(row.gpu_hours_idle),
        "cost_wasted": _num(row.cost_wasted),
        "saving_per_hour": _num(row.saving_per_hour),
        "currency": row.currency,
        "top_action": action,
        "top_target": target or None,
        "first_idle": iso(row.first_idle_ms),
        "last_seen": iso(row.last_seen_ms),
    }


def selected(records: Iterable[dict[str, Any]], since_ms: int | None = None) -> list[dict[str, Any]]:
    """The latest revision of each recommendation whose streak went on at or after ``since_ms``."""
    return [r for r in latest_revisions(records) if since_ms is None or r["last_seen_ms"] >= since_ms]


def render_idle(rows: Sequence[IdleRow], fmt: str, *, focus: FocusOptions | None = None) -> str:
    """``rows`` in ``fmt``; the html page is :mod:`gpupipe_consumers.report.idle_html` (it draws on the
    records)."""
    dicts = [idle_row_dict(r) for r in rows]
    if fmt == "json":
        return json.dumps(dicts, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(d, separators=(",", ":")) + "\n" for d in dicts)
    if fmt == "csv":
        return _csv(
            IDLE_COLUMNS,
            [
                ["" if v is None else (_fmt(v) if isinstance(v, float) else str(v)) for v in d.values()]
                for d in dicts
            ],
        )
    if fmt == "table":
        return _table(rows, dicts)
    if fmt == "focus":
        return _focus(rows, focus or FocusOptions())
    raise ReportOptionError(f"unknown format {fmt!r}")


def _table(rows: Sequence[IdleRow], dicts: list[dict[str, Any]]) -> str:
    title = (rows[0].by.upper() if rows else "GROUP").replace("_", " ")
    head = [title, "RECS", "OPEN", "PODS", "GPU-H IDLE", "COST WASTED", "CUR", "SUGGESTED"]
    body = []
    for d in dicts:
        sug = d["top_action"] + (f" {d['top_target']}" if d["top_target"] else "")
        body.append(
            [
                d["group"],
                str(d["recommendations"]),
                str(d["open"]),
                str(d["pods"]),
                f"{d['gpu_hours_idle']:.2f}",
                f"{d['cost_wasted']:.2f}",
                d["currency"],
                sug,
            ]
        )
    if not body:
        return "no idle GPUs in the period\n"
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    numeric = {1, 2, 3, 4, 5}

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    total_h = sum(r.gpu_hours_idle for r in rows)
    total_c = sum(r.cost_wasted for r in rows)
    cur = ",".join(sorted({r.currency for r in rows}))
    return (
        "\n".join(
            [
                line(head),
                *(line(b) for b in body),
                f"… TOTAL {total_h:.2f} GPU-h idle, {total_c:.2f} {cur} wasted",
            ]
        )
        + "\n"
    )


_FOCUS_IDLE_COLUMNS = (
    "BilledCost",
    "BillingCurrency",
    "ChargeCategory",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "EffectiveCost",
    "ListCost",
    "ProviderName",
    "ResourceId",
    "ServiceName",
    "SubAccountName",
    "Tags",
    "x_IdleGpuHours",
    "x_WastedCost",
    "x_RecommendedAction",
    "x_RecommendedTarget",
    "x_SavingPerHour",
)


def _focus(rows: Sequence[IdleRow], opts: FocusOptions) -> str:
    out = []
    for r in rows:
        d = idle_row_dict(r)
        v = {
            "BilledCost": _fmt(0.0),
            "BillingCurrency": r.currency,
            "ChargeCategory": "Usage",
            "ChargeDescription": f"Idle GPU time held by {r.by} {r.group} (already billed by chargeback)",
            "ChargePeriodEnd": d["last_seen"],
            "ChargePeriodStart": d["first_idle"],
            "ConsumedQuantity": _fmt(r.gpu_hours_idle),
            "ConsumedUnit": "GPU-Hours",
            "EffectiveCost": _fmt(0.0),
            "ListCost": _fmt(0.0),
            "ProviderName": opts.provider_name,
            "ResourceId": f"idle/{r.by}/{r.group}",
            "ServiceName": opts.service_name,
            "SubAccountName": r.group if r.by == "team" else "",
            "Tags": json.dumps({f"gpupipe/{r.by}": r.group}, separators=(",", ":")),
            "x_IdleGpuHours": _fmt(r.gpu_hours_idle),
            "x_WastedCost": _fmt(r.cost_wasted),
            "x_RecommendedAction": d["top_action"],
            "x_RecommendedTarget": d["top_target"] or "",
            "x_SavingPerHour": _fmt(r.saving_per_hour),
        }
        out.append([v[c] for c in _FOCUS_IDLE_COLUMNS])
    return _csv(_FOCUS_IDLE_COLUMNS, out)
