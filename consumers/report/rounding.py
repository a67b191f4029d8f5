"""Rounding policy of the human-facing reports (table, CSV, HTML): rows that add up to the total.

Each row rounded on its own (to cents) need not sum to the rounded total: three rows of 0.333 show
0.33 each and a total of 1.00. A bill whose lines do not add up is questioned, so money is rounded
by the *largest-remainder* method, per currency and per column: the total of the column is rounded
to the currency's minor unit (half up), each row is cut down to that unit, and the units still
missing go to the rows with the largest remainders (the earlier row on a tie). Every row is then
within one minor unit of its exact amount and the rows sum to the rounded total exactly. The table
does the same for its hour and kWh columns (at two decimals), which also have a total line.

Each money column is rounded against its own total, so a row's allocation and energy costs may
differ from its cost by one minor unit; JSON, JSON lines and FOCUS keep six decimals for machines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gpupipe_consumers.report.chargeback_report import ReportRow

MINOR_UNITS_DEFAULT = 2
"""Decimals of a currency that is not listed below (most have cents)."""

MINOR_UNITS = {
    # ISO 4217 currencies whose minor unit is not 1/100.
    "BIF": 0,
    "CLP": 0,
    "DJF": 0,
    "GNF": 0,
    "ISK": 0,
    "JPY": 0,
    "KMF": 0,
    "KRW": 0,
    "PYG": 0,
    "RWF": 0,
    "UGX": 0,
    "UYI": 0,
    "VND": 0,
    "VUV": 0,
    "XAF": 0,
    "XOF": 0,
    "XPF": 0,
    "BHD": 3,
    "IQD": 3,
    "JOD": 3,
    "KWD": 3,
    "LYD": 3,
    "OMR": 3,
    "TND": 3,
    "CLF": 4,
    "UYW": 4,
}

MONEY = ("cost_allocation", "cost_energy", "cost")
QUANTITIES = ("gpu_hours_allocated", "gpu_hours_used", "gpu_hours_idle", "energy_kwh", "co2e_kg")
QUANTITY_DIGITS = 2


def minor_units(currency: str) -> int:
    """Decimals of ``currency``'s minor unit (ISO 4217; 2 when unknown)."""
    return MINOR_UNITS.get(currency.strip().upper(), MINOR_UNITS_DEFAULT)


def money(value: float, currency: str) -> str:
    """``value`` with the decimals of ``currency``."""
    return f"{value:.{minor_units(currency)}f}"


def largest_remainder(values: Sequence[float], digits: int) -> list[float]:
    """``values`` rounded to ``digits`` decimals so that they sum to their rounded sum."""
    scale = 10**digits
    scaled = [round(v * scale, 6) for v in values]  # 0.285 * 100 is 28.499999999999996
    units = [math.floor(x) for x in scaled]
    missing = math.floor(math.fsum(scaled) + 0.5) - sum(units)
    by_remainder = sorted(range(len(units)), key=lambda i: (units[i] - scaled[i], i))
    for i in by_remainder[:missing]:
        units[i] += 1
    return [u / scale for u in units]


def rounded_rows(rows: Sequence[ReportRow], *, quantities: bool = False) -> list[ReportRow]:
    """``rows`` with money (and with ``quantities`` the hour, kWh and CO2e columns) rounded by the
    largest-remainder method per currency (see the module docstring)."""
    out = list(rows)
    for currency in sorted({r.currency for r in rows}):
        idx = [i for i, r in enumerate(rows) if r.currency == currency]
        columns = [(c, minor_units(currency)) for c in MONEY]
        if quantities:
            columns += [(c, QUANTITY_DIGITS) for c in QUANTITIES]
        changes: dict[int, dict[str, float]] = {i: {} for i in idx}
        for name, digits in columns:
            if name == "co2e_kg" and all(rows[i].co2e_kg is None for i in idx):
                continue
            values = largest_remainder([getattr(rows[i], name) or 0.0 for i in idx], digits)
            for i, v in zip(idx, values, strict=True):
                changes[i][name] = v
        for i in idx:
            out[i] = dataclasses.replace(rows[i], **changes[i])  # type: ignore[arg-type]
    return out
