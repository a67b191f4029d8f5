"""Which evidence ends which alert, in every processing order, across a restore (review of the alerts promise:
alerts never hide a page and never resolve a broken GPU).

The findings: a reboot ended support/RMA-class drain alerts (the recurring Xid 79 among them) and
resolved alerts of a GPU that never came back; a pre-reboot XID processed after the post-reboot driver
load (XIDs and the load line are on different partitions) raised a drain alert that stayed; a driver
reload ended GpuUnavailable; NVML's recovery action NONE ended every alert of the GPU; a recovery-action
report processed after the sample that read it cleared raised an alert that stayed. The policy is one
table (gpupipe_consumers.alerts.engine.recovery_policy), tested here as a table through the engine's real
inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpupipe_consumers.alerts.engine.alert_record import Alert, to_record
from gpupipe_consumers.alerts.engine.evidence_memory import evidence_from_record, evidence_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity, SignalEvent
from gpupipe_consumers.alerts.engine.recovery_policy import (
    EVIDENCE_ENDS,
    RECOVERY_CLASS,
    recovery_class,
    sample_healthy,
)
from gpupipe_consumers.alerts.rules.catalog import Action
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.alerts.engine.test_reset_evidence import (
    MIN,
    MSG,
    T0,
    S,
    driver_loaded,
    healthy,
    xid,
)

MSG.setdefault(64, "Failed to persist row remap in InfoROM")
MSG.setdefault(167, "PCIe fatal timeout")
DEV0 = "0000:18:00.0"
GPU0 = GpuIdentity("node-a", DEV0, "GPU-0", 0)


def unavailable(ts: int, g: int = 0, boot: str = "boot-A") -> dict[str, Any]:
    return {
        "event_id": f"node-a|nvml|{g}|gpu_unavailable|{ts}",
        "timestamp_ms": ts,
        "hostname": "node-a",
        "kind": "gpu_unavailable",
        "xid": None,
        "pci_bus_id": f"0000:{0x18 + 16 * g:02x}:00",
        "uuid": f"GPU-{g}",
        "message": "GPU unavailable (event data 0)",
        "source": "nvml",
        "boot_id": boot,
    }


def recovery_event(value: int, ts: int, name: str) -> dict[str, Any]:
    return {
        "event_id": f"node-a|nvml|{DEV0}|recovery_action{value}|{ts}",
        "timestamp_ms": ts,
        "hostname": "node-a",
        "kind": "recovery_action",
        "xid": None,
        "pci_bus_id": "0000:18:00",
        "uuid": "GPU-0",
        "message": f"GPU recovery action: {name} ({value})",
        "source": "nvml",
        "boot_id": "boot-A",
    }


def published(e: EngineFacade, now: int) -> list[dict[str, Any]]:
    """What the service would publish now: alert revisions and the evidence records."""
    return [to_record(a, now) for a in e.take(now)] + [evidence_record(ev, now) for ev in e.take_evidence()]


def summary(e: EngineFacade) -> list[tuple[int | str, str, bool, str | None]]:
    return sorted(
        (a.codes[0] if a.codes else a.signal, a.action, a.drain_node, a.pending and a.pending.evidence)
        for a in e.open_alerts()
    )


# ------------------------------------------------------------------------------------- the table

#: The policy as docs/alerts.md states it:
#: class -> ends by (reset, gpu_back, driver_load, reboot, replaced, ack)
POLICY = {
    "app": (True, True, True, True, True, True),
    "reset": (True, True, True, True, True, True),
    "gone": (True, True, True, True, True, True),
    "reboot": (False, True, False, True, True, True),
    "operator": (False, False, False, False, True, True),
}
EVIDENCE = ("reset", "gpu_back", "driver_load", "reboot", "replaced", "ack")


def test_the_table_is_the_stated_policy_and_covers_every_action() -> None:
    assert {cls: tuple(cls in EVIDENCE_ENDS[ev] for ev in EVIDENCE) for cls in POLICY} == POLICY
    schema_actions = set(
        next(f["type"]["symbols"] for f in catalog.current("GpuAlert").raw["fields"] if f["name"] == "action")
    )
    assert schema_actions == set(RECOVERY_CLASS) and {a.value for a in Action} <= set(RECOVERY_CLASS)
    # a drain alert is never "the GPU is not suspect"; an action this release cannot read needs a person
    drain_app = Alert("x", ("gpu", "h", "d", "xid:1"), "gpu", "", "xid", "h", 0, 0, action="IGNORE")
    drain_app.drain_node = True
    assert recovery_class(drain_app) == "reset"
    drain_app.action = "SOMETHING_NEW"
    assert recovery_class(drain_app) == "operator"


# One alert per class, raised by the engine's real input on GPU 0 at T0.
RAISE: dict[str, Callable[[EngineFacade], Alert | None]] = {
    "app": lambda e: e.on_xid(xid(13, T0), T0),  # RESTART_APP
    "reset": lambda e: e.on_xid(xid(95, T0), T0),  # RESET_GPU, drain
    "gone": lambda e: e.on_xid(unavailable(T0), T0),  # GpuUnavailable
    "reboot": lambda e: e.on_xid(xid(79, T0), T0),  # RESTART_BM, drain
    "operator": lambda e: e.on_xid(xid(167, T0), T0),  # CONTACT_SUPPORT, drain
}
EV_T = T0 + 5 * MIN


def _evidence(e: EngineFacade, kind: str, a: Alert, samples: bool) -> None:
    """Evidence of ``kind`` at EV_T through the path the service uses (then a healthy sample of GPU 0
    where the service reads samples)."""
    if kind in ("reset", "gpu_back"):
        sig = SignalEvent("gpu_reset", "occurrence", EV_T, detail=f"test {kind}", evidence=kind)
        e.on_signal(GPU0, sig, EV_T)
    elif kind == "driver_load":
        e.on_xid(driver_loaded(EV_T), EV_T)
    elif kind == "reboot":  # any event under a new boot id: here an application fault on another GPU
        e.on_xid(xid(13, EV_T, g=7, boot="boot-B"), EV_T)
    elif kind == "replaced":
        healthy(e, EV_T, uuid="GPU-NEW")
    else:
        e.acknowledge(a.alert_id, EV_T, "done")
    if samples and kind in ("driver_load", "reboot"):
        healthy(e, EV_T + S)


@pytest.mark.parametrize("samples", [True, False], ids=["with-samples", "no-samples"])
@pytest.mark.parametrize("cls", list(POLICY))
def test_each_evidence_ends_exactly_the_classes_of_the_table(cls: str, samples: bool) -> None:
    got = []
    for kind in EVIDENCE:
        e = EngineFacade(EngineConfig(confirm_by_samples=samples))
        healthy(e, T0 - MIN)  # the GPU as it was (its UUID, GPU-0), before the fault
        a = RAISE[cls](e)
        assert a is not None and recovery_class(a) == cls
        _evidence(e, kind, a, samples)
        got.append(a.status == "resolved")
        if a.status == "resolved":
            assert a.resolve_reason == ("acknowledged" if kind == "ack" else "recovered")
    expected = POLICY[cls]
    if not samples and cls == "gone":  # nothing could show the GPU answered after the driver load
        expected = tuple(ok and ev != "driver_load" for ok, ev in zip(expected, EVIDENCE, strict=True))
    assert tuple(got) == expected


def test_node_wide_evidence_waits_for_a_sample_of_that_gpu_after_it() -> None:
    e = EngineFacade(EngineConfig())
    a = e.on_xid(xid(95, T0), T0)
    e.on_xid(driver_loaded(EV_T), EV_T)
    assert a is not None and a.pending is not None and a.status == "firing"
    healthy(e, EV_T - S)  # read before the load
    healthy(e, EV_T + S, g=1)  # another GPU
    e.sample_seen(GPU0, EV_T + S, False, EV_T + S)  # lost or needing a recovery action: not healthy
    assert a.status == "firing"
    healthy(e, EV_T + 2 * S)
    assert (a.status, a.resolve_reason) == ("resolved", "recovered")
    assert "the NVIDIA driver was loaded again" in a.description and "seen healthy at" in a.description


def test_sample_healthy() -> None:
    assert sample_healthy({"gpu_lost": False, "gpu_recovery_action": 0})
    assert sample_healthy({})  # fields not reported: NVML answered for the GPU
    assert not sample_healthy({"gpu_lost": True})
    assert not sample_healthy({"gpu_recovery_action": 2})
    assert not sample_healthy({"mig": {"gi": 1}})  # a slice says nothing of the whole GPU


# ------------------------------------------------------------------------------------- finding 1


def test_a_reboot_keeps_support_class_alerts_and_a_gpu_that_does_not_come_back() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)
    e.on_xid(driver_loaded(T0 + 20 * MIN, boot="boot-B"), T0 + 20 * MIN)  # first reboot
    a = e.on_xid(xid(79, T0 + 120 * MIN, boot="boot-B"), T0 + 120 * MIN)  # back: the reboot did not help
    assert a is not None and (a.rule, a.action, a.drain_node) == ("xid79.recurring", "CONTACT_SUPPORT", True)
    b = e.on_xid(xid(64, T0 + 121 * MIN, g=1, boot="boot-B"), T0 + 121 * MIN)
    assert b is not None and b.action == "RESET_GPU"
    # the operator reboots again; the dead GPU does not enumerate (no sample of it), GPU 1 is not seen yet
    e.on_xid(driver_loaded(T0 + 140 * MIN, boot="boot-C"), T0 + 140 * MIN)
    assert summary(e) == [(64, "RESET_GPU", True, "reboot"), (79, "CONTACT_SUPPORT", True, None)]
    # GPU 1 shows up healthy: its reset-class alert ends; the support case stays (only an ack ends it)
    healthy(e, T0 + 141 * MIN, g=1)
    healthy(e, T0 + 141 * MIN, g=0)
    assert summary(e) == [(79, "CONTACT_SUPPORT", True, None)]


def test_an_alert_whose_gpu_is_not_seen_after_the_reboot_says_so_and_keeps_waiting() -> None:
    e = EngineFacade(EngineConfig(update_interval_ms=0, confirm_within_ms=10 * MIN))
    a = e.on_xid(xid(79, T0), T0)
    e.on_xid(driver_loaded(T0 + 20 * MIN, boot="boot-B"), T0 + 20 * MIN)
    first = published(e, T0 + 20 * MIN)
    rec = next(r for r in first if r["status"] == "firing")
    assert rec["recovery_pending"] == {
        "evidence": "reboot",
        "since_ms": T0 + 20 * MIN,
        "detail": "the node rebooted (boot id boot-A -> boot-B)",
    }
    e.tick(T0 + 29 * MIN)
    assert a is not None and "did not come back" not in a.description
    e.tick(T0 + 30 * MIN)  # ten minutes without a sample of that GPU
    (rec,) = [r for r in published(e, T0 + 30 * MIN) if r["status"] == "firing"]
    assert "no sample has shown this GPU healthy since" in rec["description"] and rec["drain_node"]
    e.tick(T0 + 5 * 60 * MIN)  # hours: still firing (silence is no evidence), said once
    assert a.status == "firing" and a.description.count("did not come back") == 1
    healthy(e, T0 + 5 * 60 * MIN)  # it came back after all (a slow boot)
    assert (a.status, a.resolve_reason) == ("resolved", "recovered")


def test_the_fault_back_after_the_reboot_is_no_recovery() -> None:
    e = EngineFacade(EngineConfig())
    a = e.on_xid(xid(79, T0), T0)
    e.on_xid(driver_loaded(T0 + 2 * MIN, boot="boot-B"), T0 + 2 * MIN)
    assert a is not None and a.pending is not None
    # lost again right after the reboot (within the dedupe window: the same alert)
    e.on_xid(xid(79, T0 + 3 * MIN, boot="boot-B"), T0 + 3 * MIN)
    assert a.pending is None and a.drain_node
    healthy(e, T0 + 4 * MIN)
    assert a.status == "firing"


# ------------------------------------------------------------------------------------- finding 2


def _final(events: list[dict[str, Any]], now: int, samples: list[int] = ()) -> list[Any]:
    e = EngineFacade(EngineConfig())
    for ev in events:
        e.on_xid(dict(ev), now)
    for ts in samples:
        healthy(e, ts)
    e.tick(now + 10 * MIN)
    return summary(e)


def test_the_outcome_of_a_reboot_does_not_depend_on_processing_order() -> None:
    fault = xid(79, T0)  # boot A: fell off the bus
    boot = driver_loaded(T0 + 20 * MIN, boot="boot-B")  # the node rebooted
    now = T0 + 60 * MIN  # the alerts service catches up
    assert _final([fault, boot], now) == _final([boot, fault], now) == [(79, "RESTART_BM", True, "reboot")]
    back = [T0 + 21 * MIN]
    assert _final([fault, boot], now, back) == _final([boot, fault], now, back) == []


def test_an_old_boots_fault_processed_late_is_recovered_at_once_and_never_pages() -> None:
    e = EngineFacade(EngineConfig(update_interval_ms=0))
    now = T0 + 60 * MIN
    e.on_xid(driver_loaded(T0 + 20 * MIN, boot="boot-B"), now)
    healthy(e, T0 + 21 * MIN)  # the GPU is fine after the reboot (samples were processed first)
    a = e.on_xid(xid(79, T0), now)  # the pre-reboot 79, processed last
    assert a is not None and (a.status, a.resolve_reason) == ("resolved", "recovered")
    (rec,) = [r for r in published(e, now) if r["status"] != "action"]
    assert rec["status"] == "resolved" and rec["sequence"] == 1  # never published firing: no page, no cordon
    assert e.open_alerts() == []
    # recorded for recurrence: the same GPU falling off the bus under boot B escalates
    b = e.on_xid(xid(79, T0 + 90 * MIN, boot="boot-B"), T0 + 90 * MIN)
    assert b is not None and b.rule == "xid79.recurring"
    # and the old boot never becomes the host's current boot again
    assert e.memory.current_boot("node-a") == "boot-B"


def test_a_gpu_reset_seen_before_the_xid_it_ends_still_ends_it() -> None:
    """Samples and XIDs are on different topics: the counter restart may be processed first."""
    e = EngineFacade(EngineConfig())
    sig = SignalEvent(
        "gpu_reset", "occurrence", T0 + MIN, detail="total_energy_mj restarted", evidence="reset"
    )
    e.on_signal(GPU0, sig, T0 + 2 * MIN)
    a = e.on_xid(xid(95, T0), T0 + 2 * MIN)
    assert a is not None and (a.status, a.resolve_reason) == ("resolved", "recovered")
    later = e.on_xid(xid(95, T0 + 3 * MIN), T0 + 3 * MIN)  # after the reset: a new fault
    assert later is not None and later.status == "firing"


# ------------------------------------------------------------------------------------- finding 3


def test_a_driver_reload_does_not_end_gpu_unavailable() -> None:
    e = EngineFacade(EngineConfig())
    a = e.on_xid(unavailable(T0), T0)
    e.on_xid(driver_loaded(T0 + 5 * MIN), T0 + 5 * MIN)  # same boot: the module loaded again
    assert a is not None and a.status == "firing" and a.pending is not None
    e2 = EngineFacade(EngineConfig(confirm_by_samples=False))  # no samples: nothing could confirm it
    b = e2.on_xid(unavailable(T0), T0)
    e2.on_xid(driver_loaded(T0 + 5 * MIN), T0 + 5 * MIN)
    assert b is not None and b.status == "firing" and b.pending is None
    e2.on_xid(recovery_event(0, T0 + 6 * MIN, "NONE"), T0 + 6 * MIN)  # NVML: nothing needed any more
    assert (b.status, b.resolve_reason) == ("resolved", "recovered")


# ------------------------------------------------------------------------------------- finding 4


def test_recovery_action_none_ends_reset_class_alerts_only() -> None:
    e = EngineFacade(EngineConfig())
    rma = e.on_xid(xid(167, T0), T0)  # CONTACT_SUPPORT, drain
    e2 = EngineFacade(EngineConfig())
    bus = e2.on_xid(xid(79, T0), T0)  # RESTART_BM
    for eng in (e, e2):
        eng.on_xid(recovery_event(2, T0 + MIN, "NODE_REBOOT"), T0 + MIN)
        eng.on_xid(recovery_event(0, T0 + 5 * MIN, "NONE"), T0 + 5 * MIN)
    assert rma is not None and rma.status == "firing"
    assert bus is not None and bus.status == "firing"
    # the recovery-action alert itself is NVML's statement: its NONE ends it whatever it asked for
    assert [a.signal for a in e.open_alerts()] == ["xid"] and [a.signal for a in e2.open_alerts()] == ["xid"]


def test_a_replaced_gpu_ends_an_rma_class_alert() -> None:
    e = EngineFacade(EngineConfig())
    healthy(e, T0 - MIN, uuid="GPU-OLD")
    a = e.on_xid(xid(167, T0), T0)
    healthy(e, T0 + MIN, uuid="GPU-OLD")  # the same board, healthy: no evidence
    assert a is not None and a.status == "firing"
    healthy(e, T0 + 3 * 60 * MIN, uuid="GPU-NEW")
    assert (a.status, a.resolve_reason) == ("resolved", "recovered")
    assert "replaced (GPU-OLD -> GPU-NEW)" in a.description


# ------------------------------------------------------------------------- NVML events vs samples


def _notice_order(order: list[str], now: int) -> list[tuple[str, str]]:
    e = EngineFacade(EngineConfig())
    steps = {
        "event": lambda: e.on_xid(recovery_event(3, T0, "DRAIN_P2P"), now),
        "active": lambda: e.on_signal(
            GPU0, SignalEvent("recovery_action", "active", T0 + 10 * S, since_ms=T0 + 10 * S, value=3), now
        ),
        "clear": lambda: e.on_signal(
            GPU0, SignalEvent("recovery_action", "clear", T0 + 5 * MIN, detail="gpu_recovery_action=0"), now
        ),
    }
    for s in order:
        steps[s]()
    e.tick(now + 60 * MIN)
    return [(a.key[3], a.action) for a in e.open_alerts()]


def test_a_recovery_action_event_processed_after_the_sample_that_read_it_cleared_raises_nothing() -> None:
    now = T0 + 10 * MIN
    assert _notice_order(["event", "active", "clear"], now) == []
    assert _notice_order(["active", "clear", "event"], now) == []
    assert _notice_order(["active", "event", "clear"], now) == []


# --------------------------------------------------------------------------------------- HA pair


def test_the_standby_decides_as_the_leader_from_the_published_state() -> None:
    """The leader saw the post-reboot load line of a quiet node (no alert changed) and failed over; the
    standby restores from gpu.alerts.v1 and processes the pre-reboot 79 that lagged in its partition."""
    now = T0 + 60 * MIN
    leader = EngineFacade(EngineConfig())
    leader.on_xid(driver_loaded(T0 + 20 * MIN, boot="boot-B"), now)
    topic = published(leader, now)
    assert [(r["status"], r["remediation"]["kind"], r["signal"], r["boot_id"]) for r in topic] == [
        ("action", "evidence", "boot", "boot-B"),
        ("action", "evidence", "driver_load", None),
    ]
    standby = EngineFacade(EngineConfig())
    standby.restore(topic, now)
    late = xid(79, T0)
    leader.on_xid(dict(late), now)  # what the leader would have decided
    standby.on_xid(dict(late), now)
    assert summary(standby) == summary(leader) == [(79, "RESTART_BM", True, "reboot")]
    # the waiting alert is published with what it waits for: a second failover keeps it
    topic += published(standby, now)
    third = EngineFacade(EngineConfig())
    assert third.restore(topic, now + MIN) == 1
    assert summary(third) == summary(standby)
    healthy(third, T0 + 21 * MIN)
    healthy(standby, T0 + 21 * MIN)
    assert summary(third) == summary(standby) == []


def test_a_restore_applies_evidence_an_interrupted_instance_did_not() -> None:
    """The evidence record went out, the alert's revision did not (a crash between): the restore ends it."""
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(95, T0), T0)
    topic = published(e, T0)
    e.on_signal(
        GPU0, SignalEvent("gpu_reset", "occurrence", T0 + MIN, detail="reset", evidence="reset"), T0 + MIN
    )
    topic += [r for r in published(e, T0 + MIN) if r["status"] == "action"]
    e2 = EngineFacade(EngineConfig())
    e2.restore(topic, T0 + 2 * MIN)
    assert e2.open_alerts() == []
    assert [r["resolve_reason"] for r in published(e2, T0 + 2 * MIN)] == ["recovered"]


def test_evidence_and_pending_records_are_valid_gpualert_records() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)
    e.on_xid(driver_loaded(T0 + MIN, boot="boot-B"), T0 + MIN)
    healthy(e, T0 - MIN, g=3, uuid="GPU-3")
    healthy(e, T0 + 2 * MIN, g=3, uuid="GPU-33")
    recs = published(e, T0 + 2 * MIN)
    codec = AvroCodec()
    enc = codec.encoder("GpuAlert")
    kinds = []
    for r in recs:
        d = codec.decode(enc.encode(r))
        assert d.record == r
        ev = evidence_from_record(d.record)
        kinds.append(ev.kind if ev else d.record["status"])
    assert sorted(kinds) == ["boot", "boot", "driver_load", "firing", "replaced"]
    assert next(r for r in recs if r["status"] == "firing")["recovery_pending"]["evidence"] == "reboot"
    assert evidence_from_record(next(r for r in recs if r["status"] == "firing")) is None


# ------------------------------------------------------------------------------------ the service


def test_the_service_hands_every_sample_to_the_engine_and_publishes_evidence() -> None:
    from prometheus_client import CollectorRegistry

    from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
    from gpupipe_consumers.plumbing.consume_loop import InRecord

    clock_ms = [T0]
    svc = AlertsHandler(
        sink=ListSink(),
        registry=CollectorRegistry(),
        clock=lambda: clock_ms[0] / 1000,
        engine_config=EngineConfig(update_interval_ms=0),
    )

    def handle(name: str, value: dict[str, Any]) -> None:
        clock_ms[0] = max(clock_ms[0], value["timestamp_ms"])
        topic = "gpu.xid.v1" if name == "XidEvent" else "gpu.samples.v1"
        assert svc.handle([InRecord(topic, 0, 0, None, name, value, T0)]) == []

    def sample(ts: int, **kw: Any) -> dict[str, Any]:
        return {"hostname": "node-a", "pci_bus_id": "00000000:18:00.0", "uuid": "GPU-0", "gpu_index": 0,
                "timestamp_ms": ts, **kw}  # fmt: skip

    handle("XidEvent", xid(79, T0))
    handle("XidEvent", driver_loaded(T0 + 10 * MIN, boot="boot-B"))
    handle("GpuSample", sample(T0 + 11 * MIN, gpu_recovery_action=2))  # back, but needs a reboot: not healthy
    assert sorted((a.signal, a.pending is not None) for a in svc.engine.open_alerts()) == [
        ("recovery_action", False),  # the sampled level, its own alert
        ("xid", True),
    ]
    handle("GpuSample", sample(T0 + 12 * MIN, gpu_recovery_action=0))
    assert svc.engine.open_alerts() == []
    alerts = [r for r in svc.sink.records if r["status"] != "action"]
    assert [(r["status"], r["resolve_reason"]) for r in alerts][-1] == ("resolved", "recovered")
    evidence = [evidence_from_record(r) for r in svc.sink.records if r["status"] == "action"]
    assert {(ev.kind, ev.boot_id) for ev in evidence if ev} >= {("boot", "boot-A"), ("boot", "boot-B")}
    assert svc.records_out["action"] == len(evidence)
