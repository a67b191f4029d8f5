"""The shared-GPU split of docs/recipes/gpu-hours.md (section 2): who pays for a sample's GPU time.

Standard library only, no gpupipe code: copy this file beside a job and call ``pod_shares`` with a
decoded GpuSample (a dict; Avro field names), or the fields it reads. The plain-Avro recipe calls it
and DuckDB's as a user-defined function (Flink's writes the rule in SQL); each is checked against
chargeback.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

UNALLOCATED, UNATTRIBUTED = "__unallocated__", "__unattributed__"


def unit(x: float) -> float:
    """``x`` clamped to 0..1 (NaN to 0)."""
    return min(x, 1.0) if x >= 0.0 else 0.0


def activity(s: dict[str, Any]) -> float | None:
    value = s.get("sm_active_ratio")
    if value is None:
        value = s.get("gpu_util_ratio")
    return None if value is None else min(max(float(value), 0.0), 1.0)


def pod_shares(s: dict[str, Any]) -> dict[str, float]:
    """Namespace -> its part of the sample's GPU time; the parts add up to 1 (gpu-hours.md, 2)."""
    if s.get("gpu_lost"):
        return {UNALLOCATED: 1.0}
    if s.get("allocations_known") is False:
        return {UNATTRIBUTED: 1.0}
    replicas: dict[tuple[str, str], set[int]] = {}
    for a in s.get("allocations") or ():
        held = replicas.setdefault((a["namespace"], a["pod"]), set())
        if a.get("replica") is not None:
            held.add(a["replica"])
    units = {pod: max(len(r), 1) for pod, r in replicas.items()}
    if not units:
        return {UNALLOCATED: 1.0}
    held_total = sum(units.values())
    rep = s.get("shared_replicas")
    cap = max(rep, held_total) if rep is not None and rep > 0 else held_total
    if len(units) == 1 and cap == held_total:
        return {next(iter(units))[0]: 1.0}
    out: dict[str, float] = defaultdict(float)

    def owners(field: str) -> dict[tuple[str, str] | None, float]:
        w: dict[tuple[str, str] | None, float] = defaultdict(float)
        for p in s.get("processes") or ():
            v = p.get(field)
            if v is not None and v > 0:
                owner = (p["namespace"], p["pod"]) if p.get("namespace") and p.get("pod") else None
                w[owner] += unit(v) if field == "sm_util_ratio" else float(v)
        return w

    w, act = owners("sm_util_ratio"), activity(s)
    if w:
        used = min(sum(w.values()), 1.0)
    else:
        w, used = owners("used_memory_bytes"), act or 0.0
    if not w or not used:
        for (ns, _), n in units.items():
            out[ns] += n / cap
        if cap > held_total:
            out[UNALLOCATED] += (cap - held_total) / cap
        return out
    total, idle = sum(w.values()), 1.0 - used
    unplaced = used * w.get(None, 0.0) / total
    for pod, n in units.items():
        out[pod[0]] += used * w.get(pod, 0.0) / total + unplaced * n / held_total + idle * n / cap
    for owner, v in w.items():
        if owner is not None and owner not in units:
            out[owner[0]] += used * v / total
    if cap > held_total:
        out[UNALLOCATED] += idle * (cap - held_total) / cap
    return out
