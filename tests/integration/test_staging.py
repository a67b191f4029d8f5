"""Staging in a box, short: the deployed system as real processes lives through real faults.

The harness (tests/staging.py, shared with bench/bench_staging.py) starts 3 brokers, 2 node agents
with their relays and kubelet doubles, 2 metrics replicas, 2 chargeback instances, the alerts HA pair,
a real Alertmanager and a real Prometheus. The drill: an Xid 79; the samples partition leader, a
metrics replica and the leading alerts instance SIGKILLed at once; an Xid 13 while they are down;
all restarted. The audit must find every fault paged exactly once, only the faulty node cordoned,
every GPU in Prometheus and every sample charged once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.staging import Staging, short_drill

pytestmark = pytest.mark.integration


def test_the_system_lives_through_a_leader_a_replica_and_the_alerts_leader_killed(tmp_path: Path) -> None:
    s = Staging(tmp_path / "staging").start()
    try:
        fig = short_drill(s)
        audit = s.audit(90)
    finally:
        s.close()
    print(f"staging: start {s.timings['start_s']:.1f}s, drill {fig}, audit {audit}")  # shown with -s
    assert audit.violations == [], audit
    assert audit.paged_once == audit.faults == 2
    assert audit.cordoned == ["gpu-node-0"]
    assert audit.gpus_in_prometheus == audit.gpus_expected == 4
    assert audit.chargeback_windows >= 1 and audit.samples_miscounted == 0
