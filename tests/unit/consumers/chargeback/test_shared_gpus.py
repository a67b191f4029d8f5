"""Shared GPUs are billed by measured use, with idle capacity split by allocation.

Time-sliced (and DRA-shared) GPUs: each holder pays its measured process use plus its replicas'
share of the idle time; the replicas nobody holds are ``__unallocated__``. MIG: each slice pays
its slice fraction of the parent GPU's energy. The rules and the worked example are in the
docs/chargeback.md "Shared GPUs" section (``test_the_readme_worked_example`` checks its numbers).
"""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from gpupipe.domain.prices import parse_price_table
from gpupipe_consumers.chargeback.accounting import AccountingConfig, ReferenceSample, account
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.formats import FocusOptions, render_report
from gpupipe_schemas.meaning import MIG_SHARED, UNALLOCATED, UNATTRIBUTED
from tests.paths import REPO
from tests.synthetic_fleet import blank_sample

CFG = AccountingConfig()
T0 = 1_767_225_600_000
README = REPO / "docs" / "chargeback.md"


def alloc(ns: str, pod: str, replica: int | None, resource: str = "nvidia.com/gpu") -> dict:
    return {"namespace": ns, "pod": pod, "container": "main", "resource_name": resource, "replica": replica}


def proc(ns: str | None, pod: str | None, sm: float | None, pid: int = 1, mem: int | None = None) -> dict:
    return {
        "pid": pid,
        "process_name": "python",
        "used_memory_bytes": mem,
        "sm_util_ratio": sm,
        "mem_util_ratio": None,
        "namespace": ns,
        "pod": pod,
        "container": "main",
    }


def sample(allocations: list[dict], processes: list[dict] = (), **kw) -> dict:
    base = dict(
        timestamp_ms=T0,
        hostname="n1",
        gpu_index=0,
        uuid="GPU-a",
        pci_bus_id="0:1",
        model_name="NVIDIA H200",
        interval_ms=10_000,
        gpu_util_ratio=0.0,
        allocations=allocations,
        processes=list(processes),
    )
    base.update(kw)
    return blank_sample(**base)


def bills(s: dict, ref: ReferenceSample | None = None) -> dict[str, float]:
    """GPU-seconds per namespace for one 10 s sample."""
    out: dict[str, float] = {}
    for c in account(s, ref, 1, CFG).contributions:
        out[c.namespace] = out.get(c.namespace, 0.0) + c.allocated_s
    return out


# -- time-slicing: allocation by replicas ------------------------------------------------------------
def test_a_pod_alone_on_a_four_replica_gpu_pays_a_quarter_of_the_idle_time():
    got = bills(sample([alloc("a", "pa", 0)], shared_replicas=4))
    assert got == pytest.approx({"a": 2.5, UNALLOCATED: 7.5})


def test_a_pods_bill_does_not_change_when_an_idle_neighbour_arrives():
    alone = sample([alloc("a", "pa", 0)], [proc("a", "pa", 0.6)], shared_replicas=4, gpu_util_ratio=0.6)
    with_b = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("a", "pa", 0.6)],
        shared_replicas=4,
        gpu_util_ratio=0.6,
    )
    # A: its 60 % of use (6 s) plus its quarter of the 4 idle seconds.
    assert bills(alone)["a"] == pytest.approx(7.0)
    assert bills(with_b)["a"] == pytest.approx(7.0)
    assert bills(with_b)["b"] == pytest.approx(1.0)


def test_three_of_four_replicas_pay_three_quarters_of_the_idle_time():
    held = [alloc("a", "pa", 0), alloc("a", "pa", 1), alloc("a", "pa", 2), alloc("b", "pb", 3)]
    assert bills(sample(held, shared_replicas=4)) == pytest.approx({"a": 7.5, "b": 2.5})


def test_without_a_replica_count_the_held_replicas_are_the_whole_gpu():
    held = [alloc("a", "pa", 0), alloc("a", "pa", 1), alloc("a", "pa", 2), alloc("b", "pb", 3)]
    assert bills(sample(held)) == pytest.approx({"a": 7.5, "b": 2.5})


# -- measured use -------------------------------------------------------------------------------
def test_the_heavy_user_behind_an_unattributed_process_still_pays():
    """A's process (5 %) is attributed; B's (90 %) could not be placed in a pod. Only holders run on
    an allocated device, so the unplaced use is the holders', split by allocation: never 0 for B,
    never 100 % for A, and nothing to ``__unattributed__``."""
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("a", "pa", 0.05), proc(None, None, 0.9, pid=2)],
        shared_replicas=2,
        gpu_util_ratio=0.95,
    )
    got = bills(s)
    assert UNATTRIBUTED not in got
    assert got["a"] == pytest.approx(0.5 + 4.5 + 0.25)
    assert got["b"] == pytest.approx(4.5 + 0.25)
    assert sum(got.values()) == pytest.approx(10.0)


def test_a_holder_using_most_of_the_gpu_pays_at_least_its_use():
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1), alloc("b", "pb", 2)],
        [proc("a", "pa", 0.9), proc("b", "pb", 0.02, pid=2)],
        shared_replicas=4,
        gpu_util_ratio=0.92,
    )
    got = bills(s)
    assert got["a"] >= 9.0 and got["b"] > 0.2
    assert got == pytest.approx({"a": 9.0 + 0.8 * 0.25, "b": 0.2 + 0.8 * 0.5, UNALLOCATED: 0.8 * 0.25})


def test_memory_weighs_use_only_where_no_process_reports_sm():
    """NVML gives no per-process SM samples on some GPUs and drivers; the GPU's activity is then
    split by the processes' memory, the one per-process measure left."""
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("a", "pa", None, mem=30 << 30), proc("b", "pb", None, pid=2, mem=10 << 30)],
        shared_replicas=2,
        gpu_util_ratio=0.8,
    )
    assert bills(s) == pytest.approx({"a": 6.0 + 1.0, "b": 2.0 + 1.0})


def test_a_pod_that_uses_a_gpu_it_does_not_hold_pays_its_use():
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("c", "pc", 0.5)],
        shared_replicas=2,
        gpu_util_ratio=0.5,
    )
    assert bills(s) == pytest.approx({"a": 2.5, "b": 2.5, "c": 5.0})


def test_sm_over_one_is_scaled_to_the_whole_gpu():
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("a", "pa", 0.9), proc("b", "pb", 0.6, pid=2)],
        shared_replicas=2,
        gpu_util_ratio=1.0,
    )
    assert bills(s) == pytest.approx({"a": 6.0, "b": 4.0})


def test_dra_shared_device_splits_idle_by_holder():
    dra = "gpu.nvidia.com"
    s = sample([alloc("a", "pa", None, dra), alloc("b", "pb", None, dra)], [proc("a", "pa", 0.2)])
    assert bills(s) == pytest.approx({"a": 2.0 + 4.0, "b": 4.0})


def test_shared_used_and_idle_add_up_to_each_bill_and_energy_follows_time():
    s = sample(
        [alloc("a", "pa", 0), alloc("b", "pb", 1)],
        [proc("a", "pa", 0.6)],
        shared_replicas=4,
        gpu_util_ratio=0.6,
        power_w=400.0,
    )
    res = account(s, None, 1, CFG)
    by = {c.namespace: c for c in res.contributions}
    assert by["a"].used_s == pytest.approx(6.0) and by["a"].idle_s == pytest.approx(1.0)
    assert by["b"].used_s == 0.0 and by["b"].idle_s == pytest.approx(1.0)
    for c in res.contributions:
        assert c.used_s + c.idle_s == pytest.approx(c.allocated_s)
        assert c.shared_s == c.allocated_s
        assert c.energy_j == pytest.approx(4000.0 * c.allocated_s / 10.0)


def test_an_exclusive_gpu_is_the_holders_whoever_runs_on_it():
    s = sample([alloc("a", "pa", None)], [proc("c", "pc", 0.5)], gpu_util_ratio=0.5)
    assert bills(s) == {"a": 10.0}


# -- MIG energy ---------------------------------------------------------------------------------------
MIG = {"mig_uuid": "MIG-1", "gpu_instance_id": 1, "compute_instance_id": 0, "profile": "3g.71gb"}


def test_a_mig_slice_pays_its_fraction_of_the_parent_energy():
    s = sample(
        [alloc("a", "pa", None, "nvidia.com/mig-3g.71gb")],
        timestamp_ms=T0 + 10_000,
        mig={**MIG, "slice_fraction": 3 / 7},
        mig_parent_energy_mj=7_000_000,
    )
    (c,) = account(s, ReferenceSample(T0, 0, 0), 1, CFG).contributions
    assert c.namespace == "a"
    assert c.energy_j == pytest.approx(3000.0)
    assert c.energy_estimated_j == 0.0


def test_the_mig_parent_keeps_only_the_energy_of_capacity_no_slice_covers():
    parent = sample(
        [],
        timestamp_ms=T0 + 10_000,
        mig_enabled=True,
        mig_configured_fraction=6 / 7,
        mig_energy_by_slice=True,
        total_energy_mj=7_000_000,
        power_w=700.0,
    )
    res = account(parent, ReferenceSample(T0, 0, 0), 1, CFG)
    by = {c.namespace: c for c in res.contributions}
    assert MIG_SHARED not in by
    assert by[UNALLOCATED].energy_j == pytest.approx(1000.0)
    assert by[UNALLOCATED].allocated_s == pytest.approx(10 / 7)


# -- the documented example ----------------------------------------------------------------------------
def _example_table() -> dict[str, float]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Shared GPUs\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|", section, re.M)
    assert rows, "the worked example's table is missing"
    return {ns: float(total) for ns, _, _, total in rows}


def example_sample(ts_ms: int = T0) -> dict:
    """One 60 s sample of a 4-replica time-sliced H200: train holds 2 replicas and runs at 50 % SM,
    notebook holds 1 and runs at 10 %, an unplaced process adds 10 %, one replica is free."""
    return sample(
        [alloc("train", "t", 0), alloc("train", "t", 1), alloc("notebook", "nb", 2)],
        [proc("train", "t", 0.5), proc("notebook", "nb", 0.1, pid=2), proc(None, None, 0.1, pid=3)],
        timestamp_ms=ts_ms,
        shared_replicas=4,
        gpu_util_ratio=0.7,
        interval_ms=60_000,
    )


def test_the_readme_worked_example():
    got = {ns: round(v, 3) for ns, v in bills(example_sample()).items()}
    assert got == _example_table()
    assert sum(got.values()) == pytest.approx(60.0)


def test_the_focus_export_allocates_the_gpu_as_the_example_bills_it():
    """An hour of the example through the window engine and the FOCUS export: each namespace's row
    is an allocated charge of the GPU's origin charge, with the example's ratio of it."""
    prices = parse_price_table(
        {"currency": "USD", "energy_per_kwh": 0.1, "models": [{"match": "NVIDIA H200", "per_gpu_hour": 4.0}]}
    )
    hour = 3_600_000
    engine = WindowEngine(hour, 300_000, prices, "test")
    for k in range(60):
        engine.add(example_sample(T0 + k * 60_000), 0, k, T0 + k * 60_000)
    records = engine.flush_all()
    rows = build_report(records, billing_lag_ms=86_400_000)
    lines = list(csv.DictReader(io.StringIO(render_report(rows, "focus", focus=FocusOptions()))))
    gpu = {ln["x_Namespace"]: ln for ln in lines if ln["ConsumedUnit"] == "GPU-Hours"}
    ratios = {
        ns: json.loads(ln["AllocatedMethodDetails"])["Elements"][0]["AllocatedRatio"]
        for ns, ln in gpu.items()
    }
    assert ratios == pytest.approx({ns: v / 60.0 for ns, v in _example_table().items()}, abs=1e-6)
    assert {ln["AllocatedMethodId"] for ln in gpu.values()} == {"gpupipe-gpu-time"}
    assert len({ln["ResourceId"] for ln in gpu.values()}) == 1  # one origin: the GPUs of the node
