"""One page per fault: the alert names the service and the shipped Prometheus rules own, one alert per
recurring fault of one job, and a classifier history that a flood of one cause cannot empty of another.

Each test failed before the change it names (see the commit that added it).
"""

from __future__ import annotations

from consumers.alerts.classify import FaultEvent, GpuXidHistory
from consumers.alerts.dedupe import AlertEngine, EngineConfig
from tests.unit.test_alerts_review import MIN, T0, records, xid

# ----------------------------------------------------------------------- history bounded per cause


def test_a_flood_of_xid13_does_not_evict_the_xid79_a_recurrence_needs() -> None:
    """300 Xid 13 of a buggy job on the GPU between two Xid 79 (a reboot in between): the second
    Xid 79 is still graded a recurrence (hardware, contact support), as it is without the flood."""
    graded = {}
    for flood in (0, 300):
        e = AlertEngine(EngineConfig(update_interval_ms=0))
        e.on_xid(xid(79, T0, msg="GPU has fallen off the bus."), T0)
        aid = records(e, T0)[0]["alert_id"]
        e.acknowledge(aid, T0 + 30 * MIN, "rebooted")
        records(e, T0 + 30 * MIN)
        for i in range(flood):
            t = T0 + 40 * MIN + i * 100
            e.on_xid(xid(13, t, pid=1000 + i), t)
        records(e, T0 + 50 * MIN)
        t = T0 + 3 * 60 * MIN
        e.on_xid(xid(79, t, msg="GPU has fallen off the bus."), t)
        r = [x for x in records(e, t) if x["xid_codes"][:1] == [79]][-1]
        graded[flood] = (r["rule"], r["action"])
    assert graded[300] == graded[0] == ("xid79.recurring", "CONTACT_SUPPORT")


def test_history_bound_is_per_cause_and_still_bounds_each() -> None:
    h = GpuXidHistory(max_records=5)
    h.record(FaultEvent(kind="xid", ts_ms=T0, code=79))
    for i in range(20):
        h.record(FaultEvent(kind="xid", ts_ms=T0 + 1 + i, code=13, pid=i))
    codes = [r.code for r in h.records()]
    assert codes.count(79) == 1 and codes.count(13) == 5
    assert [r.pid for r in h.records() if r.code == 13] == [15, 16, 17, 18, 19]
