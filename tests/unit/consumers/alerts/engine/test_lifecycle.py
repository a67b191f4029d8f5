"""An alert's life across restarts, backlogs, node storms and escalations, as Alertmanager and the
cordoner see it.

* An open drain alert that has not changed for longer than ``--restore-lookback`` is restored after a
  restart, and its node stays cordoned (keep-alive revisions).
* A level alert whose condition holds publishes on change and keep-alive, not every update interval.
* A kernel-log backlog re-read without its cursor brings back week-old XIDs: history, never a drain.
* A node storm stays open while its sticky members fire, so Alertmanager neither sends RESOLVED for it
  nor pages the members it inhibited.
* An escalation keeps the incident's label set firing in Alertmanager (no false RESOLVED).

Scenarios after ``reference/repro/producer-alerts/`` (n_sticky_outlives_lookback.py, r_level_revisions.py,
n_old_backlog_xid_cordons.py, n_storm_repage_real_am.py, d8_escalation_churn.py), rebuilt here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe_consumers.alerts.am_shape import am_labels, gpu_alert_shape
from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.k8s_api_fake import FakeKubeApi
from tests.unit.consumers.alerts.engine.test_findings import (
    MIN,
    T0,
    S,
    _Clock,
    _cordon_service,
    _drain_event,
    records,
    xid,
)

HOUR = 60 * MIN
DAY = 24 * HOUR
LOOKBACK = DAY  # --restore-lookback default


def _within_lookback(recs: list[dict[str, Any]], now: int) -> list[dict[str, Any]]:
    """What AlertsService.activate hands to restore(): records emitted within the look-back."""
    return [r for r in recs if r["emitted_at_ms"] >= now - LOOKBACK]


def test_an_unchanged_drain_alert_older_than_the_lookback_survives_a_restart(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a", "node-b", "node-c", "node-d"], token="tok") as api:
        clock = _Clock(T0)
        svc1 = _cordon_service(api, tmp_path, clock, uncordon=True)
        _drain_event(svc1, "node-a", T0)  # Xid 79: the GPU fell off the bus, nobody resets it
        assert svc1.cordoner.process(svc1.cordoner._queue.get_nowait()).outcome == "cordoned"
        for h in range(1, 26):
            clock.ms = T0 + h * HOUR
            svc1.tick()
        topic = list(svc1.sink.records)
        read = _within_lookback(topic, clock.ms)
        svc2 = _cordon_service(api, tmp_path, clock, uncordon=True)
        assert svc2.restore(read, ledger=read) == 1  # was: 0, the only firing record was 25 h old
        while not svc2.cordoner._queue.empty():
            svc2.cordoner._run_one(svc2.cordoner._queue.get_nowait())
        assert api.node("node-a")["spec"].get("unschedulable") is True  # was: uncordoned
        (a,) = svc2.engine.open_alerts()
        assert a.status == "firing" and a.drain_node
        # a keep-alive is a revision like the others: its sequence goes on, a few per day
        alive = [r for r in topic if r["status"] == "firing"]
        assert [r["sequence"] for r in alive] == list(range(1, len(alive) + 1))
        assert 4 <= len(alive) <= 6


def test_the_keepalive_stays_under_half_the_restore_lookback() -> None:
    from gpupipe.commands import cli
    from gpupipe_consumers.alerts.command import options_from_args

    def engine(*flags: str) -> EngineConfig:
        args = cli.build_parser().parse_args(["alerts", *flags])
        return options_from_args(args).engine

    assert engine().keepalive_ms == 6 * HOUR
    assert engine("--restore-lookback", "4h").keepalive_ms == 2 * HOUR
    assert engine("--keepalive-interval", "1h").keepalive_ms == HOUR


def test_a_level_alert_publishes_on_change_and_keepalive_not_every_interval() -> None:
    clock, sink = _Clock(T0), ListSink()
    svc = AlertsHandler(sink=sink, registry=CollectorRegistry(), clock=clock)
    for i in range(2 * 60 * 2):  # 2 hours of samples every 30 s (the producer's slow group)
        clock.ms = T0 + i * 30 * S
        v = {
            "timestamp_ms": clock.ms,
            "hostname": "node-a",
            "pci_bus_id": "0000:18:00.0",
            "row_remap_pending": True,
        }
        svc.handle([InRecord("s", 0, clock.ms, None, "GpuSample", v, clock.ms)])
        svc.tick()
    assert [(r["status"], r["signal"]) for r in sink.records] == [("firing", "row_remap_pending")]  # was: 240
    for i in range(240, 240 + 6 * 60 * 2):  # 6 more hours: one keep-alive, at 6 h
        clock.ms = T0 + i * 30 * S
        v = {
            "timestamp_ms": clock.ms,
            "hostname": "node-a",
            "pci_bus_id": "0000:18:00.0",
            "row_remap_pending": True,
        }
        svc.handle([InRecord("s", 0, clock.ms, None, "GpuSample", v, clock.ms)])
        svc.tick()
    assert len(sink.records) == 2 and sink.records[1]["last_seen_ms"] > sink.records[0]["last_seen_ms"]
    v = {
        "timestamp_ms": clock.ms + 30 * S,
        "hostname": "node-a",
        "pci_bus_id": "0000:18:00.0",
        "row_remap_pending": False,
    }
    clock.ms += 30 * S
    svc.handle([InRecord("s", 0, clock.ms, None, "GpuSample", v, clock.ms)])
    assert [(r["status"], r["resolve_reason"]) for r in sink.records[2:]] == [("resolved", "cleared")]


def test_a_week_old_backlog_xid79_is_history_not_a_drain(tmp_path: Path) -> None:
    now = T0 + 30 * DAY
    with FakeKubeApi(["node-1", "node-2", "node-3"], token="tok") as api:
        clock = _Clock(now)
        svc = _cordon_service(api, tmp_path, clock)
        old = xid(79, now - 7 * DAY, host="node-1", msg="GPU has fallen off the bus.")
        svc.handle([InRecord("x", 0, now, None, "XidEvent", old, now)])
        assert [r for r in svc.sink.records if r["status"] == "firing"] == []  # was: critical, drain
        assert svc.cordoner._queue.empty() and svc.engine.open_alerts() == []
        assert svc.engine.counts["stale_event"] == 1
        assert not api.node("node-1")["spec"].get("unschedulable")
        # a fresh one on another node still drains it, and the old one is the GPU's history
        fresh = xid(79, now - 5 * MIN, host="node-2", msg="GPU has fallen off the bus.")
        svc.handle([InRecord("x", 0, now, None, "XidEvent", fresh, now)])
        (rec,) = [r for r in svc.sink.records if r["status"] == "firing"]
        assert rec["hostname"] == "node-2" and rec["drain_node"] and rec["severity"] == "critical"
        assert svc.cordoner.process(svc.cordoner._queue.get_nowait()).outcome == "cordoned"
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, now - 7 * DAY, msg="GPU has fallen off the bus."), now)
    assert len(e.histories.get("node-a", "0000:18:00.0").records()) == 1


def _storm(e: EngineFacade) -> list[dict[str, Any]]:
    for g in range(3):  # three GPUs fall off the bus together (a PCIe switch)
        e.on_xid(xid(79, T0 + g, g=g, msg="GPU has fallen off the bus."), T0 + g)
    return records(e, T0 + S)


def test_a_node_storm_stays_open_while_its_sticky_members_fire() -> None:
    e = EngineFacade(EngineConfig(dedupe_window_ms=10 * MIN, resolve_after_ms=30 * MIN))
    (storm,) = [r for r in _storm(e) if r["scope"] == "node"]
    e.tick(T0 + 10 * MIN + S)
    assert [r["status"] for r in records(e, T0 + 10 * MIN + S)] == []  # was: the storm resolved (quiet)
    e.tick(T0 + 5 * HOUR)
    assert "resolved" not in [r["status"] for r in records(e, T0 + 5 * HOUR)]
    # held open, it goes on absorbing the node's faults: whatever it inhibits, it lists
    e.on_xid(xid(79, T0 + 5 * HOUR, g=4, msg="GPU has fallen off the bus."), T0 + 5 * HOUR)
    out = records(e, T0 + 5 * HOUR)
    new = next(r for r in out if r["scope"] == "gpu" and r["gpu_index"] == 4)
    assert new["parent_alert_id"] == storm["alert_id"]
    node = next(a for a in e.open_alerts() if a.scope == "node")
    assert len(node.gpus) == 4
    # once its members are dealt with, it ends with them
    for a in [a for a in e.open_alerts() if a.scope == "gpu"]:
        e.acknowledge(a.alert_id, T0 + 6 * HOUR)
    e.tick(T0 + 6 * HOUR + S)
    out = records(e, T0 + 6 * HOUR + S)
    assert ("node", "resolved") in [(r["scope"], r["status"]) for r in out]
    assert e.open_alerts() == []


def test_an_escalating_storm_keeps_its_alertmanager_label_set_firing() -> None:
    clock = _Clock(T0)
    posts: list[tuple[int, list[dict[str, Any]]]] = []

    def post(url: str, body: bytes, timeout_s: float) -> int:
        posts.append((clock.ms, json.loads(body)))
        return 200

    sender = AlertmanagerSender("http://am", shape=gpu_alert_shape, post=post, clock=clock)
    e = EngineFacade(EngineConfig(update_interval_ms=0))
    for g in range(3):  # one 3-GPU job crashes: Xid 13 on each (an application burst, warning)
        e.on_xid(xid(13, T0 + g, g=g, pid=100 + g), T0 + g)
    first = [r for r in records(e, T0 + S) if r["scope"] == "node"]
    clock.ms = T0 + 2 * MIN
    e.on_xid(xid(79, T0 + 2 * MIN, g=5, msg="GPU has fallen off the bus."), T0 + 2 * MIN)  # absorbed
    later = [r for r in records(e, T0 + 2 * MIN) if r["scope"] == "node"]
    assert first[0]["alert_id"] == later[-1]["alert_id"]
    assert (later[-1]["severity"], later[-1]["cause_class"]) == ("critical", "bus")
    for r in first:
        sender.update(r)
    assert sender.step(T0 + S)
    for r in later:
        sender.update(r)
    assert sender.step(T0 + 2 * MIN)

    def ended(at: int, alerts: list[dict[str, Any]]) -> list[dict[str, str]]:
        from gpupipe.clients.alertmanager import iso_ms

        return [a["labels"] for a in alerts if a["endsAt"] <= iso_ms(at)]

    assert [x for at, body in posts for x in ended(at, body)] == []  # was: the warning set sent RESOLVED
    held = {tuple(sorted(e.labels.items())) for e in sender._entries.values() if not e.resolved}
    assert tuple(sorted(am_labels(first[0]).items())) in held  # the incident's first label set fires on
    assert tuple(sorted(am_labels(later[-1]).items())) in held  # and the escalated one is routed critical
    # resent while open, both resolved together when the incident ends
    assert {a["labels"]["severity"] for a in sender.due(T0 + 5 * MIN)[0:2] for a in [a[2]]} == {
        "warning",
        "critical",
    }
    end = e.get(("node", "node-a", "", "node_burst"))
    assert end is not None
    done = to_record(end, T0 + 3 * MIN)
    done.update(status="resolved", resolved_at_ms=T0 + 3 * MIN)
    clock.ms = T0 + 3 * MIN
    sender.update(done)
    assert sender.step(T0 + 3 * MIN)
    closed = ended(T0 + 3 * MIN, posts[-1][1])
    assert {x["severity"] for x in closed} == {"warning", "critical"} and len(sender) == 0
