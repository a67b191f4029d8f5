"""The engine on the producer's own simulated fleet: what real producers emit, not our synthetic data."""

from __future__ import annotations

from collections import Counter

import pytest

from gpupipe_consumers.chargeback.accounting import AccountingConfig, account
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.meaning import gpu_key
from tests.synthetic_fleet import partition_of

T0 = 1_795_000_000_000


def test_producer_fleet_conserves_gpu_seconds():
    cfg_fleet = FleetConfig(nodes=8, gpus_per_node=8, seed=3, interval_ms=10_000, mig_node_ratio=0.3)
    fleet = SimulatedFleet(cfg_fleet)
    eng = WindowEngine()
    cfg = AccountingConfig()
    offsets: Counter = Counter()
    refs: dict = {}
    observed = 0.0
    out = []
    for k in range(500):  # 83 minutes: one closed window, one flushed
        samples, _ = fleet.tick(T0 + k * 10_000)
        for s in samples:
            p = partition_of(gpu_key(s), 3)
            res = account(s, refs.get(gpu_key(s)), offsets[p], cfg)
            if res.new_ref is not None:
                refs[gpu_key(s)] = res.new_ref
            observed += res.observed_gpu_s
            eng.add(s, p, offsets[p])
            offsets[p] += 1
        out += eng.poll_closed()
    out += eng.flush_all()
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(observed, rel=1e-12)
    assert sum(r["mig_gpu_seconds"] for r in out) > 0
    assert sum(r["energy_joules"] for r in out) > 0
    assert {r["kind"] for r in out} == {"window"}
    assert "__unallocated__" in {r["namespace"] for r in out}
