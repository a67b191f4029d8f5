"""The alerts service's bound on nodes and devices: a flood of forged names cannot grow it without end."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from gpupipe_consumers.alerts.admission import DeviceAdmission, device_of
from gpupipe_consumers.alerts.dedupe import EngineConfig
from gpupipe_consumers.alerts.service import AlertsService, ListSink
from tests.unit.consumers.alerts.test_service import T0, Clock, inrec, xid


def test_admission_caps_nodes_and_devices_and_counts_refusals() -> None:
    adm = DeviceAdmission(max_nodes=2, max_devices=3)
    assert adm.admit("a", "0000:18:00.0") is None
    assert adm.admit("a", "0000:18:00.0") is None  # known: no second slot
    assert adm.admit("b", "0000:18:00.0") is None
    assert adm.admit("c", "0000:18:00.0") == "capped_node"
    assert adm.admit("a", "0000:28:00.0") is None
    assert adm.admit("b", "0000:28:00.0") == "capped_device"
    assert adm.admit("a", None) is None and adm.admit(None, "x") is None  # the engine judges those
    assert (adm.nodes(), adm.devices(), adm.full()) == (2, 3, True)
    assert adm.refused == {"capped_node": 1, "capped_device": 1}
    assert adm.admit("a", "0000:18:00.0") is None  # what is known keeps flowing at the cap


def test_a_node_refused_for_its_device_is_not_kept() -> None:
    adm = DeviceAdmission(max_nodes=5, max_devices=1)
    adm.admit("a", "d1")
    assert adm.admit("b", "d2") == "capped_device"
    assert adm.nodes() == 1  # b holds no slot it could not use


def test_device_is_keyed_as_the_engine_keys_alerts() -> None:
    kernel = {"pci_bus_id": "PCI:0000:3b:00", "uuid": None}
    nvml = {"pci_bus_id": "00000000:3B:00.0", "uuid": "GPU-1"}
    assert device_of(kernel) == device_of(nvml) == "0000:3b:00.0"
    assert device_of({"pci_bus_id": None, "uuid": "GPU-2"}) == "GPU-2"
    assert device_of({}) is None


def _service(adm: DeviceAdmission) -> tuple[AlertsService, ListSink, CollectorRegistry]:
    sink, reg = ListSink(), CollectorRegistry()
    svc = AlertsService(
        sink=sink,
        registry=reg,
        clock=Clock(),
        instance="t",
        engine_config=EngineConfig(update_interval_ms=0),
        admission=adm,
    )
    return svc, sink, reg


def _forged(n: int) -> list[Any]:
    return [inrec("XidEvent", xid(79, f"forged-{i}", host=f"forged-{i}.example", ts=T0)) for i in range(n)]


def test_a_flood_of_forged_hosts_stays_within_the_caps() -> None:
    svc, sink, reg = _service(DeviceAdmission(max_nodes=50, max_devices=1000))
    svc.handle([inrec("XidEvent", xid(79, "real-1", host="node-real"))])
    rejected = svc.handle(_forged(5000))
    assert rejected == []  # refused, not dead-lettered: the records are well formed
    open_hosts = {a.hostname for a in svc.engine.open_alerts()}
    assert len(open_hosts) <= 50 and "node-real" in open_hosts
    assert svc.admission.refused["capped_node"] == 5000 - 49
    assert len(svc.health) <= 50
    # the real node keeps its alerts at the cap: a second fault of it still raises one
    svc.handle([inrec("XidEvent", xid(48, "real-2", host="node-real", bus="0000:28:00"))])
    assert any(r["hostname"] == "node-real" and r["xid_codes"][:1] == [48] for r in sink.records)
    text = generate_latest(reg).decode()
    assert 'gpupipe_alerts_input_total{result="capped_node"} 4951.0' in text
    assert 'gpupipe_alerts_known{kind="node",of="known"} 50.0' in text
    assert 'gpupipe_alerts_known{kind="node",of="cap"} 50.0' in text


def test_samples_of_forged_uuids_are_bounded_too() -> None:
    svc, _, _ = _service(DeviceAdmission(max_nodes=10, max_devices=20))
    samples = [
        inrec(
            "GpuSample",
            {"hostname": "node-a", "uuid": f"GPU-{i}", "pci_bus_id": None, "timestamp_ms": T0 + i},
        )
        for i in range(500)
    ]
    svc.handle(samples)
    assert len(svc.health) <= 20
    assert svc.admission.refused["capped_device"] == 480


def test_restored_open_alerts_keep_their_devices_first() -> None:
    first, sink, _ = _service(DeviceAdmission(max_nodes=1, max_devices=1))
    first.handle([inrec("XidEvent", xid(79, "e1", host="node-a"))])
    again, _, _ = _service(DeviceAdmission(max_nodes=1, max_devices=1))
    again.restore(sink.records)
    again.handle(_forged(10))  # a flood that arrives before the node's next record
    assert again.admission.admit("node-a", "0000:18:00.0") is None
    assert {a.hostname for a in again.engine.open_alerts()} == {"node-a"}


def _codes(n: int, host: str = "node-a") -> list[Any]:
    """One admitted GPU reporting ``n`` distinct Xid codes: one open alert each, without a cap."""
    return [inrec("XidEvent", xid(1000 + i, f"code-{host}-{i}", host=host, ts=T0)) for i in range(n)]


def _capped_service(max_open: int) -> tuple[AlertsService, ListSink, CollectorRegistry]:
    sink, reg = ListSink(), CollectorRegistry()
    svc = AlertsService(
        sink=sink,
        registry=reg,
        clock=Clock(),
        instance="t",
        engine_config=EngineConfig(update_interval_ms=0, max_open_alerts=max_open),
        admission=DeviceAdmission(),
    )
    return svc, sink, reg


def test_a_flood_of_distinct_codes_on_one_gpu_stays_within_the_open_alert_cap() -> None:
    svc, sink, reg = _capped_service(100)
    rejected = svc.handle(_codes(3000))
    assert rejected == []  # refused, not dead-lettered: the records are well formed
    assert len(svc.engine.open_alerts()) == 100
    assert svc.engine.counts["capped_alert"] == 2900
    assert len({r["alert_id"] for r in sink.records}) == 100  # nothing published for the refused
    text = generate_latest(reg).decode()
    assert 'gpupipe_alerts_input_total{result="capped_alert"} 2900.0' in text
    assert 'gpupipe_alerts_known{kind="alert",of="known"} 100.0' in text
    assert 'gpupipe_alerts_known{kind="alert",of="cap"} 100.0' in text
    # an open alert keeps folding at the cap, and one that ends frees its slot
    before = svc.engine.counts["folded"]
    svc.handle([inrec("XidEvent", xid(1000, "code-again", ts=T0 + 1))])
    assert svc.engine.counts["folded"] == before + 1


def test_the_cap_warns_once_a_minute(caplog: Any) -> None:
    svc, _, _ = _capped_service(5)
    with caplog.at_level("WARNING", logger="gpupipe.alerts"):
        svc.handle(_codes(50))
        svc.handle(_codes(50, host="node-b"))
    lines = [r for r in caplog.records if "open alerts" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_resolved_alerts_kept_for_reopening_are_bounded_too() -> None:
    cfg = EngineConfig(update_interval_ms=0, max_open_alerts=10, resolve_after_ms=60_000)
    svc = AlertsService(sink=ListSink(), clock=(clock := Clock()), engine_config=cfg)
    for round_ in range(5):
        svc.handle(
            [
                inrec("XidEvent", xid(13, f"r{round_}-{i}", host=f"n{round_}-{i}", ts=clock.ms))
                for i in range(10)
            ]
        )
        clock.ms += 120_000  # quiet: resolved, a tombstone kept within the dedupe window
        svc.tick()
    assert len(svc.engine.table._closed) <= 10
