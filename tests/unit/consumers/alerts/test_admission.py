"""The alerts service's bound on nodes and devices: a flood of forged names cannot grow it without end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from gpupipe.domain.node_check import NodeCheck
from gpupipe.domain.node_identity import NodeSigner, NodeVerifier
from gpupipe_consumers.alerts.admission import DeviceAdmission, Evicted, device_of
from gpupipe_consumers.alerts.engine.facade import EngineConfig
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from tests.pki import Pki
from tests.unit.consumers.alerts.test_handler import T0, Clock, inrec, xid
from tests.unit.consumers.alerts.test_node_check import _signed

S = 1000


def test_at_the_node_cap_the_least_recently_seen_idle_node_goes() -> None:
    busy = {"b"}
    adm = DeviceAdmission(max_nodes=2, max_devices=100, node_busy=busy.__contains__)
    adm.admit("a", "0000:18:00.0")
    adm.admit("b", "0000:18:00.0")
    adm.admit("a", "0000:18:00.0")  # a seen again: b is now the least recently seen, but alerting
    adm.admit("c", "0000:18:00.0")
    assert adm.take_evicted() == [Evicted("a", None, False)]
    assert (adm.nodes(), adm.devices()) == (2, 2)
    adm.admit("a", None) or adm.admit(None, "x")  # the engine judges a record without host or device
    assert adm.counts["evicted_idle_node"] == 2  # c went for a


def test_when_every_node_alerts_state_grows_to_twice_the_cap_then_the_oldest_alerting_goes() -> None:
    adm = DeviceAdmission(max_nodes=4, max_devices=100, node_busy=lambda _h: True)
    for i in range(8):
        adm.admit(f"n{i}", "d")
    assert (adm.nodes(), adm.counts["over_cap"], adm.take_evicted()) == (8, 4, [])
    adm.admit("n8", "d")
    assert adm.take_evicted() == [Evicted("n0", None, True)]
    assert adm.nodes() == 8


def test_unverified_nodes_go_before_verified_ones() -> None:
    adm = DeviceAdmission(max_nodes=2, max_devices=100)
    adm.admit("signed", "d", verified=True)
    adm.admit("unsigned", "d")
    adm.admit("new", "d")
    assert adm.take_evicted() == [Evicted("unsigned", None, False)]


def test_one_node_holds_at_most_max_devices_per_node() -> None:
    busy = {("a", "d0")}
    adm = DeviceAdmission(max_devices_per_node=3, device_busy=lambda h, d: (h, d) in busy)
    for i in range(10):
        adm.admit("a", f"d{i}")
    assert adm.devices() == 3  # d0 (alerting) and the two most recent
    assert [e.device for e in adm.take_evicted()] == [f"d{i}" for i in range(1, 8)]


def test_device_is_keyed_as_the_engine_keys_alerts() -> None:
    kernel = {"pci_bus_id": "PCI:0000:3b:00", "uuid": None}
    nvml = {"pci_bus_id": "00000000:3B:00.0", "uuid": "GPU-1"}
    assert device_of(kernel) == device_of(nvml) == "0000:3b:00.0"
    assert device_of({"pci_bus_id": None, "uuid": "GPU-2"}) == "GPU-2"
    assert device_of({}) is None


def _service(adm: DeviceAdmission) -> tuple[AlertsHandler, ListSink, CollectorRegistry]:
    sink, reg = ListSink(), CollectorRegistry()
    svc = AlertsHandler(
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


def _xid_79_pages(svc: AlertsHandler, sink: ListSink, host: str) -> bool:
    svc.handle([inrec("XidEvent", xid(79, f"real-{host}", host=host, ts=T0))])
    return any(r["hostname"] == host and r["status"] == "firing" for r in sink.records)


def _forged_samples(n: int) -> list[Any]:
    return [
        inrec(
            "GpuSample", {"hostname": f"f-{i}", "uuid": f"GPU-f-{i}", "pci_bus_id": None, "timestamp_ms": T0}
        )
        for i in range(n)
    ]


def test_a_sample_flood_of_forged_hosts_cannot_keep_a_new_nodes_xid_79_from_paging() -> None:
    svc, sink, reg = _service(DeviceAdmission(max_nodes=50, max_devices=1000))
    assert svc.handle(_forged_samples(2000)) == []
    assert (svc.admission.nodes(), len(svc.health)) <= (50, 50)
    assert _xid_79_pages(svc, sink, "node-real")
    text = generate_latest(reg).decode()
    assert 'gpupipe_alerts_admission_total{result="evicted_idle_node"}' in text


def test_an_xid_79_flood_of_forged_hosts_cannot_keep_a_new_nodes_xid_79_from_paging() -> None:
    svc, sink, _ = _service(DeviceAdmission(max_nodes=50, max_devices=1000))
    svc.handle([inrec("XidEvent", xid(79, "real-1", host="node-known"))])
    svc.handle(
        [
            inrec(
                "GpuSample",
                {"hostname": "node-known", "uuid": "GPU-k", "pci_bus_id": None, "timestamp_ms": T0},
            )
        ]
    )
    assert svc.handle(_forged(520)) == []
    assert _xid_79_pages(svc, sink, "node-real")
    # bounded: twice the caps at most, while every node holds an open alert
    assert svc.admission.nodes() <= 100 and len(svc.engine.open_alerts()) <= 100
    assert len(svc.engine.histories.all()) <= 100 and len(svc.health) <= 100
    assert svc.admission.counts["evicted_alerting_node"] > 0


def test_after_a_restart_restored_forged_alerts_do_not_keep_a_new_node_out() -> None:
    first, sink, _ = _service(DeviceAdmission(max_nodes=50, max_devices=1000))
    first.handle(_forged(520))  # forged drain alerts published: a restart restores them all
    again, sink2, _ = _service(DeviceAdmission(max_nodes=50, max_devices=1000))
    assert again.restore(sink.records) >= 50  # the cap full of them
    assert _xid_79_pages(again, sink2, "node-new")
    assert _xid_79_pages(again, sink2, "node-other")
    assert again.admission.nodes() <= 100


def test_a_node_whose_drain_alert_a_flood_evicted_stays_cordoned(tmp_path: Path) -> None:
    """Forgetting an alerting node is no evidence of recovery: --uncordon must not release it."""
    from tests.k8s_api_fake import FakeKubeApi
    from tests.unit.consumers.alerts.engine.test_findings import _Clock, _cordon_service, _drain_event

    with FakeKubeApi(["node-a", "node-b"], token="tok") as api:
        clock = _Clock(T0)
        svc = _cordon_service(api, tmp_path, clock, limit=10, uncordon=True)
        adm = DeviceAdmission(max_nodes=1)
        adm.node_busy, adm.device_busy = svc.engine.table.host_busy, svc.engine.table.gpu_busy
        svc.admission = adm
        _drain_event(svc, "node-a", T0)
        assert svc.cordoner.process(svc.cordoner._queue.get_nowait()).outcome == "cordoned"
        for i in range(3):  # made-up nodes' drain alerts: node-a is the least recently seen
            _drain_event(svc, f"forged-{i}", T0 + i + 1)
        assert "node-a" not in {a.hostname for a in svc.engine.open_alerts()}
        while not svc.cordoner._queue.empty():
            svc.cordoner._queue.get_nowait()
        svc.reconcile(T0 + S)
        svc.cordoner._run_one(svc.cordoner._queue.get_nowait())  # the release pass
        assert api.node("node-a")["spec"]["unschedulable"] is True


def test_samples_of_forged_uuids_are_bounded_too() -> None:
    svc, _, _ = _service(DeviceAdmission(max_nodes=10, max_devices=20, max_devices_per_node=8))
    samples = [
        inrec(
            "GpuSample",
            {"hostname": "node-a", "uuid": f"GPU-{i}", "pci_bus_id": None, "timestamp_ms": T0 + i},
        )
        for i in range(500)
    ]
    svc.handle(samples)
    assert len(svc.health) <= 8 and svc.admission.devices() <= 8


def _codes(n: int, host: str = "node-a") -> list[Any]:
    """One admitted GPU reporting ``n`` distinct Xid codes: one open alert each, without a cap."""
    return [inrec("XidEvent", xid(1000 + i, f"code-{host}-{i}", host=host, ts=T0)) for i in range(n)]


def _capped_service(max_open: int) -> tuple[AlertsHandler, ListSink, CollectorRegistry]:
    sink, reg = ListSink(), CollectorRegistry()
    svc = AlertsHandler(
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
    lines = [r for r in caplog.records if "open alerts at their cap" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_resolved_alerts_kept_for_reopening_are_bounded_too() -> None:
    cfg = EngineConfig(update_interval_ms=0, max_open_alerts=10, resolve_after_ms=60_000)
    svc = AlertsHandler(sink=ListSink(), clock=(clock := Clock()), engine_config=cfg)
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


def test_one_nodes_certificate_signing_made_up_gpus_cannot_silence_another_node(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    a = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a")
    b = NodeSigner(str(pki.node("b", "system:node:node-b")), None, "node-b")
    check = NodeCheck(NodeVerifier.from_file(str(pki.ca)), "enforce", service="alerts")
    sink = ListSink()
    svc = AlertsHandler(
        sink=sink,
        clock=Clock(),
        instance="t",
        engine_config=EngineConfig(update_interval_ms=0),
        node_check=check,
        admission=DeviceAdmission(max_devices=200),
    )
    made_up = [
        _signed(
            a,
            {"hostname": "node-a", "uuid": f"GPU-a-{i}", "pci_bus_id": None, "timestamp_ms": T0},
            "GpuSample",
        )
        for i in range(400)
    ]
    assert svc.handle(made_up) == []
    assert not svc.handle([_signed(b, xid(79, "b-real", host="node-b"))])
    assert any(r["hostname"] == "node-b" and r["status"] == "firing" for r in sink.records)
    assert svc.admission.devices() <= 64 + 1 and len(svc.health) <= 64  # --max-devices-per-node


def test_a_full_alert_table_still_opens_a_new_nodes_fault() -> None:
    svc, sink, _ = _capped_service(100)
    svc.handle(_codes(300))  # one node holds every open alert the table allows
    assert _xid_79_pages(svc, sink, "node-real")
    assert len(svc.engine.open_alerts()) <= 100


def test_with_node_identity_one_nodes_made_up_drain_alerts_do_not_silence_another_after_a_restart(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    a = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a")
    b = NodeSigner(str(pki.node("b", "system:node:node-b")), None, "node-b")

    def build() -> tuple[AlertsHandler, ListSink]:
        check = NodeCheck(NodeVerifier.from_file(str(pki.ca)), "enforce", service="alerts")
        sink = ListSink()
        adm = DeviceAdmission(max_devices=200)
        cfg = EngineConfig(update_interval_ms=0)
        return AlertsHandler(
            sink=sink, clock=Clock(), engine_config=cfg, node_check=check, admission=adm
        ), sink

    first, sink = build()
    made_up = [
        _signed(a, {**xid(79, f"a-{i}", host="node-a"), "pci_bus_id": None, "uuid": f"GPU-a-{i}"})
        for i in range(300)
    ]
    assert first.handle(made_up) == []
    again, sink2 = build()
    again.restore(sink.records)  # node-a's drain alerts come back, at most its per-node bound
    assert again.admission.devices() <= 2 * 64
    assert not again.handle([_signed(b, xid(79, "b-real", host="node-b"))])
    assert any(r["hostname"] == "node-b" and r["status"] == "firing" for r in sink2.records)
