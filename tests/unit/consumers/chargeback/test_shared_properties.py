"""Properties of the shared-GPU rules, over random holders, replicas, processes and slices.

Whatever the mix, the parts of one sample add up to the GPU's whole time and energy, no part is
negative, and no holder whose processes measurably used the GPU pays nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupipe_consumers.chargeback.accounting import AccountingConfig, ReferenceSample, account
from tests.synthetic_fleet import blank_sample

CFG = AccountingConfig()
T0 = 1_767_225_600_000
DT_MS = 10_000
REL = 1e-9

ratio = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def shared_sample(draw: st.DrawFn) -> dict:
    pods = [(f"ns{i % 3}", f"pod{i}") for i in range(draw(st.integers(1, 5)))]
    allocations, replica = [], 0
    for ns, pod in pods:
        with_ids = draw(st.booleans())
        for _ in range(draw(st.integers(1, 3)) if with_ids else 1):
            allocations.append(
                {
                    "namespace": ns,
                    "pod": pod,
                    "container": "main",
                    "resource_name": "nvidia.com/gpu",
                    "replica": replica if with_ids else None,
                }
            )
            replica += 1
    owners = st.sampled_from([*pods, (None, None), ("other", "intruder")])
    processes = []
    for pid in range(draw(st.integers(0, 6))):
        ns, pod = draw(owners)
        processes.append(
            {
                "pid": pid,
                "process_name": "p",
                "used_memory_bytes": draw(st.none() | st.integers(0, 80 << 30)),
                "sm_util_ratio": draw(st.none() | ratio),
                "mem_util_ratio": None,
                "namespace": ns,
                "pod": pod,
                "container": None,
            }
        )
    return blank_sample(
        timestamp_ms=T0 + DT_MS,
        hostname="n1",
        gpu_index=0,
        uuid="GPU-p",
        pci_bus_id="0:1",
        model_name="NVIDIA H200",
        interval_ms=DT_MS,
        allocations=allocations,
        processes=processes,
        shared_replicas=draw(st.none() | st.integers(1, 12)),
        gpu_util_ratio=draw(st.none() | ratio),
        total_energy_mj=draw(st.integers(0, 3_000 * DT_MS)),
        power_w=300.0,
    )


def _used_by(sample: dict) -> set[tuple[str, str]]:
    """Holders whose own processes report SM use (or, with no SM anywhere, memory on a busy GPU)."""
    holders = {(a["namespace"], a["pod"]) for a in sample["allocations"]}
    procs = sample["processes"]
    field = "sm_util_ratio" if any((p["sm_util_ratio"] or 0) > 0 for p in procs) else None
    if field is None and sample["gpu_util_ratio"]:
        field = "used_memory_bytes"
    if field is None:
        return set()
    return {(p["namespace"], p["pod"]) for p in procs if (p[field] or 0) > 0} & holders


@settings(max_examples=400, deadline=None, database=None)
@given(shared_sample())
def test_the_parts_add_up_to_the_whole_and_users_pay(s: dict) -> None:
    res = account(s, ReferenceSample(T0, 0, 0), 1, CFG)
    parts = res.contributions
    assert sum(c.allocated_s for c in parts) == pytest.approx(DT_MS / 1000, rel=REL)
    assert sum(c.energy_j for c in parts) == pytest.approx(s["total_energy_mj"] / 1000, rel=REL, abs=1e-12)
    for c in parts:
        assert c.allocated_s >= 0 and c.energy_j >= 0 and c.used_s >= 0 and c.idle_s >= -1e-12
    billed: dict[tuple[str, str | None], float] = {}
    for c in parts:
        billed[(c.namespace, c.pod)] = billed.get((c.namespace, c.pod), 0.0) + c.allocated_s
    for holder in _used_by(s):
        assert billed.get(holder, 0.0) > 0, holder


@st.composite
def mig_gpu(draw: st.DrawFn) -> tuple[list[float], list[bool], int, int]:
    sevenths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=7).filter(lambda xs: sum(xs) <= 7))
    held = draw(st.lists(st.booleans(), min_size=len(sevenths), max_size=len(sevenths)))
    before = draw(st.integers(0, 10**12))
    delta = draw(st.integers(0, 3_000 * DT_MS))
    return [n / 7 for n in sevenths], held, before, before + delta


@settings(max_examples=300, deadline=None, database=None)
@given(mig_gpu())
def test_a_mig_gpus_energy_is_billed_whole_across_its_slices(gpu) -> None:
    fractions, held, before, after = gpu
    common = dict(hostname="n1", gpu_index=0, uuid="GPU-m", pci_bus_id="0:1", model_name="NVIDIA H200")
    common["interval_ms"] = DT_MS
    parent = blank_sample(
        timestamp_ms=T0 + DT_MS,
        mig_enabled=True,
        mig_configured_fraction=sum(fractions),
        mig_energy_by_slice=True,
        total_energy_mj=after,
        **common,
    )
    records = [(parent, ReferenceSample(T0, before, 0))]
    for i, (fraction, is_held) in enumerate(zip(fractions, held, strict=True)):
        mig = {"mig_uuid": f"MIG-{i}", "gpu_instance_id": i, "compute_instance_id": 0, "profile": "x"}
        holder = {"namespace": f"t{i}", "pod": "p", "container": "c", "resource_name": "r", "replica": None}
        s = blank_sample(
            timestamp_ms=T0 + DT_MS,
            mig={**mig, "slice_fraction": fraction},
            mig_parent_energy_mj=after,
            allocations=[holder] if is_held else [],
            **common,
        )
        records.append((s, ReferenceSample(T0, before, 0)))
    parts = [c for s, ref in records for c in account(s, ref, 1, CFG).contributions]
    assert sum(c.energy_j for c in parts) == pytest.approx((after - before) / 1000, rel=REL, abs=1e-12)
    assert sum(c.allocated_s for c in parts) == pytest.approx(DT_MS / 1000, rel=REL)
    for c in parts:
        if c.namespace.startswith("t"):
            assert c.energy_j == pytest.approx((after - before) / 1000 * fractions[int(c.namespace[1:])])
