"""MIG capacity that no slice covers (e.g. 1/7 left unconfigured) is billed as
``__unallocated__``, so namespaces plus ``__unallocated__`` reconcile with physical GPU-hours."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupipe_consumers.chargeback.accounting import AccountingConfig, account
from gpupipe_schemas.meaning import MIG_SHARED, UNALLOCATED, gpu_key
from tests.agent_harness import UUIDS, node_for_fixtures, running_agent
from tests.unit.producer.agent.test_node_agent import config, memory_publisher


def test_the_unconfigured_seventh_of_a_mig_gpu_is_billed_unallocated(tmp_path: Path) -> None:
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path, kubelet_socket=None), pub, node_for_fixtures()) as ra:
        ra.ticks_after(2)
        ra.stop()
    samples = mem.records("samples")
    parent = [s for s in samples if s["uuid"] == UUIDS[7] and not s["mig"]][-1]
    slices = [s for s in samples if s["mig"] and s["timestamp_ms"] == parent["timestamp_ms"]]
    assert len(slices) == 4  # 3g + 3 x 1g: 6 of 7 sevenths configured
    covered = sum(s["mig"]["slice_fraction"] for s in slices)
    assert parent["mig_configured_fraction"] == pytest.approx(covered) == pytest.approx(6 / 7)
    assert all(s["mig_configured_fraction"] is None for s in samples if s["uuid"] != UUIDS[7])

    cfg = AccountingConfig()
    dt_s = cfg.default_interval_ms / 1000 if not parent["interval_ms"] else parent["interval_ms"] / 1000
    res = account(parent, None, 0, cfg)
    by_ns = {c.namespace: c for c in res.contributions}
    # The slices carry the GPU's energy counter, so they bill its energy: none left to __mig_shared__.
    assert parent["mig_energy_by_slice"] is True
    assert all(s["mig_parent_energy_mj"] == parent["total_energy_mj"] for s in slices)
    assert set(by_ns) == {UNALLOCATED}
    assert by_ns[UNALLOCATED].allocated_s == pytest.approx(dt_s / 7)
    assert by_ns[UNALLOCATED].mig_s == pytest.approx(dt_s / 7)
    # Reconciliation with the physical GPU: slices + the uncovered rest = one GPU for the interval.
    slice_s = sum(account(s, None, 0, cfg).observed_gpu_s for s in slices)
    assert slice_s + res.observed_gpu_s == pytest.approx(dt_s)


def test_an_unknown_configuration_bills_nothing_more() -> None:
    parent = {
        "timestamp_ms": 1,
        "hostname": "n",
        "uuid": "GPU-x",
        "model_name": "NVIDIA H200",
        "mig": None,
        "mig_enabled": True,
        "interval_ms": 10_000,
        "power_w": 100.0,
        "mig_configured_fraction": None,
    }
    res = account(parent, None, 0, AccountingConfig())
    assert [c.namespace for c in res.contributions] == [MIG_SHARED] and res.observed_gpu_s == 0.0


def test_the_slices_and_the_parent_bill_the_gpus_energy_exactly(tmp_path: Path) -> None:
    """The agent's records of a MIG GPU over two polls: the slices' fractions of the parent's counter
    delta plus the parent's uncovered share add up to that delta, each key on its own timeline."""
    pub, mem = memory_publisher()
    nvml = node_for_fixtures()
    with running_agent(config(tmp_path, kubelet_socket=None), pub, nvml) as ra:
        ra.ticks_after(1)
        nvml.gpus[7].energy_mj += 50_000  # 50 J between the first poll and the last
        ra.ticks_after(2)
        ra.stop()
    samples = [s for s in mem.records("samples") if s["uuid"] == UUIDS[7]]
    first_ts, last_ts = min(s["timestamp_ms"] for s in samples), max(s["timestamp_ms"] for s in samples)
    cfg, refs = AccountingConfig(), {}
    for s in samples:
        if s["timestamp_ms"] == first_ts:
            refs[gpu_key(s)] = account(s, None, 0, cfg).new_ref
    billed_j = 0.0
    for s in samples:
        if s["timestamp_ms"] == last_ts:
            billed_j += sum(c.energy_j for c in account(s, refs[gpu_key(s)], 1, cfg).contributions)
    (before,) = (s["total_energy_mj"] for s in samples if s["timestamp_ms"] == first_ts and not s["mig"])
    (after,) = (s["total_energy_mj"] for s in samples if s["timestamp_ms"] == last_ts and not s["mig"])
    assert after > before
    assert billed_j == pytest.approx((after - before) / 1000.0, rel=1e-9)
