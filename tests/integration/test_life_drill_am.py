"""Two simulated days of a 104-GPU cluster, paged by a real Alertmanager (tests/life_drill_am.py).

The life drill of tests/unit/test_life_drill.py (the alerts service on an injected clock, its restarts and
failovers, recoveries, backlog re-reads, broker outages and clock skew), with every instance's alerts
posted to the Debian ``prometheus-alertmanager`` and its notifications recorded by a webhook receiver.
The invariants are held against what Alertmanager sent: every hardware fault paged once until its
recovery, no RESOLVED while its GPU is broken, no false or lost drain, no drained node uncordoned while
broken, no XID lost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests.k8s_api_fake import FakeKubeApi
from tests.life_drill import Drill, DrillConfig, check, generate
from tests.life_drill_am import alertmanager_leg

pytestmark = pytest.mark.integration


def test_two_days_of_a_clusters_life_as_a_real_alertmanager_pages_it(tmp_path: Path) -> None:
    sc = generate(DrillConfig(seed=1, days=2, nodes=13))
    with alertmanager_leg(tmp_path / "am") as leg:
        began = time.monotonic()
        logging.disable(logging.WARNING)
        try:
            with FakeKubeApi(sc.nodes, token="tok") as api:
                d = Drill(sc, api, tmp_path, make_sender=leg.sender, on_step=leg.on_step).run()
        finally:
            logging.disable(logging.NOTSET)
        ran_s = time.monotonic() - began
        assert d.inst is not None
        view = leg.settle(d.inst.sender)
    v = check(d, view)
    print(
        f"life drill, real Alertmanager: {v.hardware_faults} hardware faults, {v.pages} pages, "
        f"{v.paged_once} paged once, {v.cordons} cordons, {v.xids} XIDs, {v.restarts} restarts and "
        f"failovers, {len(v.stuck_after_recovery)} stuck after recovery, violations {v.violations()}, "
        f"drill {ran_s:.1f} s"
    )
    assert v.hardware_faults >= 3 and v.restarts >= 8 and v.cordons >= 3 and v.xids >= 100
    assert d.rejected == []
    assert v.violations() == dict.fromkeys(v.violations(), 0)
    assert v.paged_once == v.hardware_faults
