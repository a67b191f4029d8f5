"""Per-workload breakdown of each chargeback row: owner, selected pod labels, HPC job, DRA claim.

A ChargebackWindow row is per (window, namespace, node, GPU model). Billing a team by a label, a
workload by its top controller, a Slurm job or a DRA ResourceClaim needs to know which workloads
made up the row; the producer puts owner, labels, HPC job and claim on every allocation, and this
module keeps, per row, the sums per *workload key* ``(owner_kind, owner_name, labels, hpc_job,
claim_name)``. The row's ``workloads`` field lists them; every contribution of a pod lands in
exactly one entry, so the entries of a row add up to the row (pseudo-namespaces have none).
Reports group by ``owner``, ``claim`` or ``label:<key>`` from here and keep the invariant of the
namespace view.

Kept out of the window engine: the engine aggregates rows as before, and the row's aggregate
delegates the breakdown here (one dict per row, no new row keys, no change to windows, replay or
checkpoints). Cardinality: one entry per workload present in the row's hour on the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupipe_schemas.records import WorkloadShare

WorkloadKey = tuple[str | None, str | None, tuple[tuple[str, str], ...], str | None, str | None]

SECONDS_PER_HOUR = 3600.0
JOULES_PER_KWH = 3_600_000.0


def workload_key(alloc: Mapping[str, Any]) -> WorkloadKey:
    get = alloc.get
    labels = get("labels")
    return (
        get("owner_kind"),
        get("owner_name"),
        tuple(sorted(labels.items())) if labels else (),
        get("hpc_job"),
        get("claim_name"),
    )


def workload_keys(sample: Mapping[str, Any]) -> dict[tuple[str, str], WorkloadKey]:
    """(namespace, pod) -> workload key, from the sample's allocations (first allocation of a pod wins)."""
    allocs = sample.get("allocations")
    if not allocs:
        return {}
    if len(allocs) == 1:  # the common case: one holder
        a = allocs[0]
        return {(a["namespace"], a["pod"]): workload_key(a)}
    out: dict[tuple[str, str], WorkloadKey] = {}
    for a in allocs:
        out.setdefault((a["namespace"], a["pod"]), workload_key(a))
    return out


class WorkloadSums:
    __slots__ = ("allocated_s", "energy_j", "idle_s", "used_s")

    def __init__(self) -> None:
        self.allocated_s = self.used_s = self.idle_s = self.energy_j = 0.0


def add(target: dict[WorkloadKey, WorkloadSums], key: WorkloadKey, c: Any) -> None:
    s = target.get(key)
    if s is None:
        s = target[key] = WorkloadSums()
    s.allocated_s += c.allocated_s
    s.used_s += c.used_s
    s.idle_s += c.idle_s
    s.energy_j += c.energy_j


def to_records(
    sums: Mapping[WorkloadKey, WorkloadSums] | None, per_gpu_hour: float, per_kwh: float
) -> list[WorkloadShare]:
    """The ``workloads`` field of a ChargebackWindow record, sorted by key (deterministic output)."""
    if not sums:
        return []
    out: list[WorkloadShare] = []
    for key in sorted(sums, key=lambda k: tuple("" if x is None else str(x) for x in k)):
        s = sums[key]
        kind, name, labels, job, claim = key
        cost_a = s.allocated_s / SECONDS_PER_HOUR * per_gpu_hour
        cost_e = s.energy_j / JOULES_PER_KWH * per_kwh
        out.append(
            {
                "owner_kind": kind,
                "owner_name": name,
                "labels": dict(labels),
                "hpc_job": job,
                "claim_name": claim,
                "allocated_gpu_seconds": s.allocated_s,
                "used_gpu_seconds": s.used_s,
                "idle_gpu_seconds": s.idle_s,
                "energy_joules": s.energy_j,
                "cost_allocation": cost_a,
                "cost_energy": cost_e,
                "cost_total": cost_a + cost_e,
            }
        )
    return out
