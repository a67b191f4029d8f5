"""Render report rows: an aligned terminal table, CSV, JSON, JSON lines, FinOps FOCUS 1.3 CSV, or HTML.

Pure string building. ``csv``/``json``/``jsonl`` share one stable column set (columns that are not
grouping dimensions are empty / null) so scripts can rely on it; ``table`` shows only the grouping
columns and adds a totals row per currency. ``table``, ``csv`` and ``html`` round money to the
currency's minor unit so that the rows add up to the rounded total (``rounding.py``); ``json``,
``jsonl`` and ``focus`` keep six decimals.

FOCUS: every report row becomes up to two charge rows, because FOCUS prices one unit per row: a
GPU-time charge (``GPU-Hours``, at the GPU model's hourly price) and an energy charge (``kWh``).
Costs are internal chargeback prices with no discounts, so BilledCost = EffectiveCost = ListCost =
ContractedCost. ChargeClass is ``Correction`` only on rows that correct an already invoiced billing
period (billing mode, see ``build_report(billing_lag_ms=...)``); split cost allocation columns
(``Allocated*``, FOCUS 1.3) name the namespace or team each GPU charge is allocated to.
The team is the SubAccount. Custom columns are prefixed ``x_`` and come after the FOCUS ones.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpupipe_consumers.report.chargeback_report import CORRECTION, ReportRow
from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_consumers.report.html_report import render_html
from gpupipe_consumers.report.rounding import MONEY, money, rounded_rows

FORMATS = ("table", "csv", "json", "jsonl", "focus", "html")

COLUMNS = (
    "window_start",
    "window_end",
    "namespace",
    "team",
    "node",
    "gpu_model",
    "kind",
    "gpu_hours_allocated",
    "gpu_hours_used",
    "gpu_hours_idle",
    "gpu_hours_activity_unknown",
    "energy_kwh",
    "cost_allocation",
    "cost_energy",
    "cost",
    "currency",
    "default_price",
)

FOCUS_COLUMNS = (
    "AllocatedMethodDetails",
    "AllocatedMethodId",
    "AllocatedResourceId",
    "AllocatedResourceName",
    "AllocatedTags",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "HostProviderName",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceProviderName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_Namespace",
    "x_Team",
    "x_Node",
    "x_GpuModel",
    "x_GpuHoursAllocated",
    "x_GpuHoursUsed",
    "x_GpuHoursIdle",
    "x_EnergyKwh",
    "x_DefaultPrice",
)
# Appended only when a report has them (a workload dimension; a --carbon config).
FOCUS_GROUP_COLUMNS = ("x_GroupBy", "x_Group")
FOCUS_CARBON_COLUMNS = ("x_CarbonGCO2e",)
FOCUS_PROVISIONAL_COLUMN = "x_Provisional"  # only in a --provisional export

_DIGITS = 6  # machine formats: micro-units are plenty for hours, kWh and money


@dataclass(frozen=True, slots=True)
class FocusOptions:
    """Who issues the internal bill; shows in the FOCUS provider and account columns."""

    provider_name: str = "gpupipe"
    billing_account_id: str = "gpupipe"
    billing_account_name: str = "GPU chargeback"
    service_name: str = "Kubernetes GPU"
    # An export of billing periods not closed yet (``--provisional``): every line says so in an
    # ``x_Provisional`` column, so that it is never mistaken for the final invoice.
    provisional: bool = False


def iso(ms: int) -> str:
    """UTC ``YYYY-MM-DDTHH:MM:SSZ`` (the FOCUS date-time format)."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _num(x: float) -> float:
    v = round(x, _DIGITS)
    return 0.0 if v == 0 else v  # no "-0.0"


def _fmt(x: float) -> str:
    return f"{_num(x):.{_DIGITS}f}"


def row_dict(row: ReportRow) -> dict[str, Any]:
    """One row with the machine-format columns (numbers rounded to 6 decimals)."""
    return {
        "window_start": iso(row.window_start_ms),
        "window_end": iso(row.window_end_ms),
        "namespace": row.namespace,
        "team": row.team,
        "node": row.node,
        "gpu_model": row.gpu_model,
        "kind": row.kind,
        "gpu_hours_allocated": _num(row.gpu_hours_allocated),
        "gpu_hours_used": _num(row.gpu_hours_used),
        "gpu_hours_idle": _num(row.gpu_hours_idle),
        "gpu_hours_activity_unknown": _num(row.gpu_hours_activity_unknown),
        "energy_kwh": _num(row.energy_kwh),
        "cost_allocation": _num(row.cost_allocation),
        "cost_energy": _num(row.cost_energy),
        "cost": _num(row.cost),
        "currency": row.currency,
        "default_price": row.default_price,
        **_extra_columns(row),
    }


def _extra_columns(row: ReportRow) -> dict[str, Any]:
    """Columns only reports that use them have: the workload dimension, measured carbon."""
    out: dict[str, Any] = {}
    if row.group_by is not None:
        out["group_by"], out["group"] = row.group_by, row.group
    if row.co2e_kg is not None:
        out["co2e_kg"] = _num(row.co2e_kg)
    return out


def render_report(rows: Sequence[ReportRow], fmt: str, *, focus: FocusOptions | None = None) -> str:
    """The report in ``fmt`` (one of FORMATS), ending with a newline."""
    if fmt == "table":
        return render_table(rounded_rows(rows, quantities=True))
    if fmt == "csv":
        header = list(row_dict(rows[0])) if rows else list(COLUMNS)
        return _csv(header, [_csv_values(_money_cells(row_dict(r), r.currency)) for r in rounded_rows(rows)])
    if fmt == "json":
        return json.dumps([row_dict(r) for r in rows], indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(row_dict(r), separators=(",", ":")) + "\n" for r in rows)
    if fmt == "focus":
        return render_focus(rows, focus or FocusOptions())
    if fmt == "html":
        return render_html(rounded_rows(rows))
    raise ReportOptionError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _money_cells(d: dict[str, Any], currency: str) -> dict[str, Any]:
    """CSV: money in the currency's minor unit, as the rounding policy rounded it."""
    return {k: money(v, currency) if k in MONEY else v for k, v in d.items()}


def _csv_values(d: dict[str, Any]) -> list[str]:
    out = []
    for v in d.values():
        if v is None:
            out.append("")
        elif isinstance(v, bool):
            out.append("true" if v else "false")
        elif isinstance(v, float):
            out.append(_fmt(v))
        else:
            out.append(str(v))
    return out


#: A cell a spreadsheet would run as a formula (OWASP's CSV injection list), unless it is a number.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value: str) -> str:
    """``value`` safe to open in a spreadsheet: a forged ``=HYPERLINK(...)`` namespace stays text."""
    if value.startswith(_FORMULA_START) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def _csv(header: Sequence[str], rows: list[list[str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows([csv_cell(c) for c in row] for row in rows)
    return buf.getvalue()


# -- table ----------------------------------------------------------------------------------------
def render_table(rows: Sequence[ReportRow]) -> str:
    dims = [
        (name, title)
        for name, title in (
            ("namespace", "NAMESPACE"),
            ("team", "TEAM"),
            ("group", (rows[0].group_by or "").upper() if rows else ""),
            ("node", "NODE"),
        )
        if any(getattr(r, name) is not None for r in rows)
    ]
    carbon = any(r.co2e_kg is not None for r in rows)
    split = any(r.kind != "total" for r in rows)
    head = ["WINDOW START", "WINDOW END", *(t for _, t in dims), "GPU MODEL"]
    if split:
        head.append("KIND")
    nums = [
        "GPU-H ALLOC",
        "GPU-H USED",
        "GPU-H IDLE",
        "ENERGY KWH",
        *(["CO2E KG"] if carbon else []),
        "COST",
        "CUR",
    ]
    body = [_table_line(r, dims, split, carbon) for r in rows]
    foot = _table_totals(rows, carbon, len(head), len(nums))
    lines = _aligned([head + nums, *body, *foot], len(head), len(body))
    if any(r.default_price for r in rows):
        lines.append("* GPU model not in the price table: billed at the default price")
    return "\n".join(lines) + "\n"


def _table_line(r: ReportRow, dims: list[tuple[str, str]], split: bool, carbon: bool) -> list[str]:
    left = [
        _short(r.window_start_ms),
        _short(r.window_end_ms),
        *(getattr(r, n) or "" for n, _ in dims),
        r.gpu_model + (" *" if r.default_price else ""),
    ]
    if split:
        left.append(r.kind)
    return [
        *left,
        f"{r.gpu_hours_allocated:.2f}",
        f"{r.gpu_hours_used:.2f}",
        f"{r.gpu_hours_idle:.2f}",
        f"{r.energy_kwh:.2f}",
        *([f"{r.co2e_kg or 0.0:.2f}"] if carbon else []),
        money(r.cost, r.currency),
        r.currency,
    ]


def _table_totals(rows: Sequence[ReportRow], carbon: bool, n_head: int, n_nums: int) -> list[list[str]]:
    """One TOTAL line per currency (one of zeros when there is no row)."""
    totals: dict[str, list[float]] = {}
    for r in rows:
        values = [r.gpu_hours_allocated, r.gpu_hours_used, r.gpu_hours_idle, r.energy_kwh]
        values += [r.co2e_kg or 0.0] if carbon else []
        t = totals.setdefault(r.currency, [0.0] * (len(values) + 1))
        for i, v in enumerate((*values, r.cost)):
            t[i] += v
    # Rows were rounded so that they add up to the rounded totals (rounding.py).
    foot = [
        ["TOTAL"] + [""] * (n_head - 1) + [f"{v:.2f}" for v in t[:-1]] + [money(t[-1], cur), cur]
        for cur, t in sorted(totals.items())
    ]
    return foot or [["TOTAL"] + [""] * (n_head - 1) + ["0.00"] * (n_nums - 1) + [""]]


def _aligned(table: list[list[str]], first_num: int, n_body: int) -> list[str]:
    """The header, body and foot lines in columns: numbers right-aligned, a rule under the header
    and above the foot."""
    header, body, foot = table[0], table[1 : 1 + n_body], table[1 + n_body :]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]

    def fmt_line(cells: list[str]) -> str:
        parts = [
            c.rjust(widths[i]) if i >= first_num and i < len(cells) - 1 else c.ljust(widths[i])
            for i, c in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths).rstrip()
    return [fmt_line(header), rule, *(fmt_line(b) for b in body), rule, *(fmt_line(f) for f in foot)]


def _short(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")


# -- FOCUS ----------------------------------------------------------------------------------------
def _billing_period(ms: int) -> tuple[str, str]:
    d = datetime.fromtimestamp(ms / 1000, UTC)
    start = datetime(d.year, d.month, 1, tzinfo=UTC)
    end = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    return start.strftime("%Y-%m-%dT%H:%M:%SZ"), end.strftime("%Y-%m-%dT%H:%M:%SZ")


def _subject(r: ReportRow) -> str:
    parts = []
    if r.namespace is not None:
        parts.append(f"namespace {r.namespace}")
    elif r.team is not None:
        parts.append(f"team {r.team}")
    if r.group_by is not None:
        parts.append(f"{r.group_by} {r.group}")
    if r.node is not None:
        parts.append(f"node {r.node}")
    return ", ".join(parts) or "all namespaces"


def _resource_id(r: ReportRow) -> str:
    parts = [
        f"{k}={v}"
        for k, v in (
            ("namespace", r.namespace),
            ("team", None if r.namespace else r.team),
            (r.group_by, r.group),
            ("node", r.node),
        )
        if k is not None and v is not None
    ]
    return "/".join(["gpu", *parts, f"model={r.gpu_model}"])


def _origin(r: ReportRow) -> tuple[Any, ...]:
    """The origin charge a row is an allocated part of: the GPUs of one model (on one node)."""
    return (r.billing_period_start_ms, r.window_start_ms, r.window_end_ms, r.kind, r.node, r.gpu_model)


def render_focus(rows: Sequence[ReportRow], opts: FocusOptions) -> str:
    """FOCUS 1.3 Cost and Usage rows, two charges (GPU time, energy) per report row.

    Split cost allocation (1.3): each row is an *allocated charge* of an origin charge, the GPUs of
    one model (on one node when grouped by node) in one charge period; ``ResourceId`` names the
    origin, ``AllocatedResourceId`` the namespace or team it is allocated to (null for the
    unallocated portion: pseudo-namespaces), ``AllocatedMethodDetails`` the ratio of the origin.
    ``ChargeClass`` is ``Correction`` only for rows of billing mode that correct an earlier,
    already invoiced billing period (see ``build_report(billing_lag_ms=...)``), else null.
    """
    origin_gpu: dict[tuple[Any, ...], float] = {}
    origin_kwh: dict[tuple[Any, ...], float] = {}
    for r in rows:
        o = _origin(r)
        origin_gpu[o] = origin_gpu.get(o, 0.0) + r.gpu_hours_allocated
        origin_kwh[o] = origin_kwh.get(o, 0.0) + r.energy_kwh
    out: list[dict[str, str]] = []
    for r in rows:
        base = _focus_common(r, opts)
        o = _origin(r)
        if r.gpu_hours_allocated != 0 or r.cost_allocation != 0:
            alloc = _allocation("gpupipe-gpu-time", r.gpu_hours_allocated, origin_gpu[o], "GPU-Hours")
            out.append(_focus_line({**base, **alloc, **_gpu_charge(r)}))
        if r.energy_kwh != 0 or r.cost_energy != 0:
            alloc = _allocation("gpupipe-gpu-energy", r.energy_kwh, origin_kwh[o], "kWh")
            out.append(_focus_line({**base, **alloc, **_energy_charge(r)}))
    header = list(FOCUS_COLUMNS)
    if any(r.group_by is not None for r in rows):
        header += FOCUS_GROUP_COLUMNS
    if any(r.co2e_kg is not None for r in rows):
        header += FOCUS_CARBON_COLUMNS
    if opts.provisional:
        header.append(FOCUS_PROVISIONAL_COLUMN)
        for values in out:
            values[FOCUS_PROVISIONAL_COLUMN] = "true"
    return _csv(header, [[values.get(c, "") for c in header] for values in out])


def _focus_common(r: ReportRow, opts: FocusOptions) -> dict[str, str]:
    """The FOCUS columns both charges of a row share (who, when, where, billing period)."""
    if r.billing_period_start_ms is not None and r.billing_period_end_ms is not None:
        bp_start, bp_end = iso(r.billing_period_start_ms), iso(r.billing_period_end_ms)
    else:
        bp_start, bp_end = _billing_period(r.window_start_ms)
    billed_late = r.billing_period_start_ms is not None and r.kind == CORRECTION
    tags = {k: v for k, v in (("gpupipe/node", r.node), ("gpupipe/gpu-model", r.gpu_model)) if v}
    allocated_tags = {
        k: v
        for k, v in (
            ("gpupipe/namespace", r.namespace),
            ("gpupipe/team", r.team),
            (f"gpupipe/{r.group_by}", r.group),
        )
        if v is not None
    }
    holder = next((h for h in (r.namespace, r.team, r.group) if h is not None), None)
    return {
        "BillingAccountId": opts.billing_account_id,
        "BillingAccountName": opts.billing_account_name,
        "BillingCurrency": r.currency,
        "BillingPeriodEnd": bp_end,
        "BillingPeriodStart": bp_start,
        "ChargeCategory": "Usage",
        "ChargeClass": "Correction" if billed_late else "",
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodEnd": iso(r.window_end_ms),
        "ChargePeriodStart": iso(r.window_start_ms),
        "HostProviderName": opts.provider_name,
        "InvoiceIssuerName": opts.provider_name,
        "PricingCategory": "Standard",
        "ProviderName": opts.provider_name,
        "PublisherName": opts.provider_name,
        "RegionId": "",
        "RegionName": "",
        "ResourceId": _origin_id(r),
        "ResourceName": f"{r.gpu_model} GPUs" + (f" on {r.node}" if r.node else ""),
        "AllocatedResourceId": "" if r.is_pseudo else _resource_id(r),
        "AllocatedResourceName": "" if r.is_pseudo else (holder or ""),
        "AllocatedTags": json.dumps(allocated_tags, separators=(",", ":"), sort_keys=True),
        "ServiceCategory": "Compute",
        "ServiceName": opts.service_name,
        "ServiceProviderName": opts.provider_name,
        "ServiceSubcategory": "Containers",
        "SubAccountId": r.team or "",
        "SubAccountName": r.team or "",
        "Tags": json.dumps(tags, separators=(",", ":"), sort_keys=True),
        "x_Namespace": r.namespace or "",
        "x_Team": r.team or "",
        "x_Node": r.node or "",
        "x_GpuModel": r.gpu_model,
        "x_DefaultPrice": "true" if r.default_price else "false",
        "x_GroupBy": r.group_by or "",
        "x_Group": r.group or "",
        "x_CarbonGCO2e": "",
    }


def _origin_id(r: ReportRow) -> str:
    return "/".join(["gpu", *([f"node={r.node}"] if r.node else []), f"model={r.gpu_model}"])


def _allocation(method: str, quantity: float, origin: float, unit: str) -> dict[str, str]:
    """AllocatedMethodId and AllocatedMethodDetails (FOCUS 1.3 split cost allocation) of one charge."""
    ratio = quantity / origin if origin else 0.0
    details = {
        "Elements": [{"AllocatedRatio": _num(ratio), "UsageUnit": unit, "UsageQuantity": _num(quantity)}]
    }
    return {
        "AllocatedMethodId": method,
        "AllocatedMethodDetails": json.dumps(details, separators=(",", ":")),
    }


def _gpu_charge(r: ReportRow) -> dict[str, str]:
    if r.price_per_gpu_hour is not None:  # billing mode: the price-table entry, stable over time
        unit_price = r.price_per_gpu_hour
    else:
        unit_price = r.cost_allocation / r.gpu_hours_allocated if r.gpu_hours_allocated else 0.0
    what = f"{r.gpu_hours_allocated:.3f} GPU-hours of {r.gpu_model}"
    return {
        "ChargeDescription": f"GPU time: {what} for {_subject(r)}",
        "ResourceType": "GPU",
        "SkuId": f"gpu-hour/{r.gpu_model}",
        "SkuMeter": "GPU Allocation",
        "SkuPriceId": f"gpu-hour/{r.gpu_model}/{_fmt(unit_price)}",
        **_quantity(r.gpu_hours_allocated, "GPU-Hours", unit_price, r.cost_allocation),
        "x_GpuHoursAllocated": _fmt(r.gpu_hours_allocated),
        "x_GpuHoursUsed": _fmt(r.gpu_hours_used),
        "x_GpuHoursIdle": _fmt(r.gpu_hours_idle),
        "x_EnergyKwh": "",
    }


def _energy_charge(r: ReportRow) -> dict[str, str]:
    if r.price_per_kwh is not None:
        unit_price = r.price_per_kwh
    else:
        unit_price = r.cost_energy / r.energy_kwh if r.energy_kwh else 0.0
    what = f"{r.energy_kwh:.3f} kWh drawn by {r.gpu_model} GPUs"
    return {
        "ChargeDescription": f"GPU energy: {what} for {_subject(r)}",
        "ResourceType": "GPU Energy",
        "SkuId": "gpu-energy-kwh",
        "SkuMeter": "GPU Energy",
        "SkuPriceId": f"gpu-energy-kwh/{_fmt(unit_price)}",
        **_quantity(r.energy_kwh, "kWh", unit_price, r.cost_energy),
        "x_GpuHoursAllocated": "",
        "x_GpuHoursUsed": "",
        "x_GpuHoursIdle": "",
        "x_EnergyKwh": _fmt(r.energy_kwh),
        "x_CarbonGCO2e": _fmt(r.co2e_kg * 1000.0) if r.co2e_kg is not None else "",
    }


def _quantity(quantity: float, unit: str, unit_price: float, cost: float) -> dict[str, str]:
    q, p = _fmt(quantity), _fmt(unit_price)
    return {
        "ConsumedQuantity": q,
        "ConsumedUnit": unit,
        "PricingQuantity": q,
        "PricingUnit": unit,
        "ListUnitPrice": p,
        "ContractedUnitPrice": p,
        **_costs(cost),
    }


def _costs(cost: float) -> dict[str, str]:
    v = _fmt(cost)
    return {"BilledCost": v, "EffectiveCost": v, "ListCost": v, "ContractedCost": v}


def _focus_line(values: dict[str, str]) -> dict[str, str]:
    return values
