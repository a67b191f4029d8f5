"""GpuAlert records: schema validity, codec round trip, action records, Alertmanager mapping."""

from __future__ import annotations

from fastavro.validation import validate

from gpupipe_consumers.alerts.am_shape import am_annotations, am_labels
from gpupipe_consumers.alerts.engine.alert_record import action_record, iso_ms, to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity, SignalEvent
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

T0 = 1_800_000_000_000


def _records() -> list[dict]:
    e = EngineFacade(EngineConfig())
    for i, (code, bus) in enumerate(
        [(79, "0000:18:00"), (13, "0000:28:00"), (95, "0000:38:00"), (4242, "0000:48:00")]
    ):
        e.on_xid(
            {
                "event_id": f"e{i}",
                "timestamp_ms": T0 + i,
                "hostname": "node-a",
                "kind": "xid",
                "xid": code,
                "pci_bus_id": bus,
                "uuid": f"GPU-{i}",
                "gpu_index": i,
                "message": "Uncontained: FBHUB. RST: Yes, D-RST: No" if code == 95 else "x" * 3000,
                "source": "kmsg",
                "allocations": [{"namespace": "ns", "pod": f"p{i}", "container": "c"}],
            },
            T0 + 10,
        )
    e.on_xid(
        {
            "event_id": "s",
            "timestamp_ms": T0,
            "hostname": "node-a",
            "kind": "sxid",
            "xid": 12028,
            "pci_bus_id": "0000:05:00.0",
            "message": "Fatal",
            "source": "kmsg",
        },
        T0 + 10,
    )
    ident = GpuIdentity("node-a", "0000:58:00.0", uuid="GPU-5")
    e.on_signal(ident, SignalEvent("thermal", "active", T0, since_ms=T0 - 300_000, detail="0x20"), T0 + 10)
    out = [to_record(a, T0 + 20, "inst-1") for a in e.take(T0 + 20)]
    e.tick(T0 + 3_600_000)
    out += [to_record(a, T0 + 3_600_000, "inst-1") for a in e.take(T0 + 3_600_000)]
    return out


def test_records_validate_and_round_trip() -> None:
    recs = _records()
    assert {r["status"] for r in recs} == {"firing", "resolved"}
    assert {r["scope"] for r in recs} == {"gpu", "node", "nvswitch"}
    parsed = catalog.current("GpuAlert").parsed
    codec = AvroCodec()
    enc = codec.encoder("GpuAlert")
    for r in recs:
        assert validate(r, parsed)
        d = codec.decode(enc.encode(r))
        assert d.name == "GpuAlert" and d.record == r
    assert all(len(r["message"]) <= 1024 for r in recs)
    assert all(r["instance"] == "inst-1" for r in recs)


def test_action_record_validates() -> None:
    rec = next(r for r in _records() if r["drain_node"] and r["status"] == "firing")
    act = action_record(rec, outcome="rate_limited", node="node-a", dry_run=False, detail="2/2", at_ms=T0 + 5)
    assert act["status"] == "action" and act["alert_id"] == rec["alert_id"]
    assert act["remediation"] == {
        "kind": "cordon",
        "outcome": "rate_limited",
        "node": "node-a",
        "dry_run": False,
        "detail": "2/2",
        "at_ms": T0 + 5,
    }
    assert validate(act, catalog.current("GpuAlert").parsed)
    odd = action_record(rec, outcome="exploded", node="n", dry_run=True, detail="", at_ms=T0, kind="reboot")
    assert odd["remediation"]["outcome"] == "unknown" and odd["remediation"]["kind"] == "unknown"


def test_alertmanager_labels_and_annotations() -> None:
    recs = [r for r in _records() if r["status"] == "firing"]
    gpu = next(r for r in recs if r["scope"] == "gpu" and r["xid_codes"][:1] == [79])
    labels = am_labels(gpu)
    assert labels == {
        "alertname": "GpuXidError",
        "severity": "critical",
        "node": "node-a",
        "cause_class": gpu["cause_class"],
        "scope": "gpu",
        "source": "gpupipe",
        "xid": "79",
        "pci_bus_id": "0000:18:00.0",
    }
    ann = am_annotations(gpu)
    # Mutable or late-discovered facts are annotations.
    assert ann["action"] == "RESTART_BM" and ann["gpu_uuid"] == "GPU-0" and ann["gpu"] == "0"
    assert ann["namespace"] == "ns" and ann["pod"] == "p0"
    assert (
        ann["summary"].startswith("CRITICAL: XID 79")
        and ann["runbook"]
        and ann["alert_id"] == gpu["alert_id"]
    )
    assert ann["first_seen"] == iso_ms(T0)
    node = next(r for r in recs if r["scope"] == "node")
    nl = am_labels(node)
    assert "xid" not in nl and "gpu_uuid" not in nl and nl["alertname"] == "GpuNodeXidStorm"
    assert am_annotations(node)["xid_codes"] == ",".join(map(str, node["xid_codes"]))


def test_iso_ms() -> None:
    assert iso_ms(0) == "1970-01-01T00:00:00.000Z"
    assert iso_ms(1_796_000_000_123) == "2026-11-30T00:53:20.123Z"
