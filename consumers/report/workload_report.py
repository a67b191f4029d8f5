"""Chargeback report rows by workload dimensions: ``owner``, ``claim``, ``label:<key>``, teams from labels,
and measured carbon. Pure: ChargebackWindow records in, ReportRow objects out.

Each record is split into *parts*: one per entry of its ``workloads`` breakdown (owner, selected
labels, HPC job: see ``consumers/chargeback/workloads.py``), plus a remainder for what no entry
covers (records of producers without pod metadata, records written before the breakdown existed,
pseudo-namespaces). The parts of a record add up to the record, so any grouping here adds up to the
namespace view of ``chargeback_report.build_report`` (the invariant, per window: namespaces plus
``__unallocated__`` equal the GPU-seconds observed).

Group values: ``owner`` is ``<namespace>/<Kind>/<name>`` (``<namespace>/(unknown)`` without owner
data; an HPC job is ``hpc/HpcJob/<job id>``); ``claim`` is ``<namespace>/<ResourceClaim>`` for GPUs
held through DRA claims (``<namespace>/(no claim)`` for device-plugin allocations: with consumable
shares several claims split one GPU by measured use, never 100 % to each); ``label:<key>`` is the
label's value, ``(no <key>)``
for pods without it; ``team`` is the mapping's first matching rule for the namespace *or the pod's
labels*, else the record's team, else the namespace. Pseudo-namespaces are their own group in every
dimension. With a carbon intensity function, each part's energy becomes CO2e (``co2e_kg``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, tzinfo
from typing import Any

from gpupipe.domain.teams import TeamMap
from gpupipe_consumers.report.chargeback_report import (
    ReportRow,
    _ms,
    _sort_key,
    _Sum,
    billing_columns,
    check_period,
    place_record,
    span_all,
)
from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_schemas.meaning import PSEUDO_NAMESPACES

BASE_DIMENSIONS = ("namespace", "team", "node")
# (node, window start ms, energy kWh) -> kg CO2e
CarbonFn = Callable[[str, int, float], float]


def is_workload_dim(dim: str) -> bool:
    return dim in ("owner", "claim") or (dim.startswith("label:") and len(dim) > len("label:"))


def valid_dims(dims: Sequence[str]) -> bool:
    workload = [d for d in dims if is_workload_dim(d)]
    ok = all(d in BASE_DIMENSIONS or is_workload_dim(d) for d in dims)
    return bool(dims) and ok and len(workload) <= 1 and len(set(dims)) == len(dims)


def _parts(rec: dict[str, Any]) -> Iterable[tuple[dict[str, Any] | None, float]]:
    """(workload entry or None for the remainder, share of the record's allocated time)."""
    alloc = rec["allocated_gpu_seconds"]
    covered = {
        k: 0.0 for k in ("allocated_gpu_seconds", "used_gpu_seconds", "idle_gpu_seconds", "energy_joules")
    }
    costs = {"cost_allocation": 0.0, "cost_energy": 0.0}
    for w in rec.get("workloads") or ():
        for k in covered:
            covered[k] += w[k]
        for k in costs:
            costs[k] += w[k]
        yield w, (w["allocated_gpu_seconds"] / alloc if alloc else 0.0)
    rest = {k: rec[k] - covered[k] for k in covered}
    rest.update({k: rec[k] - costs[k] for k in costs})
    if not rec.get("workloads") or any(abs(v) > 1e-9 * max(1.0, abs(rec[k])) for k, v in rest.items()):
        rest.update(owner_kind=None, owner_name=None, labels={}, hpc_job=None, claim_name=None)
        yield (
            rest,
            (rest["allocated_gpu_seconds"] / alloc if alloc else (0.0 if rec.get("workloads") else 1.0)),
        )


def group_value(dim: str, ns: str, part: dict[str, Any]) -> str:
    if ns in PSEUDO_NAMESPACES:
        return ns
    if dim == "owner":
        if part.get("owner_name"):
            return f"{ns}/{part.get('owner_kind') or 'Unknown'}/{part['owner_name']}"
        return f"{ns}/(unknown)"
    if dim == "claim":
        return f"{ns}/{part.get('claim_name') or '(no claim)'}"
    key = dim[len("label:") :]
    return (part.get("labels") or {}).get(key) or f"(no {key})"


def build_workload_report(
    records: Iterable[dict[str, Any]],
    *,
    by: Sequence[str] = ("owner",),
    teams: TeamMap | None = None,
    start_ms: int | None = None,
    end_ms: int | None = None,
    period: str = "window",
    split_corrections: bool = False,
    carbon: CarbonFn | None = None,
    billing_lag_ms: int | None = None,
    tz: tzinfo = UTC,
) -> list[ReportRow]:
    """Sum records into rows by ``by`` (see the module docstring), in one pass and bounded memory
    (rows, not records, are kept). ``billing_lag_ms``: billing mode for the FOCUS export, and
    ``tz`` the time zone of periods, as in
    :func:`~gpupipe_consumers.report.chargeback_report.build_report`."""
    dims = tuple(by)
    if not valid_dims(dims):
        raise ReportOptionError(
            "group by namespace, team, node and at most one of owner, claim, label:<key> (each once), "
            f"got {list(dims)}"
        )
    check_period(period)
    teams = teams if teams is not None else TeamMap()
    wdim = next((d for d in dims if is_workload_dim(d)), None)
    billing = billing_lag_ms is not None
    first = last = None
    sums: dict[tuple[Any, ...], _Sum] = {}
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
        for part, share in _parts(rec):
            assert part is not None
            labels = part.get("labels") or {}
            pseudo = ns in PSEUDO_NAMESPACES
            team = ns if pseudo else (teams.match(ns, labels) or rec.get("team") or ns)
            key = (
                ps,
                pe,
                ns if "namespace" in dims else None,
                team if "team" in dims else None,
                rec["node"] if "node" in dims else None,
                group_value(wdim, ns, part) if wdim else None,
                rec["gpu_model"],
                rec["currency"],
                kind,
                *extra,
            )
            s = sums.get(key)
            if s is None:
                s = sums[key] = _Sum()
            s.add(
                part,
                (rec.get("activity_unknown_gpu_seconds") or 0.0) * share,
                rec.get("price_source") == "default",
            )
            if carbon is not None:
                s.co2e += carbon(rec["node"], ws, part["energy_joules"] / 3_600_000.0)
    if period == "all" and not billing:
        sums = span_all(sums, first, last, start_ms, end_ms)
    rows = [
        s.row(
            *k[:5],
            *k[6:9],
            group_by=wdim,
            group=k[5],
            co2e_kg=s.co2e if carbon is not None else None,
            **(billing_columns(k[9:]) if billing else {}),
        )
        for k, s in sums.items()
    ]
    rows.sort(
        key=lambda r: (*_sort_key(r)[:3], r.group in PSEUDO_NAMESPACES, r.group or "", *_sort_key(r)[3:])
    )
    return rows
