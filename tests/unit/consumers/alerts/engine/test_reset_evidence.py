"""Kernel-log evidence of a reboot or a driver reload ends reset/reboot/RMA-class alerts.

A fault whose action needs a reset, reboot or RMA stays firing until evidence of recovery.
The kernel log gives two kinds, both published by the node agent on ``gpu.xid.v1``:

* every XidEvent carries the node's boot id: an event under another boot id than the one an alert was
  raised under means the node rebooted since;
* the driver's load line (``NVRM: loading NVIDIA UNIX ... Kernel Module <version>``, kind
  ``driver_loaded``): every GPU was re-initialised -- a reset, not a reboot.

Both are node-wide: they end a GPU's alert (of a class they mend,
gpupipe_consumers.alerts.engine.recovery_policy) once a
sample of that GPU taken after them shows it healthy (:func:`healthy` here), application faults at once.
"""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import alert_device_key, to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity

T0 = 1_800_000_000_000
S = 1000
MIN = 60 * S
LOADED = (
    "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  "
    "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025"
)
MSG = {
    79: "GPU has fallen off the bus.",
    95: "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
    13: "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    119: "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC)",
}
_n = 0


def xid(
    code: int, ts: int, g: int = 0, *, boot: str | None = "boot-A", host: str = "node-a"
) -> dict[str, Any]:
    global _n
    _n += 1
    return {
        "event_id": f"{host}|{g}|{code}|{ts}|{_n}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": "xid",
        "xid": code,
        "pci_bus_id": f"0000:{0x18 + 16 * g:02x}:00",
        "pid": 4242 if code == 13 else None,
        "message": MSG[code],
        "source": "kmsg",
        "boot_id": boot,
    }


def driver_loaded(ts: int, *, boot: str | None = "boot-A", host: str = "node-a") -> dict[str, Any]:
    global _n
    _n += 1
    return {
        "event_id": f"{host}|kmsg||driver_loaded|{ts}|s{_n}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": "driver_loaded",
        "xid": None,
        "pci_bus_id": "",
        "driver_version": "570.158.01",
        "message": LOADED,
        "source": "kmsg",
        "boot_id": boot,
    }


def healthy(e: EngineFacade, ts: int, g: int = 0, *, host: str = "node-a", uuid: str | None = None) -> None:
    """A healthy whole-GPU sample of GPU ``g`` at ``ts`` (what the service hands the engine per sample)."""
    ident = GpuIdentity(host, alert_device_key(f"0000:{0x18 + 16 * g:02x}:00"), uuid or f"GPU-{g}", g)
    e.sample_seen(ident, ts, True, ts)


def state(e: EngineFacade, now: int) -> dict[int, tuple[str, str | None]]:
    """code -> (status, resolve_reason) of the latest revision per alert."""
    out = {}
    for a in e.take(now):
        r = to_record(a, now)
        out[r["xid_codes"][0]] = (r["status"], r["resolve_reason"])
    return out


def test_an_event_under_a_new_boot_id_resolves_reboot_class_alerts():
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)  # RESTART_BM: stays firing until a reboot
    e.on_xid(xid(95, T0 + S, g=1), T0 + S)  # RESET_GPU
    assert state(e, T0 + S) == {79: ("firing", None), 95: ("firing", None)}
    later = T0 + 3 * 60 * MIN  # hours of silence: still firing (sticky)
    e.tick(later)
    assert state(e, later) == {}
    # the node rebooted: the first thing the agent reports from the new boot is the driver's load line
    e.on_xid(driver_loaded(later + MIN, boot="boot-B"), later + MIN)
    pending = {a.codes[0]: a.pending for a in e.take(later + MIN)}  # until the GPUs show up
    assert {c: (p.evidence, p.since_ms) for c, p in pending.items() if p} == {
        79: ("reboot", later + MIN),
        95: ("reboot", later + MIN),
    }
    healthy(e, later + 2 * MIN, g=0)
    healthy(e, later + 2 * MIN, g=1)
    got = {a.codes[0]: a for a in e.take(later + 2 * MIN)}
    assert {c: (a.status, a.resolve_reason) for c, a in got.items()} == {
        79: ("resolved", "recovered"),
        95: ("resolved", "recovered"),
    }
    assert "rebooted (boot id boot-A -> boot-B)" in got[79].description
    assert e.open_alerts() == []  # the load line itself raises nothing


def test_a_driver_reload_resolves_reset_class_alerts_but_not_a_gpu_that_fell_off_the_bus():
    """NVSentinel#155: the GPU fell off the bus, the probe failed, the module loaded again: the 79 stays."""
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)  # RESTART_BM
    e.on_xid(xid(95, T0 + 2 * MIN, g=1), T0 + 2 * MIN)  # RESET_GPU (minutes apart: no node storm)
    e.on_xid(xid(13, T0 + 4 * MIN, g=2), T0 + 4 * MIN)  # application fault
    e.take(T0 + 4 * MIN)
    e.on_xid(driver_loaded(T0 + 10 * MIN), T0 + 10 * MIN)  # same boot: a driver reload
    assert {a.codes[0]: a.status for a in e.take(T0 + 10 * MIN)} == {13: "resolved", 95: "firing"}
    for g in (0, 1):  # every GPU answers again after the load, the one that fell off the bus too
        healthy(e, T0 + 11 * MIN, g=g)
    got = {a.codes[0]: a for a in e.take(T0 + 11 * MIN)}
    assert {c: (a.status, a.resolve_reason) for c, a in got.items()} == {95: ("resolved", "recovered")}
    assert f"the NVIDIA driver was loaded again (kernel log: {LOADED})" in got[95].description
    assert [a.codes[0] for a in e.open_alerts()] == [79]


def test_evidence_is_no_evidence_for_faults_after_it_or_on_other_nodes():
    e = EngineFacade(EngineConfig())
    e.on_xid(driver_loaded(T0), T0)
    e.on_xid(xid(95, T0 + S), T0 + S)  # after the reload: a new fault
    e.on_xid(xid(95, T0 + S, host="node-b", boot="boot-X"), T0 + S)
    e.on_xid(driver_loaded(T0 + 2 * S, host="node-c", boot="boot-C"), T0 + 2 * S)
    e.on_xid(xid(13, T0 + 3 * S, g=2, boot="boot-B"), T0 + 3 * S)  # node-a rebooted, a later fault
    assert sorted((a.hostname, a.codes[0], a.pending is not None) for a in e.open_alerts()) == [
        ("node-a", 13, False),
        ("node-a", 95, True),
        ("node-b", 95, False),
    ]
    # node-a's 95 was raised under boot-A before the boot-B event: over once the GPU shows up after it
    healthy(e, T0 + 2 * S)  # before the reboot: no evidence
    healthy(e, T0 + 2 * S, host="node-b")  # another node's GPU
    assert len(e.open_alerts()) == 3
    healthy(e, T0 + 4 * S)
    assert sorted((a.hostname, a.codes[0]) for a in e.open_alerts()) == [("node-a", 13), ("node-b", 95)]
    assert e.counts["reboots_seen"] == 1 and e.counts["driver_loads"] == 2


def test_a_reboot_while_the_alerts_service_was_down_is_seen_after_restore():
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)
    published = [to_record(a, T0) for a in e.take(T0)]
    assert published[0]["boot_id"] == "boot-A"
    e2 = EngineFacade(EngineConfig())  # redeployed; the node rebooted meanwhile
    e2.restore(published, T0 + 30 * MIN)
    assert [a.codes[0] for a in e2.open_alerts()] == [79]
    e2.on_xid(driver_loaded(T0 + 40 * MIN, boot="boot-B"), T0 + 40 * MIN)
    healthy(e2, T0 + 41 * MIN)
    assert e2.open_alerts() == []
    # an event of the same boot after a restart is no evidence
    e3 = EngineFacade(EngineConfig())
    e3.restore(published, T0 + 30 * MIN)
    e3.on_xid(xid(13, T0 + 40 * MIN, g=2), T0 + 40 * MIN)
    assert sorted(a.codes[0] for a in e3.open_alerts()) == [13, 79]


def test_a_fault_back_after_the_reboot_is_a_recurrence():
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0), T0)
    e.take(T0)
    e.on_xid(driver_loaded(T0 + 20 * MIN, boot="boot-B"), T0 + 20 * MIN)
    a = e.on_xid(xid(79, T0 + 2 * 60 * MIN, boot="boot-B"), T0 + 2 * 60 * MIN)
    assert a is not None and (a.rule, a.action) == ("xid79.recurring", "CONTACT_SUPPORT")
    assert a.boot_id == "boot-B"


def test_events_without_a_boot_id_are_no_reboot_evidence():
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, T0, boot=None), T0)
    e.on_xid(xid(13, T0 + MIN, g=2, boot="boot-B"), T0 + MIN)  # unknown boot of the 79: keep it
    assert sorted(a.codes[0] for a in e.open_alerts()) == [13, 79]
