"""MIG capacity that no slice covers (e.g. 1/7 left unconfigured) is billed as
``__unallocated__``, so namespaces plus ``__unallocated__`` reconcile with physical GPU-hours."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.chargeback.accounting import AccountingConfig, account
from schemas.meaning import MIG_SHARED, UNALLOCATED
from tests.agent_harness import UUIDS, node_for_fixtures, running_agent
from tests.unit.test_node_agent import config, memory_publisher


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
    assert set(by_ns) == {MIG_SHARED, UNALLOCATED}
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
