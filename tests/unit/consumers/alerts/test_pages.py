"""One page per fault: the alert names the service and the shipped Prometheus rules own, one alert per
recurring fault of one job, and a classifier history that a flood of one cause cannot empty of another.

Each test failed before the change it names (see the commit that added it).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

from gpupipe_consumers.alerts.engine.alert_record import ALERTNAMES
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import SIGNAL_INFO
from gpupipe_consumers.alerts.engine.nvml_notices import NOTICE_ALERTNAMES
from gpupipe_consumers.alerts.rules.classify import FaultEvent, GpuXidHistory
from tests.paths import REPO
from tests.unit.consumers.alerts.engine.test_findings import MIN, T0, records, xid

PROMETHEUS = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS / "gpupipe-alerts.rules.yml"  # what the demo and the chart load by default
FAULT_RULES = PROMETHEUS / "gpupipe-faults.rules.yml"  # only where gpupipe alerts does not run
DEMO = REPO / "scripts" / "demo.py"


def _rules(path: Path) -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "alert" in r]


# ------------------------------------------------------------------------------- one source of pages


def test_no_alert_name_is_produced_by_both_the_service_and_the_rules() -> None:
    assert {i.alertname for i in SIGNAL_INFO.values()} | set(NOTICE_ALERTNAMES.values()) <= ALERTNAMES
    assert {"GpuXidError", "GpuNodeXidStorm", "NvswitchSxidError"} <= ALERTNAMES
    for path in (RULES, FAULT_RULES):
        names = [r["alert"] for r in _rules(path)]
        assert len(names) == len(set(names)), path.name
        assert not set(names) & ALERTNAMES, f"{path.name}: {sorted(set(names) & ALERTNAMES)}"
    both = {r["alert"] for r in _rules(RULES)} & {r["alert"] for r in _rules(FAULT_RULES)}
    assert not both


def test_the_default_rules_page_no_fault_the_service_pages() -> None:
    """XIDs and the sampled health signals the service raises (ECC, row remap, recovery action,
    thermal throttling) are not in the rules the demo and the chart load by default."""
    owned = ("XID_ERRORS", "ECC_DBE_VOL", "ROW_REMAP_FAILURE", "ROW_REMAP_PENDING", "RECOVERY_ACTION")
    owned += ("CLOCKS_EVENT_REASONS",)
    for rule in _rules(RULES):
        assert not [f for f in owned if f in rule["expr"]], rule["alert"]
    fallback = " ".join(r["expr"] for r in _rules(FAULT_RULES))
    assert all(f in fallback for f in owned)  # the fallback still covers every one of them
    demo = DEMO.read_text()
    assert "gpupipe-alerts.rules.yml" in demo and "gpupipe-faults.rules.yml" not in demo


# ----------------------------------------------------------------------- history bounded per cause


def test_a_flood_of_xid13_does_not_evict_the_xid79_a_recurrence_needs() -> None:
    """300 Xid 13 of a buggy job on the GPU between two Xid 79 (a reboot in between): the second
    Xid 79 is still graded a recurrence (hardware, contact support), as it is without the flood."""
    graded = {}
    for flood in (0, 300):
        e = EngineFacade(EngineConfig(update_interval_ms=0))
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


# ------------------------------------------------------------------ a recurring fault is one alert


def _replay(e: EngineFacade, events: list[dict], until: int) -> list[dict]:
    """Feed ``events`` (sorted by time) as they happen, ticking and publishing every minute."""
    out: list[dict] = []
    pending = sorted(events, key=lambda ev: ev["timestamp_ms"])
    now = T0
    while now <= until:
        while pending and pending[0]["timestamp_ms"] <= now:
            ev = pending.pop(0)
            e.on_xid(ev, ev["timestamp_ms"])
        e.tick(now)
        out += records(e, now)
        now += MIN
    return out


def test_one_job_hitting_xid31_every_quarter_hour_is_one_alert() -> None:
    e = EngineFacade(EngineConfig())
    out = _replay(e, [xid(31, T0 + m * MIN, pid=7) for m in (0, 15, 30)], T0 + 40 * MIN)
    assert len({r["alert_id"] for r in out}) == 1
    assert [r["resolve_reason"] for r in out if r["status"] == "resolved"] == []
    assert out[-1]["occurrences"] == 3


def test_another_job_on_the_same_gpu_is_another_alert() -> None:
    e = EngineFacade(EngineConfig())
    out = _replay(e, [xid(31, T0, pod="a-0"), xid(31, T0 + 15 * MIN, pod="b-0")], T0 + 20 * MIN)
    assert len({r["alert_id"] for r in out}) == 2
    assert [r["resolve_reason"] for r in out if r["status"] == "resolved"] == ["superseded"]


def test_a_synthetic_fleet_makes_no_more_alerts_than_faulty_gpu_and_code_pairs() -> None:
    """4 nodes of 8 GPUs; each GPU's job hits one or two codes again and again, 11 to 25 minutes apart
    (past the dedupe window, within the quiet period), for three hours."""
    rng = random.Random(7)
    events = []
    pairs = set()
    for n in range(4):
        for g in range(8):
            for code in rng.sample([13, 31, 79, 94, 119, 74, 63], rng.choice((1, 2))):
                pairs.add((n, g, code))
                t = T0 + rng.randrange(0, 10 * MIN)
                while t < T0 + 3 * 60 * MIN:
                    events.append(xid(code, t, host=f"node-{n}", g=g, pod=f"job-{n}-{g}", pid=100 + g))
                    t += rng.randrange(11 * MIN, 25 * MIN)
    e = EngineFacade(EngineConfig())
    out = _replay(e, events, T0 + 3 * 60 * MIN)
    gpu_alerts = {r["alert_id"] for r in out if r["scope"] == "gpu"}
    assert 0 < len(gpu_alerts) <= len(pairs)
    assert not [r for r in out if r["resolve_reason"] == "superseded"]
