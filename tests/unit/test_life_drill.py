"""Two simulated days of a 104-GPU cluster through the alerts service and its cordons (tests/life_drill.py):
faults from NVIDIA's catalog, recoveries, restarts and failovers, backlog re-reads, broker outages and
clock skew, held against the scenario's ground truth as Alertmanager and the Kubernetes API saw them."""

from __future__ import annotations

import logging
from pathlib import Path

from gpupipe.domain.pci import canonical
from tests.k8s_api_fake import FakeKubeApi
from tests.life_drill import Drill, DrillConfig, SimAlertmanager, _bus, check, generate


def test_the_scenario_is_pure_and_has_what_the_drill_needs() -> None:
    cfg = DrillConfig(seed=7, days=2, nodes=13)
    a, b = generate(cfg), generate(cfg)
    assert [d.value for d in a.deliveries] == [d.value for d in b.deliveries]
    assert a.hardware() and any(f.recovered_ms for f in a.hardware())
    assert a.ops and {o.kind for o in a.ops} == {"restart", "failover"}
    assert any(not d.original for d in a.deliveries)  # a backlog re-read without its cursor
    assert len(set(a.skews.values())) > 1


def test_a_gpu_off_the_bus_logs_no_xid_but_its_loss() -> None:
    # The driver cannot reach a GPU that fell off the bus (Xid 79): no job runs on it and no page of
    # its memory is retired, so no other XID of it is logged until the reboot brings it back.
    sc = generate(DrillConfig(seed=1, days=8, nodes=30))
    gone = [f for f in sc.hardware() if f.kind.code == 79]
    assert gone
    logged = []
    for f in gone:
        skew, bus = sc.skews[f.node], canonical(_bus(f.gpu, nvml=False))
        until = (f.recovered_ms if f.recovered_ms is not None else sc.end_ms) + skew
        logged += [
            (f.fid, ev["xid"])
            for ev in (d.value for d in sc.deliveries if d.name == "XidEvent" and d.original)
            if ev["hostname"] == f.node
            and ev["xid"] not in (None, 79)
            and canonical(ev["pci_bus_id"]) == bus
            and f.at_ms + skew < ev["timestamp_ms"] < until
        ]
    assert logged == []


def test_the_simulated_alertmanager_pages_once_per_label_set_and_expires() -> None:
    now = [0]
    am = SimAlertmanager(lambda: now[0])
    body = (
        b'[{"labels":{"a":"1"},"annotations":{},'
        b'"startsAt":"1970-01-01T00:00:00Z","endsAt":"1970-01-01T00:04:00Z"}]'
    )
    am.post("u", body, 1)
    now[0] = 60_000
    am.post("u", body, 1)  # a resend is no page
    now[0] = 300_000
    am.expire(now[0])  # nobody re-sent it: Alertmanager resolves it
    now[0] = 0
    am.post("u", body, 1)
    assert [e.kind for e in am.events] == ["page", "resolved", "page"]


def test_two_days_of_a_clusters_life(tmp_path: Path) -> None:
    logging.disable(logging.WARNING)
    try:
        sc = generate(DrillConfig(seed=1, days=2, nodes=13))
        with FakeKubeApi(sc.nodes, token="tok") as api:
            d = Drill(sc, api, tmp_path).run()
    finally:
        logging.disable(logging.NOTSET)
    v = check(d)
    assert v.hardware_faults >= 3 and v.restarts >= 8 and v.cordons >= 3 and v.xids >= 100
    assert d.rejected == []
    bad = v.violations()
    # An Xid 48 followed by its page retirement (63 or 64) is one fault: one page, not two.
    assert any(f.kind.code == 48 and f.kind.follow for f in sc.hardware())  # the case is drilled
    assert bad == dict.fromkeys(bad, 0)
