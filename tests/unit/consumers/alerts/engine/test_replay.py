"""A restart replays input the published alerts counted already (outage drill finding).

The alerts service commits its input offsets after publishing (at least once). In the 30 s outage
drill the group coordinator was away for 45 s after the broker came back: the consumer kept reading
and publishing, nothing was committed, and the restarted instance replayed a minute of XIDs on top
of the restored counts (every GPU's occurrences over-counted) and replayed old samples that
"cleared" restored level-signal alerts, which the next samples raised again under the same id from
sequence 1: two different records with the same (alert_id, sequence).
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import SignalEvent
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.unit.consumers.alerts.engine.test_dedupe import ident
from tests.unit.consumers.alerts.test_handler import T0, service, xid


def at(offset: int, value: dict[str, Any], partition: int = 0) -> InRecord:
    return InRecord("gpu.xid.v1", partition, offset, None, "XidEvent", value, T0)


def sample(offset: int, ts: int, pending: bool) -> InRecord:
    value = {
        "timestamp_ms": ts,
        "hostname": "node-a",
        "pci_bus_id": "0000:18:00",
        "row_remap_pending": pending,
    }
    return InRecord("gpu.samples.v1", 0, offset, None, "GpuSample", value, ts)


def latest(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["status"] != "action" and r["sequence"] >= out.get(r["alert_id"], {"sequence": -1})["sequence"]:
            out[r["alert_id"]] = r
    return out


def test_xids_replayed_after_a_restart_are_not_counted_twice() -> None:
    svc, sink, _ = service()
    events = [xid(79, f"e{i}", ts=T0 + i * 1000) for i in range(7)]
    svc.handle([at(i, events[i]) for i in range(5)])  # published: 5 occurrences, nothing committed
    (first,) = latest(sink.records).values()
    assert first["occurrences"] == 5 and (first["last_event_partition"], first["last_event_offset"]) == (0, 4)

    svc2, sink2, clock2 = service()
    clock2.ms = T0 + 60_000
    assert svc2.restore(sink.records) == 1
    # the group resumes at its last commit (offset 1 here): 1..4 again, then 5 and 6 are new
    svc2.handle([at(i, events[i]) for i in range(1, 7)])
    (last,) = latest(sink.records + sink2.records).values()
    assert last["occurrences"] == 7, last["occurrences"]  # was 5 + 4 replayed + 2 = 11
    assert (last["last_event_partition"], last["last_event_offset"]) == (0, 6)
    assert last["sequence"] == first["sequence"] + 1
    counts = svc2.engine.counts  # the last counted one's id is remembered too
    assert (counts["replayed"], counts["duplicate_event_id"]) == (3, 1)


def test_a_replayed_xid_of_an_acknowledged_alert_raises_nothing() -> None:
    """An alert ended since (an operator's ack) is not raised again by its own replayed input."""
    svc, sink, _ = service()
    svc.handle([at(i, xid(79, f"e{i}", ts=T0 + i * 1000)) for i in range(3)])
    aid = sink.records[-1]["alert_id"]
    svc.engine.acknowledge(aid, T0 + 5000, "reseated")
    svc.handle([])
    assert sink.records[-1]["status"] == "resolved"

    svc2, sink2, _ = service()
    svc2.restore(sink.records)
    svc2.handle([at(i, xid(79, f"e{i}", ts=T0 + i * 1000)) for i in range(3)])
    assert sink2.records == [] and svc2.engine.open_alerts() == []


def test_a_position_in_another_partition_is_new_input() -> None:
    """Positions compare only within one partition (a topic given more partitions moves keys)."""
    e = EngineFacade(EngineConfig(update_interval_ms=0))
    e.on_xid(xid(79, "e0"), T0, (0, 10))
    rec = e.take(T0)
    fresh = EngineFacade(EngineConfig(update_interval_ms=0))
    from gpupipe_consumers.alerts.engine.alert_record import to_record

    fresh.restore([to_record(a, T0) for a in rec], T0)
    assert fresh.on_xid(xid(79, "e1", ts=T0 + 1), T0, (1, 3)) is not None
    assert fresh.open_alerts()[0].occurrences == 2


def test_replayed_samples_do_not_clear_and_reraise_a_restored_signal() -> None:
    svc, sink, _ = service()
    svc.handle([sample(0, T0 - 2000, False), sample(1, T0, True), sample(2, T0 + 1000, True)])
    (first,) = latest(sink.records).values()
    assert first["alertname"] == "GpuRowRemapPending" and first["status"] == "firing"

    svc2, sink2, clock2 = service()
    clock2.ms = T0 + 60_000
    svc2.restore(sink.records)
    # replayed from an old commit: the sample before the condition, then the condition again
    svc2.handle([sample(0, T0 - 2000, False), sample(1, T0, True), sample(2, T0 + 1000, True)])
    svc2.handle([sample(3, T0 + 2000, True)])
    both = sink.records + sink2.records
    keys = [(r["alert_id"], r["sequence"]) for r in both]
    assert len(keys) == len(set(keys)), keys  # no (alert_id, sequence) published twice
    assert [r["status"] for r in sink2.records] == ["firing"] * len(sink2.records)
    svc2.handle([sample(4, T0 + 3000, False)])  # a real clear, after the latest sighting
    assert sink2.records[-1]["status"] == "resolved" and sink2.records[-1]["resolve_reason"] == "cleared"


def test_an_id_raised_again_continues_its_sequence() -> None:
    """A level signal cleared and raised again from the same start within one publishing round:
    the resolved revision is not lost and the new incident does not restart at sequence 1."""
    e = EngineFacade(EngineConfig(update_interval_ms=0))
    e.on_signal(ident(), SignalEvent("row_remap_pending", "active", T0, since_ms=T0), T0)
    (one,) = e.take(T0)
    e.on_signal(ident(), SignalEvent("row_remap_pending", "clear", T0 + 5000), T0 + 5000)
    e.on_signal(ident(), SignalEvent("row_remap_pending", "active", T0 + 6000, since_ms=T0), T0 + 6000)
    out = e.take(T0 + 6000)
    assert [(a.alert_id, a.sequence, a.status) for a in out] == [
        (one.alert_id, 2, "resolved"),
        (one.alert_id, 3, "firing"),
    ]
