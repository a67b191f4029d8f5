"""NVML's recovery-action and GPU-unavailable events in the alerts consumer.

The node agent publishes them as XidEvent kinds ``recovery_action`` / ``gpu_unavailable`` with ``xid``
null; the events here are built by the agent's own ``nvml_notice_event``, so they carry its message
format (``GPU recovery action: DRAIN_AND_RESET (4)``). The alerts consumer used to take them for an
XID 0 and raised one bogus "XID 0 UNKNOWN_XID" warning per GPU for both.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpupipe_consumers.alerts.am_shape import am_labels
from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity, SignalEvent
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.alerts.rules.catalog import Action, Severity
from gpupipe_consumers.alerts.rules.classify import FaultEvent, classify
from gpupipe_consumers.alerts.rules.parsers import parse_recovery_event
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.xid.events import XidContext, nvml_notice_event
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError

T0 = 1_800_000_000_000
S = 1000
MIN = 60 * S
HOUR = 60 * MIN


def bus(g: int) -> str:
    return f"00000000:{0x18 + 16 * g:02X}:00.0"  # NVML's form, as the agent's event and samples carry it


def dev(g: int) -> str:
    return f"0000:{0x18 + 16 * g:02x}:00.0"  # the engine's canonical key


def notice(kind: str, data: int, ts: int, g: int = 3, *, host: str = "node-a", boot: str = "boot-A") -> dict:
    agent_notice = {"type": kind, "data": data, "uuid": f"GPU-{g}", "pci_bus_id": bus(g), "gpu_index": g}
    ev = nvml_notice_event({**agent_notice, "timestamp_ms": ts}, XidContext(host, {}, {}))
    ev["boot_id"] = boot
    ev["allocations"] = [{"namespace": "ml", "pod": f"train-{g}", "container": "main"}]
    return ev


def xid(code: int, ts: int, g: int = 3, *, boot: str = "boot-A", message: str = "") -> dict:
    return {
        "event_id": f"node-a|kmsg|{g}|{code}|{ts}",
        "timestamp_ms": ts,
        "hostname": "node-a",
        "kind": "xid",
        "xid": code,
        "pci_bus_id": f"0000:{0x18 + 16 * g:02x}:00",  # the kernel log's form of the same GPU
        "message": message or "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
        "source": "kmsg",
        "boot_id": boot,
    }


def driver_loaded(ts: int, boot: str = "boot-A") -> dict:
    return {
        "event_id": f"node-a|kmsg||driver_loaded|{ts}",
        "timestamp_ms": ts,
        "hostname": "node-a",
        "kind": "driver_loaded",
        "xid": None,
        "pci_bus_id": "",
        "message": "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01",
        "source": "kmsg",
        "boot_id": boot,
    }


def sample(ts: int, g: int = 3, **kw: Any) -> dict:
    rec = {"hostname": "node-a", "pci_bus_id": bus(g), "uuid": f"GPU-{g}", "gpu_index": g, "timestamp_ms": ts}
    rec.update(kw)
    return rec


def records(e: EngineFacade, now: int) -> list[dict]:
    return [to_record(a, now) for a in e.take(now)]


def inrec(value: dict, offset: int = 0) -> InRecord:
    name = "XidEvent" if "kind" in value else "GpuSample"
    topic = "gpu.xid.v1" if name == "XidEvent" else "gpu.samples.v1"
    return InRecord(topic, 0, offset, None, name, value, T0)


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> float:
        return self.ms / 1000


def service() -> tuple[AlertsHandler, Clock]:
    clock = Clock()
    svc = AlertsHandler(
        sink=ListSink(),
        registry=CollectorRegistry(),
        clock=clock,
        engine_config=EngineConfig(update_interval_ms=0),
    )
    return svc, clock


def feed(svc: AlertsHandler, clock: Clock, *values: dict) -> list[dict]:
    """Hand records to the service at their own time; the records it published meanwhile."""
    before = len(svc.sink.records)
    for v in values:
        clock.ms = max(clock.ms, v["timestamp_ms"])
        assert svc.handle([inrec(v)]) == []
    return [r for r in svc.sink.records[before:] if (r["remediation"] or {}).get("kind") != "evidence"]


# ----------------------------------------------------------------------------------- the bug itself


def test_recovery_action_and_gpu_unavailable_are_not_an_unknown_xid_0() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(notice("recovery_action", 4, T0), T0)
    e.on_xid(notice("gpu_unavailable", 0, T0 + S), T0 + S)
    got = {r["signal"]: r for r in records(e, T0 + S)}
    assert all(r["name"] != "UNKNOWN_XID" and r["rule"] != "unknown_kind" for r in got.values())
    assert set(got) == {"recovery_action", "gpu_unavailable"}  # was: one "xid" alert, XID 0, for both
    ra, un = got["recovery_action"], got["gpu_unavailable"]
    fields = ("alertname", "severity", "action", "drain_node", "xid_codes", "known")
    assert [ra[f] for f in fields] == [
        "GpuRecoveryActionRequired",
        "critical",
        "DRAIN_AND_RESET",
        True,
        [],
        True,
    ]
    assert "DRAIN_AND_RESET (4)" in ra["description"] and ra["rule"] == "nvml_event.recovery_action"
    assert (un["alertname"], un["severity"], un["action"], un["drain_node"], un["xid_codes"]) == (
        "GpuUnavailable",
        "critical",
        "RESET_GPU",
        True,
        [],
    )


# ------------------------------------------------------------------------------ pure classification


def test_the_message_of_a_recovery_action_event_gives_its_value() -> None:
    assert parse_recovery_event("GPU recovery action: DRAIN_AND_RESET (4)") == 4
    assert parse_recovery_event("GPU recovery action: UNKNOWN (9)") == 9
    assert parse_recovery_event("GPU recovery action: DRAIN_P2P (3)") == 3
    assert parse_recovery_event("GPU recovery action: NODE_REBOOT") == 2  # the name when no number
    assert parse_recovery_event("GPU unavailable (event data 0)") is None
    # Xid 154's text says "changed from ... to ...": not this event's format
    assert parse_recovery_event("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot)") is None


@pytest.mark.parametrize(
    ("value", "action", "severity", "drain", "known"),
    [
        (1, Action.RESET_GPU, Severity.CRITICAL, True, True),
        (2, Action.RESTART_BM, Severity.CRITICAL, True, True),
        (3, Action.DRAIN_P2P, Severity.WARNING, True, True),
        (4, Action.DRAIN_AND_RESET, Severity.CRITICAL, True, True),
        (5, Action.CONTACT_SUPPORT, Severity.WARNING, False, True),  # RECOVER_IMEX_DOMAIN: no bucket
        (6, Action.BUS_RESET, Severity.CRITICAL, True, True),
        (7, Action.SYSTEM_REBOOT, Severity.CRITICAL, True, True),
        (9, Action.CONTACT_SUPPORT, Severity.WARNING, False, False),  # newer than this release
        (0, Action.IGNORE, Severity.INFO, False, True),
    ],
)
def test_a_recovery_action_event_is_graded_as_the_sampled_field(
    value: int, action: Action, severity: Severity, drain: bool, known: bool
) -> None:
    ev = notice("recovery_action", value, T0)
    c = classify(FaultEvent(kind="recovery_action", ts_ms=T0, message=ev["message"]))
    assert (c.action, c.severity, c.drain_node, c.known, c.codes) == (action, severity, drain, known, ())
    if value == 0:
        return
    # the same value read from the sampled field gives the same alert (one incident, one presentation)
    by_event, by_sample = EngineFacade(EngineConfig()), EngineFacade(EngineConfig())
    a = by_event.on_xid(ev, T0)
    b = by_sample.on_signal(
        GpuIdentity("node-a", dev(3), "GPU-3", 3),
        SignalEvent("recovery_action", "active", T0, since_ms=T0, value=value),
        T0,
    )
    assert a is not None and b is not None
    fields = ("key", "alertname", "name", "severity", "cause_class", "action", "drain_node", "runbook")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def test_a_bus_reset_and_a_system_reboot_are_told_apart_from_a_gpu_reset_and_a_node_reboot() -> None:
    svc, clock = service()
    got = {}
    for g, value in enumerate((1, 6, 2, 7)):
        (rec,) = feed(svc, clock, sample(T0 + g * S, g, gpu_recovery_action=value))
        got[value] = rec
    assert [got[v]["action"] for v in (1, 6, 2, 7)] == [
        "RESET_GPU",
        "BUS_RESET",
        "RESTART_BM",
        "SYSTEM_REBOOT",
    ]
    assert len({got[v]["runbook"] for v in got}) == 4  # each its own steps
    assert "PCIe bus" in got[6]["runbook"] and "reboot" in got[7]["runbook"]
    assert "BUS_RESET" in got[6]["description"] and "SYSTEM_REBOOT" in got[7]["description"]
    assert all(r["severity"] == "critical" and r["drain_node"] for r in got.values())


def test_an_unrepairable_memory_and_a_pending_bank_remap_raise_their_own_alerts() -> None:
    svc, clock = service()
    (bad,) = feed(svc, clock, sample(T0, 1, memory_unrepairable=True))
    assert (bad["alertname"], bad["signal"], bad["severity"], bad["action"], bad["drain_node"]) == (
        "GpuMemoryUnrepairable",
        "memory_unrepairable",
        "critical",
        "CONTACT_SUPPORT",
        True,
    )
    assert "replacement" in bad["runbook"]
    (pending,) = feed(svc, clock, sample(T0 + S, 2, bank_remap_pending=True))
    assert (pending["alertname"], pending["severity"], pending["action"], pending["drain_node"]) == (
        "GpuBankRemapPending",
        "warning",
        "RESET_GPU",
        False,
    )
    # a driver without the reads (null) says nothing either way
    assert feed(svc, clock, sample(T0 + 2 * S, 4, bank_remap_pending=None, memory_unrepairable=None)) == []


def test_a_recovery_action_event_without_a_readable_value_gets_the_safe_default() -> None:
    c = classify(FaultEvent(kind="recovery_action", ts_ms=T0, message="GPU recovery action: ?"))
    assert (c.action, c.severity, c.drain_node, c.known) == (
        Action.CONTACT_SUPPORT,
        Severity.WARNING,
        False,
        False,
    )


# ------------------------------------------------------------------- one incident with the samples


def test_the_event_and_the_sampled_field_are_one_alert_whichever_comes_first() -> None:
    svc, clock = service()
    out = feed(svc, clock, sample(T0 - 30 * S, gpu_recovery_action=0), notice("recovery_action", 4, T0))
    out += feed(svc, clock, sample(T0 + 30 * S, gpu_recovery_action=4))
    out += feed(svc, clock, sample(T0 + 60 * S, gpu_recovery_action=4))
    out += feed(svc, clock, sample(T0 + 90 * S, gpu_recovery_action=0))
    assert {r["alert_id"] for r in out} == {out[0]["alert_id"]}
    assert out[0]["status"] == "firing" and out[-1]["status"] == "resolved"
    # the sample going 4 -> 0 is the samples' evidence of recovery (it ends the GPU's faults too)
    assert out[-1]["resolve_reason"] == "recovered" and out[-1]["occurrences"] == 1
    assert "NVML recovery action back to none (was 4)" in out[-1]["description"]
    assert len({tuple(sorted(am_labels(r).items())) for r in out}) == 1  # one Alertmanager alert
    assert out[0]["first_event_id"] == out[0]["last_event_id"] is not None

    svc, clock = service()  # the samples first, then the event (NVML's event lags the read)
    out = feed(svc, clock, sample(T0, gpu_recovery_action=4), notice("recovery_action", 4, T0 + S))
    out += feed(svc, clock, sample(T0 + 30 * S, gpu_recovery_action=0))
    assert {r["alert_id"] for r in out} == {out[0]["alert_id"]}
    assert out[-1]["status"] == "resolved" and out[-1]["resolve_reason"] == "recovered"
    assert out[-1]["last_event_id"] is not None and out[-1]["occurrences"] == 2


def test_a_recovery_action_the_samples_never_showed_is_cleared_by_the_next_normal_sample() -> None:
    """The field is read every 30 s: a DRAIN_P2P can come and go between two reads. The event raised the
    alert; a sample read before the event says nothing about it; the first one after it does."""
    svc, clock = service()
    feed(svc, clock, sample(T0 - 30 * S, gpu_recovery_action=0), notice("recovery_action", 3, T0))
    assert feed(svc, clock, sample(T0 - S, gpu_recovery_action=0)) == []  # read before the event
    assert [a.status for a in svc.engine.open_alerts()] == ["firing"]
    (rec,) = feed(svc, clock, sample(T0 + 29 * S, gpu_recovery_action=0))
    assert (rec["signal"], rec["status"], rec["resolve_reason"]) == ("recovery_action", "resolved", "cleared")


def test_a_recovery_action_an_event_raised_stays_until_evidence() -> None:
    """NVML reports the change once: silence is no evidence (a sampled-only one still ends by quiet)."""
    e = EngineFacade(EngineConfig())
    e.on_xid(notice("recovery_action", 2, T0, g=0), T0)  # NODE_REBOOT
    e.on_xid(notice("recovery_action", 4, T0 + 2 * MIN, g=1), T0 + 2 * MIN)  # DRAIN_AND_RESET
    e.on_signal(  # the samples alone, no event: a level the samples own
        GpuIdentity("node-a", dev(2), "GPU-2", 2),
        SignalEvent("recovery_action", "active", T0, since_ms=T0, value=1),
        T0,
    )
    e.take(T0 + 2 * MIN)
    e.tick(T0 + 3 * HOUR)
    ended = {r["pci_bus_id"]: r["resolve_reason"] for r in records(e, T0 + 3 * HOUR)}
    assert ended == {dev(2): "quiet"}
    e.on_xid(driver_loaded(T0 + 3 * HOUR + MIN), T0 + 3 * HOUR + MIN)  # a reset satisfies 4, not 2
    # ... once a sample of that GPU after the load shows it healthy (a node-wide event proves no GPU back)
    healthy = GpuIdentity("node-a", dev(1), "GPU-1", 1)
    e.sample_seen(healthy, T0 + 3 * HOUR + 2 * MIN, True, T0 + 3 * HOUR + 2 * MIN)
    assert {r["pci_bus_id"]: r["resolve_reason"] for r in records(e, T0 + 3 * HOUR + 2 * MIN)} == {
        dev(1): "recovered"
    }
    e.on_xid(driver_loaded(T0 + 4 * HOUR, boot="boot-B"), T0 + 4 * HOUR)  # the node rebooted
    e.sample_seen(GpuIdentity("node-a", dev(0), "GPU-0", 0), T0 + 4 * HOUR + S, True, T0 + 4 * HOUR + S)
    (rec,) = records(e, T0 + 4 * HOUR + S)
    assert (rec["pci_bus_id"], rec["resolve_reason"]) == (dev(0), "recovered")
    assert e.open_alerts() == []


def test_recovery_action_none_is_evidence_of_recovery() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(95, T0), T0)  # RESET_GPU: firing until evidence
    e.on_xid(xid(95, T0, g=5), T0)  # another GPU
    e.on_xid(notice("recovery_action", 1, T0 + S), T0 + S)
    e.take(T0 + S)
    e.on_xid(notice("recovery_action", 0, T0 + 5 * MIN), T0 + 5 * MIN)
    got = {(r["signal"], r["pci_bus_id"]): r for r in records(e, T0 + 5 * MIN)}
    assert {k: (r["status"], r["resolve_reason"]) for k, r in got.items()} == {
        ("xid", dev(3)): ("resolved", "recovered"),
        ("recovery_action", dev(3)): ("resolved", "recovered"),
    }
    assert "NVML recovery-action event: GPU recovery action: NONE (0)" in got[("xid", dev(3))]["description"]
    assert [(a.signal, a.device) for a in e.open_alerts()] == [("xid", dev(5))]
    # a sample read before the NONE, processed after it, raises nothing; a later one does
    late = GpuIdentity("node-a", dev(3), "GPU-3", 3)
    stale = SignalEvent("recovery_action", "active", T0 + 4 * MIN, value=1)
    assert e.on_signal(late, stale, T0 + 6 * MIN) is None
    again = e.on_signal(late, SignalEvent("recovery_action", "active", T0 + 7 * MIN, value=1), T0 + 7 * MIN)
    assert again is not None and again.status == "firing"


def test_an_event_raised_recovery_action_is_restored_sticky_and_the_first_sample_clears_it() -> None:
    svc, clock = service()
    published = feed(svc, clock, notice("recovery_action", 4, T0))
    svc2, clock2 = service()
    clock2.ms = T0 + HOUR
    assert svc2.restore(published) == 1
    svc2.tick()
    clock2.ms = T0 + 2 * HOUR
    svc2.tick()  # past --resolve-after without samples: still firing
    assert [a.status for a in svc2.engine.open_alerts()] == ["firing"]
    (rec,) = feed(svc2, clock2, sample(T0 + 2 * HOUR + S, gpu_recovery_action=0))
    assert (rec["status"], rec["resolve_reason"]) == ("resolved", "cleared")


# ---------------------------------------------------------------------------------- GPU unavailable


def test_gpu_unavailable_is_a_critical_reset_alert_on_that_gpu_until_evidence() -> None:
    svc, clock = service()
    feed(svc, clock, sample(T0 - 10 * S, total_energy_mj=5_000))
    (rec,) = feed(svc, clock, notice("gpu_unavailable", 0, T0))
    assert (rec["scope"], rec["signal"], rec["gpu_uuid"], rec["gpu_index"], rec["pci_bus_id"]) == (
        "gpu",
        "gpu_unavailable",
        "GPU-3",
        3,
        dev(3),
    )
    assert rec["allocations"] == [{"namespace": "ml", "pod": "train-3", "container": "main"}]
    assert rec["rule"] == "nvml_event.gpu_unavailable" and "nvidia-smi -r" in rec["runbook"]
    labels = am_labels(rec)
    assert labels["alertname"] == "GpuUnavailable" and labels["pci_bus_id"] == dev(3) and "xid" not in labels
    assert labels["severity"] == "critical" and labels["node"] == "node-a"
    (again,) = feed(svc, clock, notice("gpu_unavailable", 0, T0 + MIN))
    assert again["alert_id"] == rec["alert_id"] and again["occurrences"] == 2
    clock.ms = T0 + 3 * HOUR
    svc.tick()
    assert [a.status for a in svc.engine.open_alerts()] == ["firing"]  # silence is no evidence
    # the GPU was reset: its energy counter restarted
    (end,) = feed(svc, clock, sample(T0 + 3 * HOUR, total_energy_mj=10))
    assert (end["alert_id"], end["status"], end["resolve_reason"]) == (
        rec["alert_id"],
        "resolved",
        "recovered",
    )


def test_a_driver_reload_ends_gpu_unavailable_only_once_a_sample_shows_the_gpu() -> None:
    """A module load says nothing of a GPU that could not be reached (the reason Xid 79 is exempted,
    NVSentinel#155): a sample of that GPU after the load does."""
    e = EngineFacade(EngineConfig())
    e.on_xid(notice("gpu_unavailable", 0, T0), T0)
    e.take(T0)
    e.on_xid(driver_loaded(T0 + MIN), T0 + MIN)
    (rec,) = records(e, T0 + MIN)  # still firing, waiting for the GPU
    assert (rec["status"], rec["recovery_pending"]["evidence"]) == ("firing", "driver_load")
    ident = GpuIdentity("node-a", dev(3), "GPU-3", 3)
    e.sample_seen(ident, T0 + MIN - S, True, T0 + 2 * MIN)  # read before the load: no evidence
    assert records(e, T0 + 2 * MIN) == []
    e.sample_seen(ident, T0 + MIN + 30 * S, True, T0 + 2 * MIN)
    (rec,) = records(e, T0 + 2 * MIN)
    assert (rec["signal"], rec["status"], rec["resolve_reason"]) == (
        "gpu_unavailable",
        "resolved",
        "recovered",
    )
    assert "the GPU was seen healthy at" in rec["description"]


def test_gpus_unavailable_at_once_make_a_node_burst() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0, g=0, message="GPU has fallen off the bus."), T0)
    for g in (1, 2):
        e.on_xid(notice("gpu_unavailable", 0, T0 + g * S, g=g), T0 + g * S)
    recs = records(e, T0 + 2 * S)
    (storm,) = [r for r in recs if r["alertname"] == "GpuNodeXidStorm"]
    assert len(storm["gpus"]) == 3 and storm["severity"] == "critical" and storm["drain_node"]
    assert "(XIDs 79; gpu_unavailable)" in storm["description"]
    assert {r["parent_alert_id"] for r in recs if r["scope"] == "gpu"} == {storm["alert_id"]}


@pytest.mark.parametrize("kind", ["fallen_off_bus", "gpu_lost"])
def test_fallen_off_bus_and_gpu_lost_are_xid_79(kind: str) -> None:
    e = EngineFacade(EngineConfig())
    a = e.on_xid({**xid(79, T0), "kind": kind, "xid": None, "message": "GPU has fallen off the bus."}, T0)
    assert a is not None
    rec = to_record(a, T0)
    assert (rec["xid_codes"], rec["action"], rec["severity"], rec["drain_node"], rec["rule"]) == (
        [79],
        "RESTART_BM",
        "critical",
        True,
        kind,
    )
    assert am_labels(rec)["xid"] == "79"


# ---------------------------------------------------------------------- an older alerts consumer


def test_an_older_alerts_consumer_reads_the_new_kinds_as_unknown_and_never_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """XidEvent v1 (what an alerts service released before these kinds reads with) has no such symbols;
    the enum's default maps them to ``unknown``."""
    v1 = catalog.latest_released("XidEvent")
    assert v1 is not None
    new = [notice("recovery_action", 2, T0), notice("gpu_unavailable", 0, T0 + S, g=4)]
    for ev in new:
        ev["allocations"] = []
    payloads = [AvroCodec().encoder("XidEvent").encode(ev) for ev in new]
    # With the writer's schema at hand (Schema Registry framing) it resolves against its own reader:
    old_reader = AvroCodec(reader_schemas={"XidEvent": v1.raw})
    decoded = [old_reader.decode(p).record for p in payloads]
    assert [d["kind"] for d in decoded] == ["unknown", "unknown"]
    e = EngineFacade(EngineConfig())
    for d in decoded:
        e.on_xid(d, T0 + S)
    recs = records(e, T0 + S)
    assert recs and all(r["severity"] == "warning" and not r["drain_node"] for r in recs)
    assert {r["rule"] for r in recs} == {"unknown_kind"}
    # Single-object framing: the old service does not know the newer schema's fingerprint at all, so it
    # dead-letters the records (no alert either way): roll out the alerts service before the producers.
    current = catalog.current
    monkeypatch.setattr(catalog, "current", lambda name: v1 if name == "XidEvent" else current(name))
    with pytest.raises(DecodeError) as err:
        AvroCodec().decode(payloads[0])
    assert err.value.reason == "unknown-schema-fingerprint"
