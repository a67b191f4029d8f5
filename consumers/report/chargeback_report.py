"""Build chargeback report rows from ChargebackWindow records. Pure: records in, rows out.

Input: any iterable of ChargebackWindow dicts, read with ``isolation.level=read_committed`` (the
partial aggregates of every partition and instance, and correction records). Every record is an
additive partial, so building a report is a filtered group-by-sum:

* ``start_ms``/``end_ms`` keep records whose window *starts* in ``[start_ms, end_ms)``;
* the group key is the period (``window``, ``hour``, ``day``, ``month`` in UTC, or ``all``), the
  chosen dimensions (``namespace``, ``team``, ``node``), the GPU model (a row has one price) and the
  currency; corrections are merged into their window unless ``split_corrections`` keeps them apart
  (e.g. for a billing export whose windows were invoiced already);
* team: the mapping file's first matching rule, else the record's own ``team``, else the namespace.
  Pseudo-namespaces (``__unallocated__``, ``__mig_shared__``) are their own team and always kept.
"""

from __future__ import annotations

import calendar
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from gpupipe.domain.teams import TeamMap
from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_schemas.meaning import PSEUDO_NAMESPACES

DIMENSIONS = ("namespace", "team", "node")
PERIODS = ("window", "hour", "day", "month", "all")
TOTAL, WINDOW, CORRECTION = "total", "window", "correction"

_HOUR_MS = 3_600_000
_DAY_MS = 86_400_000

RECORDED_AT = "recorded_at_ms"
"""Key the Kafka reader adds to every record (not a schema field): the record's Kafka timestamp,
the wall-clock time chargeback's producer wrote it. ``emitted_at_ms`` is the input partition's
event-time watermark, which lags the wall clock by however far behind chargeback is: a record
written days after its month was invoiced can carry an ``emitted_at_ms`` inside that month."""


@dataclass(frozen=True, slots=True)
class ReportRow:
    window_start_ms: int
    window_end_ms: int
    namespace: str | None  # None when not a grouping dimension
    team: str | None  # set when grouping by team, or by namespace (its team)
    node: str | None
    gpu_model: str
    currency: str
    kind: str  # TOTAL (windows and their corrections merged) | WINDOW | CORRECTION
    gpu_hours_allocated: float
    gpu_hours_used: float
    gpu_hours_idle: float
    gpu_hours_activity_unknown: float
    energy_kwh: float
    cost_allocation: float
    cost_energy: float
    cost: float
    default_price: bool  # some record priced this model at the table's default (unknown model)
    records: int
    # Appended with defaults: a workload dimension (owner, claim, label:<key>) and measured carbon.
    group_by: str | None = None  # "owner" | "claim" | "label:<key>" when grouping by a workload dimension
    group: str | None = None
    co2e_kg: float | None = None  # with a --carbon config: energy x grid intensity (x PUE)
    # Billing mode only (``billing_lag_ms`` given; the FOCUS export): the billing period the row is
    # invoiced in, and the unit prices the records carried (part of the key: one price per row).
    billing_period_start_ms: int | None = None
    billing_period_end_ms: int | None = None
    price_per_gpu_hour: float | None = None
    price_per_kwh: float | None = None

    @property
    def is_pseudo(self) -> bool:
        return self.namespace in PSEUDO_NAMESPACES or self.team in PSEUDO_NAMESPACES


def parse_time_ms(text: str, tz: tzinfo = UTC) -> int:
    """ISO 8601 date or date-time to epoch milliseconds; no zone means ``tz`` (the report's time
    zone, UTC by default: '2026-01-01', '...T10:00Z')."""
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise ReportOptionError(f"not an ISO 8601 date or time: {text!r}") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=tz)
    return int(dt.timestamp() * 1000)


def _ms(value: Any) -> int:
    if isinstance(value, datetime):  # decoded with logical types kept
        return int(value.timestamp() * 1000)
    return int(value)


def _period(
    start: int,
    end: int,
    period: str,
    range_start: int | None,
    range_end: int | None,
    first: int,
    last: int,
    tz: tzinfo = UTC,
) -> tuple[int, int]:
    if period == "window":
        return start, end
    if period in ("hour", "day", "month") and tz is not UTC:
        return _local_period(start, period, tz)
    if period == "hour":
        s = start - start % _HOUR_MS
        return s, s + _HOUR_MS
    if period == "day":
        s = start - start % _DAY_MS
        return s, s + _DAY_MS
    if period == "month":
        d = datetime.fromtimestamp(start / 1000, UTC)
        s = datetime(d.year, d.month, 1, tzinfo=UTC)
        days = calendar.monthrange(d.year, d.month)[1]
        s_ms = int(s.timestamp() * 1000)
        return s_ms, s_ms + days * _DAY_MS
    return (range_start if range_start is not None else first, range_end if range_end is not None else last)


def _local_period(ms: int, period: str, tz: tzinfo) -> tuple[int, int]:
    """The hour, day or month of ``tz`` holding ``ms``; a day or month is as long as the zone makes
    it (23 or 25 hours across a daylight-saving change)."""
    d = datetime.fromtimestamp(ms / 1000, tz)
    if period == "hour":
        s = d.replace(minute=0, second=0, microsecond=0)
        s_ms = int(s.timestamp() * 1000)
        return s_ms, s_ms + _HOUR_MS
    if period == "day":
        s = datetime(d.year, d.month, d.day, tzinfo=tz)
        n = s.date() + timedelta(days=1)
        e = datetime(n.year, n.month, n.day, tzinfo=tz)
    else:
        s = datetime(d.year, d.month, 1, tzinfo=tz)
        e = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=tz)
    return int(s.timestamp() * 1000), int(e.timestamp() * 1000)


def check_within_period(ws: int, we: int, ps: int, pe: int, tz: tzinfo, period: str = "month") -> None:
    """Refuse a window that crosses a boundary of its period: its usage cannot be put in either
    period whole. In a time zone other than UTC, a 1 h window at UTC+05:30 does. In UTC,
    chargeback's windows divide a day, but a topic may keep records of a chargeback that accepted
    any window (7 days across a month end); hour periods of longer windows stay as they were."""
    if ws >= ps and we <= pe:
        return
    if tz is not UTC:
        raise ReportOptionError(
            f"the window {_iso(ws)} to {_iso(we)} crosses a period boundary in {tz}: with "
            "--timezone, chargeback's --window must divide the zone's offset from UTC (e.g. 30m)"
        )
    if period != "hour":
        raise ReportOptionError(
            f"the window {_iso(ws)} to {_iso(we)} crosses a period boundary: it was written by a "
            "chargeback whose --window does not divide a day; re-process its input with one that "
            "does, or report --period all"
        )


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%MZ")


class _Sum:
    """Running totals of one report row (seconds, joules, cost; ``co2e`` with a carbon config)."""

    __slots__ = (
        "alloc",
        "co2e",
        "cost_a",
        "cost_e",
        "default",
        "energy",
        "idle",
        "records",
        "unknown",
        "used",
    )

    def __init__(self) -> None:
        self.alloc = self.used = self.idle = self.unknown = self.energy = self.cost_a = self.cost_e = 0.0
        self.co2e = 0.0
        self.default = False
        self.records = 0

    def add(self, amounts: Mapping[str, Any], unknown: float, default: bool) -> None:
        """Add one record's (or one workload part's) seconds, joules and cost."""
        self.alloc += amounts["allocated_gpu_seconds"]
        self.used += amounts["used_gpu_seconds"]
        self.idle += amounts["idle_gpu_seconds"]
        self.unknown += unknown
        self.energy += amounts["energy_joules"]
        self.cost_a += amounts["cost_allocation"]
        self.cost_e += amounts["cost_energy"]
        self.default = self.default or default
        self.records += 1

    def row(
        self,
        window_start_ms: int,
        window_end_ms: int,
        namespace: str | None,
        team: str | None,
        node: str | None,
        gpu_model: str,
        currency: str,
        kind: str,
        **extra: Any,
    ) -> ReportRow:
        """The report row of these totals, in the row's units (hours, kWh); ``extra``: the optional
        columns (billing period, workload group, CO2e)."""
        return ReportRow(
            window_start_ms=window_start_ms,
            window_end_ms=window_end_ms,
            namespace=namespace,
            team=team,
            node=node,
            gpu_model=gpu_model,
            currency=currency,
            kind=kind,
            gpu_hours_allocated=self.alloc / 3600.0,
            gpu_hours_used=self.used / 3600.0,
            gpu_hours_idle=self.idle / 3600.0,
            gpu_hours_activity_unknown=self.unknown / 3600.0,
            energy_kwh=self.energy / 3_600_000.0,
            cost_allocation=self.cost_a,
            cost_energy=self.cost_e,
            cost=self.cost_a + self.cost_e,
            default_price=self.default,
            records=self.records,
            **extra,
        )


def build_report(
    records: Iterable[dict[str, Any]],
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
    by: Sequence[str] = ("namespace",),
    teams: TeamMap | None = None,
    period: str = "window",
    split_corrections: bool = False,
    billing_lag_ms: int | None = None,
    tz: tzinfo = UTC,
) -> list[ReportRow]:
    """Sum ChargebackWindow records into report rows (see the module docstring).

    ``tz``: the time zone of the hour, day and month periods and of the billing periods (UTC by
    default); a window that crosses one of that zone's period boundaries is refused.

    ``billing_lag_ms`` switches to *billing mode* (the FOCUS export, see :func:`billing_place`): a
    record belongs to the billing period (UTC month) of its window, unless it was written
    (:func:`recorded_ms`) more than ``billing_lag_ms`` after that month ended, i.e. after the month
    was invoiced: then it is billed in the month in which it was written, as a ``correction`` row
    whose charge period is still the corrected window's. In-period corrections merge into their
    rows. ``start_ms``/``end_ms`` select by billing date (the window start, or for such a late
    record the time it was written less the lag), so a month's range gives that month's invoice; a
    charge period never extends outside its billing period.
    """
    dims = tuple(by)
    if not dims or any(d not in DIMENSIONS for d in dims) or len(set(dims)) != len(dims):
        raise ReportOptionError(
            f"group by one or more of {', '.join(DIMENSIONS)} (each once), got {list(dims)}"
        )
    check_period(period)
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise ReportOptionError("the end of the range must be after its start")
    teams = teams if teams is not None else TeamMap()

    # One pass, no list of records: memory is the number of rows, not of records. With
    # period "all" the span is known only at the end, so those rows are keyed without it first.
    first = last = None
    sums: dict[tuple[Any, ...], _Sum] = {}
    billing = billing_lag_ms is not None
    for rec in records:
        ws, we = _ms(rec["window_start_ms"]), _ms(rec["window_end_ms"])
        placed = place_record(
            rec,
            ws,
            we,
            period=period,
            start_ms=start_ms,
            end_ms=end_ms,
            billing_lag_ms=billing_lag_ms,
            split_corrections=split_corrections,
            tz=tz,
        )
        if placed is None:
            continue
        ps, pe, kind, extra = placed
        first = ws if first is None else min(first, ws)
        last = we if last is None else max(last, we)
        ns = rec["namespace"]
        team = ns if ns in PSEUDO_NAMESPACES else (teams.match(ns) or rec.get("team") or ns)
        key = (
            ps,
            pe,
            ns if "namespace" in dims else None,
            team if ("team" in dims or "namespace" in dims) else None,
            rec["node"] if "node" in dims else None,
            rec["gpu_model"],
            rec["currency"],
            kind,
            *extra,
        )
        s = sums.get(key)
        if s is None:
            s = sums[key] = _Sum()
        s.add(rec, rec.get("activity_unknown_gpu_seconds") or 0.0, rec.get("price_source") == "default")

    if period == "all" and not billing:
        sums = span_all(sums, first, last, start_ms, end_ms)
    rows = [s.row(*k[:8], **(billing_columns(k[8:]) if billing else {})) for k, s in sums.items()]
    rows.sort(key=_sort_key)
    return rows


def check_period(period: str) -> None:
    if period not in PERIODS:
        raise ReportOptionError(f"period must be one of {', '.join(PERIODS)}, got {period!r}")


def place_record(
    rec: dict[str, Any],
    ws: int,
    we: int,
    *,
    period: str,
    start_ms: int | None,
    end_ms: int | None,
    billing_lag_ms: int | None,
    split_corrections: bool,
    tz: tzinfo,
) -> tuple[int, int, str, tuple[Any, ...]] | None:
    """Where a record (window ``ws``..``we``) is summed: its period's start and end, its row kind
    and, in billing mode, the key's billing columns (billing period and prices); None: not in
    the range."""
    if billing_lag_ms is not None:
        place = billing_place(
            rec,
            ws,
            we,
            period=period,
            start_ms=start_ms,
            end_ms=end_ms,
            lag_ms=billing_lag_ms or 0,
            tz=tz,
        )
        if place is None:
            return None
        ps, pe, bp, kind = place
        return ps, pe, kind, (*bp, rec.get("price_per_gpu_hour"), rec.get("price_per_kwh"))
    if (start_ms is not None and ws < start_ms) or (end_ms is not None and ws >= end_ms):
        return None
    # period "all": the span is known at the end (rows are re-keyed then, see span_all)
    ps, pe = (0, 0) if period == "all" else _period(ws, we, period, start_ms, end_ms, ws, we, tz)
    if period != "all":
        check_within_period(ws, we, ps, pe, tz, period)
    kind = (CORRECTION if rec["kind"] == CORRECTION else WINDOW) if split_corrections else TOTAL
    return ps, pe, kind, ()


def span_all(
    sums: dict[tuple[Any, ...], _Sum],
    first: int | None,
    last: int | None,
    start_ms: int | None,
    end_ms: int | None,
) -> dict[tuple[Any, ...], _Sum]:
    """Rows of period "all" keyed by the span of what was read (their first two key items)."""
    if first is None or last is None:
        return sums
    span = _period(first, last, "all", start_ms, end_ms, first, last)
    return {(*span, *k[2:]): s for k, s in sums.items()}


def billing_columns(cols: tuple[Any, ...]) -> dict[str, Any]:
    """The billing key columns of :func:`place_record` as the row's fields."""
    return dict(
        billing_period_start_ms=cols[0],
        billing_period_end_ms=cols[1],
        price_per_gpu_hour=cols[2],
        price_per_kwh=cols[3],
    )


def recorded_ms(rec: dict[str, Any]) -> int:
    """When a record was written: its Kafka timestamp (``RECORDED_AT``, set by the reader), else the
    ``emitted_at_ms`` it carries (records from a file), else its window start."""
    for key in (RECORDED_AT, "emitted_at_ms"):
        value = rec.get(key)
        if value:
            return _ms(value)
    return _ms(rec["window_start_ms"])


def billing_place(
    rec: dict[str, Any],
    ws: int,
    we: int,
    *,
    period: str,
    start_ms: int | None,
    end_ms: int | None,
    lag_ms: int,
    tz: tzinfo = UTC,
) -> tuple[int, int, tuple[int, int], str] | None:
    """Billing mode: (charge period start, end, billing period, kind) of a record, or
    None when its billing date is outside ``[start_ms, end_ms)``.

    A record belongs to the billing period (UTC month) of its window, unless it was written more
    than ``lag_ms`` after that month ended, i.e. after the month was invoiced: then it is billed in
    the month in which it was written (less the lag), as a ``correction`` whose charge period is the
    corrected window's. Otherwise its charge period never extends outside its billing period, nor
    outside the range with period ``all``.
    """
    bp = _month(ws, tz)
    check_within_period(ws, we, *bp, tz)
    written = recorded_ms(rec) - lag_ms
    late = written >= bp[1]
    billed_at = ws
    if late:
        bp, billed_at = _month(written, tz), written
    if (start_ms is not None and billed_at < start_ms) or (end_ms is not None and billed_at >= end_ms):
        return None
    ps, pe = _period(ws, we, "month" if period == "all" else period, None, None, ws, we, tz)
    if not late:  # a window or day cannot cross a month; a window that does not divide one can
        ps, pe = max(ps, bp[0]), min(pe, bp[1])
        if period == "all" and start_ms is not None:
            ps = max(ps, start_ms)
        if period == "all" and end_ms is not None:
            pe = min(pe, end_ms)
    return ps, pe, bp, CORRECTION if late else TOTAL


def _month(ms: int, tz: tzinfo = UTC) -> tuple[int, int]:
    """The month (of ``tz``) holding ``ms``: (start, end) in epoch milliseconds."""
    return _period(ms, ms, "month", None, None, ms, ms, tz)


def billing_period(ms: int, tz: tzinfo = UTC) -> tuple[int, int]:
    """The billing period (a month of ``tz``) holding ``ms``."""
    return _month(ms, tz)


def _sort_key(r: ReportRow) -> tuple[Any, ...]:
    def name(v: str | None) -> tuple[bool, str]:
        return (v in PSEUDO_NAMESPACES, v or "")

    who = r.namespace if r.namespace is not None else r.team
    return (
        r.window_start_ms,
        r.window_end_ms,
        r.currency,
        name(who),
        name(r.team),
        r.node or "",
        r.gpu_model,
        r.kind,
    )


def read_records_jsonl(lines: Iterable[str]) -> list[dict[str, Any]]:
    """ChargebackWindow records from JSON lines (one record per line; blank lines ignored)."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ReportOptionError(f"line {n}: not JSON: {exc}") from exc
        if not isinstance(rec, dict):
            raise ReportOptionError(f"line {n}: expected a JSON object")
        out.append(rec)
    return out


CLOSE_MARGIN_MS = 600_000
"""How far past a billing period's cutoff (its end plus the invoice lag) chargeback must have written
a record before the period counts as closed: covers a chargeback transaction still in flight, and
producers' clocks a little apart, at the moment the export reads the topic."""


def open_billing_periods(
    rows: Iterable[ReportRow],
    *,
    end_ms: int | None,
    newest_ms: int | None,
    lag_ms: int,
    tz: tzinfo = UTC,
) -> list[tuple[int, int]]:
    """The billing periods of a billing-mode export that are not closed yet, oldest first.

    A record is billed by when it was written (its Kafka timestamp), so a period's invoice is
    final once nothing written before its cutoff (period end + ``lag_ms``) can still be added:
    when the newest record in the topic (``newest_ms``, what chargeback wrote last) is
    ``CLOSE_MARGIN_MS`` past the cutoff. Written later, a record is in a later period's export, so
    each record is in exactly one final export. The periods are those of ``rows``, and with an
    ``end_ms`` the one holding the range's end (a month whose export is still empty can be open).
    """
    periods = {
        (r.billing_period_start_ms, r.billing_period_end_ms)
        for r in rows
        if r.billing_period_start_ms is not None and r.billing_period_end_ms is not None
    }
    if end_ms is not None:
        periods.add(billing_period(end_ms - 1, tz))
    return sorted((s, e) for s, e in periods if newest_ms is None or newest_ms < e + lag_ms + CLOSE_MARGIN_MS)
