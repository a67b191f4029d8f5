"""The alert engine: dedupe, lifecycle, node bursts, bad input, restore (pure; time is injected)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_consumers.alerts.engine.alert_record import alert_id, to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import GpuIdentity, InvalidRecord, SignalEvent

T0 = 1_800_000_000_000
S = 1000
MIN = 60 * S
BUS = ["0000:18:00", "0000:28:00", "0000:38:00", "0000:48:00"]
MSG = {
    79: "GPU has fallen off the bus.",
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
}
_n = 0


def xid(
    code: int | None = 79,
    ts: int = T0,
    host: str = "node-a",
    bus: str = BUS[0],
    *,
    eid: str | None = None,
    source: str = "kmsg",
    kind: str = "xid",
    uuid: str | None = None,
    pid: int | None = None,
    message: str | None = None,
    pods: tuple[tuple[str, str], ...] = (("team-a", "train-0"),),
) -> dict[str, Any]:
    global _n
    _n += 1
    return {
        "event_id": eid or f"{host}|{source}|{bus}|{code}|{ts}|{_n}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": kind,
        "xid": code,
        "pci_bus_id": bus,
        "gpu_index": None,
        "uuid": uuid,
        "model_name": None,
        "driver_version": None,
        "pid": pid,
        "process_name": "python3" if pid else None,
        "message": MSG.get(code or 0, "some text") if message is None else message,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": source,
        "allocations": [{"namespace": n, "pod": p, "container": "main"} for n, p in pods],
    }


def engine(**kw: Any) -> EngineFacade:
    kw.setdefault("update_interval_ms", 30 * S)
    return EngineFacade(EngineConfig(**kw))


def records(e: EngineFacade, now: int) -> list[dict[str, Any]]:
    return [to_record(a, now) for a in e.take(now)]


def test_repeats_fold_into_one_alert_with_a_count() -> None:
    e = engine()
    for i in range(5):
        e.on_xid(xid(79, T0 + i * S), T0 + i * S)
    out = records(e, T0 + 5 * S)
    assert len(out) == 1
    r = out[0]
    assert r["status"] == "firing" and r["sequence"] == 1 and r["occurrences"] == 5
    assert r["alertname"] == "GpuXidError" and r["xid_codes"][0] == 79
    assert r["severity"] == "critical" and r["drain_node"] is True and r["action"] == "RESTART_BM"
    assert r["first_seen_ms"] == T0 and r["last_seen_ms"] == T0 + 4 * S
    assert r["pci_bus_id"] == "0000:18:00.0"
    assert r["allocations"] == [{"namespace": "team-a", "pod": "train-0", "container": "main"}]
    assert r["message"] == MSG[79]


def test_updates_are_throttled_but_escalations_are_not() -> None:
    e = engine(update_interval_ms=30 * S)
    e.on_xid(xid(13, T0, pid=1), T0)
    assert [r["sequence"] for r in records(e, T0)] == [1]
    e.on_xid(xid(13, T0 + S, pid=1), T0 + S)
    assert records(e, T0 + S) == []  # count change only: throttled
    assert records(e, T0 + 20 * S) == []
    later = records(e, T0 + 31 * S)
    assert len(later) == 1 and later[0]["occurrences"] == 2 and later[0]["sequence"] == 2
    # XID 13 from 3 distinct workloads on one GPU -> hardware suspicion: escalates immediately
    e.on_xid(xid(13, T0 + 32 * S, pid=2, pods=(("team-b", "eval-0"),)), T0 + 32 * S)
    e.on_xid(xid(13, T0 + 33 * S, pid=3, pods=(("team-c", "infer-0"),)), T0 + 33 * S)
    esc = records(e, T0 + 33 * S)
    assert len(esc) == 1 and esc[0]["sequence"] == 3
    assert esc[0]["rule"] == "app_fault.repeat_distinct_workloads"
    assert (esc[0]["severity"], esc[0]["action"], esc[0]["cause_class"]) == (
        "warning",
        "RUN_DCGMEUD",
        "hardware_memory",
    )
    assert esc[0]["occurrences"] == 4


def test_resolves_after_quiet_and_final_record_carries_counts() -> None:
    e = engine(resolve_after_ms=30 * MIN)  # Xid 13: application class, expires by quiet time
    e.on_xid(xid(13, T0), T0)
    e.on_xid(xid(13, T0 + S), T0 + S)
    first = records(e, T0 + S)
    e.tick(T0 + S + 30 * MIN - 1)
    assert records(e, T0 + S + 30 * MIN - 1) == [] and len(e.open_alerts()) == 1  # not yet
    e.tick(T0 + S + 30 * MIN)
    out = records(e, T0 + S + 30 * MIN)
    assert [r["status"] for r in out] == ["resolved"]
    r = out[0]
    assert r["alert_id"] == first[0]["alert_id"] and r["resolve_reason"] == "quiet"
    assert r["occurrences"] == 2 and r["resolved_at_ms"] == T0 + S + 30 * MIN
    assert e.open_alerts() == []


def test_recurrence_after_dedupe_window_supersedes() -> None:
    # another job's occurrence is another incident (the same job's continues the alert: test_alerts_pages)
    e = engine(dedupe_window_ms=10 * MIN, resolve_after_ms=30 * MIN)
    e.on_xid(xid(31, T0, pid=7), T0)
    a = records(e, T0)[0]
    e.on_xid(xid(31, T0 + 15 * MIN, pid=8, pods=(("team-b", "serve-0"),)), T0 + 15 * MIN)
    out = records(e, T0 + 15 * MIN)
    assert [(r["status"], r["resolve_reason"]) for r in out] == [("resolved", "superseded"), ("firing", None)]
    assert out[0]["alert_id"] == a["alert_id"] and out[1]["alert_id"] != a["alert_id"]


def test_a_recurrence_without_a_recovery_attempt_continues_a_sticky_alert() -> None:
    # The GPU fell off the bus and nothing reset it: another job's Xid 79 is the same broken GPU. The
    # alert goes on (no RESOLVED, no second page) and stays what it was: no reboot was tried, so none
    # failed (escalated to support, the reboot that mends the GPU could not end it).
    e = engine(dedupe_window_ms=10 * MIN, resolve_after_ms=30 * MIN)
    e.on_xid(xid(79, T0), T0)
    a = records(e, T0)[0]
    e.on_xid(xid(79, T0 + 15 * MIN, pods=(("team-b", "serve-0"),)), T0 + 15 * MIN)
    out = records(e, T0 + 15 * MIN)
    assert [(r["alert_id"], r["status"], r["occurrences"]) for r in out] == [(a["alert_id"], "firing", 2)]
    assert (out[0]["rule"], out[0]["action"]) == ("xid79", "RESTART_BM")


def test_reopen_when_resolve_after_is_shorter_than_dedupe_window() -> None:
    e = engine(dedupe_window_ms=10 * MIN, resolve_after_ms=2 * MIN)
    e.on_xid(xid(13, T0), T0)
    aid = records(e, T0)[0]["alert_id"]
    e.tick(T0 + 2 * MIN)
    assert [r["status"] for r in records(e, T0 + 2 * MIN)] == ["resolved"]
    e.on_xid(xid(13, T0 + 5 * MIN), T0 + 5 * MIN)
    out = records(e, T0 + 5 * MIN)
    assert [(r["status"], r["alert_id"], r["sequence"]) for r in out] == [("firing", aid, 3)]
    assert out[0]["occurrences"] == 2 and out[0]["resolved_at_ms"] is None
    e.tick(T0 + 30 * MIN)
    records(e, T0 + 30 * MIN)
    e.on_xid(xid(13, T0 + 40 * MIN), T0 + 40 * MIN)
    assert records(e, T0 + 40 * MIN)[0]["alert_id"] != aid  # past the window: a new alert


def test_duplicate_event_ids_are_not_counted() -> None:
    e = engine()
    ev = xid(79, T0, eid="fixed-id")
    for _ in range(3):
        e.on_xid(dict(ev), T0)
    assert records(e, T0)[0]["occurrences"] == 1
    assert e.counts["duplicate_event_id"] == 2


def test_nvml_and_kmsg_sightings_of_one_xid_count_once() -> None:
    e = engine()
    e.on_xid(xid(95, T0, source="nvml", message="", uuid="GPU-1", bus="00000000:18:00.0"), T0)
    e.on_xid(xid(95, T0 + 300, source="kmsg", bus="0000:18:00"), T0 + 300)
    out = records(e, T0 + 300)
    assert len(out) == 1
    r = out[0]
    assert r["occurrences"] == 1 and e.counts["double_sighting"] == 1
    assert r["gpu_uuid"] == "GPU-1"  # from NVML
    assert r["message"] == MSG[95]  # from the kernel log
    # a third sighting from a source is a new occurrence
    e.on_xid(xid(95, T0 + 600, source="kmsg", bus="0000:18:00"), T0 + 600)
    e.tick(T0 + 40 * S)
    assert records(e, T0 + 40 * S)[0]["occurrences"] == 2


def test_unknown_code_gets_safe_default_and_flag() -> None:
    e = engine()
    e.on_xid(xid(4242, T0), T0)
    r = records(e, T0)[0]
    assert r["known"] is False and r["severity"] == "warning" and r["action"] == "CONTACT_SUPPORT"
    assert r["drain_node"] is False and r["cause_class"] == "unknown" and r["xid_codes"] == [4242]


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("xid", None),
        ("weird-future-kind", 12),
        ("unknown", None),
        ("fallen_off_bus", None),
        ("gpu_lost", None),
    ],
)
def test_odd_kinds_never_crash(kind: str, code: int | None) -> None:
    e = engine()
    e.on_xid(xid(code, T0, kind=kind), T0)
    out = records(e, T0)
    assert len(out) == 1
    if kind in ("fallen_off_bus", "gpu_lost"):
        assert out[0]["xid_codes"][0] == 79 and out[0]["drain_node"]
    else:
        assert out[0]["known"] is False and out[0]["drain_node"] is False
        assert (out[0]["severity"], out[0]["action"]) == ("warning", "CONTACT_SUPPORT")


def test_missing_host_or_time_is_invalid() -> None:
    e = engine()
    bad = xid(79, T0)
    bad["hostname"] = ""
    bad2 = xid(79, T0)
    bad2["timestamp_ms"] = None
    for ev in (bad, bad2):
        with pytest.raises(InvalidRecord):
            e.on_xid(ev, T0)
    assert e.counts["invalid"] == 2 and records(e, T0) == []


def test_clocks_out_of_order_and_in_the_future() -> None:
    e = engine()
    e.on_xid(xid(79, T0 + 10 * S), T0 + 10 * S)
    e.on_xid(xid(79, T0), T0 + 11 * S)  # late, older than the first
    e.on_xid(xid(79, T0 + 10 * 365 * 24 * 60 * MIN), T0 + 12 * S)  # node clock years ahead
    r = records(e, T0 + 12 * S)[0]
    assert r["first_seen_ms"] == T0 and r["last_seen_ms"] == T0 + 12 * S and r["occurrences"] == 3
    assert e.counts["clock_future"] == 1


def test_old_event_fires_and_quiet_is_counted_from_processing_time() -> None:
    e = engine(resolve_after_ms=30 * MIN)
    now = T0 + 5 * 60 * MIN
    e.on_xid(xid(13, T0), now)  # five hours late
    assert records(e, now)[0]["status"] == "firing"
    e.tick(now + S)
    assert records(e, now + S) == []  # not born resolved
    e.tick(now + 30 * MIN)
    assert [r["status"] for r in records(e, now + 30 * MIN)] == ["resolved"]


def test_kernel_and_nvml_bus_id_forms_are_one_gpu() -> None:
    e = engine()
    e.on_xid(xid(79, T0, bus="0000:3b:00", source="kmsg"), T0)
    e.on_xid(xid(79, T0 + 5 * S, bus="00000000:3B:00.0", source="nvml"), T0 + 5 * S)
    assert len(e.open_alerts()) == 1


def test_node_burst_rolls_up_with_per_gpu_detail() -> None:
    e = engine(node_burst_gpus=3, node_burst_window_ms=MIN)
    for i, bus in enumerate(BUS):
        e.on_xid(xid(13, T0 + i * S, bus=bus, pid=100 + i), T0 + i * S)
    e.on_xid(xid(79, T0 + 5 * S, bus=BUS[0]), T0 + 5 * S)
    out = records(e, T0 + 5 * S)
    nodes = [r for r in out if r["scope"] == "node"]
    gpus = [r for r in out if r["scope"] == "gpu"]
    assert len(nodes) == 1 and len(gpus) == 5  # one per (GPU, XID)
    node = nodes[0]
    assert node["alertname"] == "GpuNodeXidStorm" and node["gpus"] and len(node["gpus"]) == 4
    assert node["xid_codes"] == [13, 79]
    assert node["severity"] == "critical" and node["drain_node"] is True  # worst member (79)
    assert node["pci_bus_id"] is None and node["gpu_uuid"] is None
    e.tick(T0 + 40 * S)
    later = {r["alert_id"]: r for r in records(e, T0 + 40 * S)}
    for g in gpus:
        current = later.get(g["alert_id"], g)
        assert current["parent_alert_id"] == node["alert_id"]


def test_two_gpus_are_not_a_burst_and_other_nodes_do_not_count() -> None:
    e = engine(node_burst_gpus=3)
    e.on_xid(xid(13, T0, bus=BUS[0]), T0)
    e.on_xid(xid(13, T0, bus=BUS[1]), T0)
    e.on_xid(xid(13, T0, host="node-b", bus=BUS[2]), T0)
    e.on_xid(xid(13, T0 + 2 * MIN, bus=BUS[2]), T0 + 2 * MIN)  # outside the 60 s window
    assert all(r["scope"] == "gpu" for r in records(e, T0 + 2 * MIN))


def test_a_late_event_is_not_grouped_with_faults_an_hour_later() -> None:
    # Two GPUs fail now; an event an hour old arrives afterwards (a late record): not a node burst.
    e = engine(node_burst_gpus=3, node_burst_window_ms=MIN)
    now = T0 + 3600 * S
    e.on_xid(xid(13, now, bus=BUS[0], pid=1), now)
    e.on_xid(xid(31, now, bus=BUS[1], pid=2), now)
    e.on_xid(xid(13, T0, bus=BUS[2], pid=3), now)
    assert all(r["scope"] == "gpu" for r in records(e, now))
    # ...while a third GPU within the window does make one.
    e.on_xid(xid(13, now + 10 * S, bus=BUS[3], pid=4), now + 10 * S)
    assert [r["scope"] for r in records(e, now + 10 * S)].count("node") == 1


def test_storm_gives_one_alert_per_gpu_and_code() -> None:
    e = engine()
    codes = (13, 31, 79)
    n = 0
    for rep in range(10):
        for node in range(4):
            for g in range(8):
                code = codes[(g + rep) % 3]
                e.on_xid(xid(code, T0 + rep, host=f"n{node}", bus=f"0000:{0x18 + 16 * g:02x}:00"), T0 + 1000)
                n += 1
    out = records(e, T0 + 1000)
    ids = {r["alert_id"] for r in out}
    assert len(ids) == len(out)
    gpu = [r for r in out if r["scope"] == "gpu"]
    keys = {(r["hostname"], r["pci_bus_id"], r["xid_codes"][0]) for r in gpu}
    assert len(keys) == len(gpu) == 4 * 8 * 3
    assert len([r for r in out if r["scope"] == "node"]) == 4


def test_alert_ids_are_stable_and_deterministic() -> None:
    evs = [xid(79, T0 + i * S, eid=f"e{i}") for i in range(3)]
    ids = []
    for _ in range(2):
        e = engine()
        for ev in evs:
            e.on_xid(dict(ev), T0 + 5 * S)
        ids.append(records(e, T0 + 5 * S)[0]["alert_id"])
    assert ids[0] == ids[1] == alert_id("gpu", "node-a", "0000:18:00.0", "xid:79", "e0")


def test_restore_continues_open_alerts_with_same_id_and_sequence() -> None:
    e = engine()
    e.on_xid(xid(13, T0, eid="x1"), T0)
    e.on_xid(xid(13, T0, bus=BUS[1], eid="x2"), T0)
    published = records(e, T0)
    e.tick(T0 + 31 * MIN)
    published += records(e, T0 + 31 * MIN)  # both resolved
    e.on_xid(xid(79, T0 + 32 * MIN, eid="x3"), T0 + 32 * MIN)
    published += records(e, T0 + 32 * MIN)
    open_id = published[-1]["alert_id"]

    fresh = engine()
    assert fresh.restore(published, T0 + 33 * MIN) == 1
    fresh.on_xid(xid(79, T0 + 33 * MIN, eid="x3"), T0 + 33 * MIN)  # replayed after the restart: ignored
    assert fresh.counts["duplicate_event_id"] == 1
    fresh.on_xid(xid(79, T0 + 34 * MIN, eid="x4"), T0 + 34 * MIN)
    fresh.tick(T0 + 40 * MIN)
    out = records(fresh, T0 + 40 * MIN)
    assert [(r["alert_id"], r["sequence"], r["occurrences"]) for r in out] == [(open_id, 2, 2)]


def test_restore_of_duplicate_open_keys_keeps_newest() -> None:
    e = engine()
    e.on_xid(xid(79, T0, eid="a"), T0)
    old = records(e, T0)[0]
    newer = dict(old, alert_id="b" * 24, first_seen_ms=T0 + MIN, last_seen_ms=T0 + MIN)
    fresh = engine()
    assert fresh.restore([old, newer], T0 + 2 * MIN) == 1
    out = records(fresh, T0 + 2 * MIN)
    assert [(r["alert_id"], r["status"], r["resolve_reason"]) for r in out] == [
        (old["alert_id"], "resolved", "superseded")
    ]


def ident(device: str = "0000:18:00.0") -> GpuIdentity:
    return GpuIdentity("node-a", device, uuid="GPU-1", gpu_index=0, model_name="NVIDIA H200")


def test_level_signal_fires_refreshes_and_clears() -> None:
    e = engine()
    for i in range(3):
        e.on_signal(
            ident(), SignalEvent("row_remap_pending", "active", T0 + i * S, since_ms=T0 + i * S), T0 + i * S
        )
    out = records(e, T0 + 3 * S)
    assert len(out) == 1 and out[0]["alertname"] == "GpuRowRemapPending" and out[0]["occurrences"] == 1
    assert out[0]["gpu_uuid"] == "GPU-1" and out[0]["first_seen_ms"] == T0
    e.on_signal(ident(), SignalEvent("row_remap_pending", "clear", T0 + 4 * S), T0 + 4 * S)
    done = records(e, T0 + 4 * S)
    assert [(r["status"], r["resolve_reason"], r["last_seen_ms"]) for r in done] == [
        ("resolved", "cleared", T0 + 2 * S)
    ]


def test_gpu_lost_sample_folds_into_the_xid79_alert() -> None:
    e = engine()
    e.on_xid(xid(79, T0, bus="0000:18:00"), T0)
    e.on_signal(ident(), SignalEvent("gpu_lost", "occurrence", T0 + 500), T0 + 500)
    e.on_signal(ident(), SignalEvent("gpu_lost", "active", T0 + 1500), T0 + 1500)
    out = records(e, T0 + 2000)
    assert len(out) == 1 and out[0]["xid_codes"][0] == 79
    assert out[0]["occurrences"] == 2 and out[0]["last_seen_ms"] == T0 + 1500


def test_recovery_action_signal_maps_value_to_action() -> None:
    e = engine()
    e.on_signal(ident(), SignalEvent("recovery_action", "active", T0, since_ms=T0, value=2), T0)
    r = records(e, T0)[0]
    assert r["action"] == "RESTART_BM" and r["drain_node"] is True and r["severity"] == "critical"


@pytest.mark.parametrize(
    "kw",
    [
        {"dedupe_window_ms": 0},
        {"resolve_after_ms": -1},
        {"node_burst_gpus": 1},
        {"update_interval_ms": -5},
        {"event_id_memory": 0},
    ],
)
def test_config_validation(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kw)


def test_event_id_memory_is_bounded() -> None:
    e = engine(event_id_memory=10)
    for i in range(50):
        e.on_xid(xid(13, T0 + i, eid=f"id{i}"), T0 + i)
    assert e.guard.remembered() == 10


def test_force_take_publishes_throttled_changes() -> None:
    e = engine(update_interval_ms=60 * S)
    e.on_xid(xid(79, T0), T0)
    records(e, T0)
    e.on_xid(xid(79, T0 + S), T0 + S)
    assert records(e, T0 + S) == []
    out = [to_record(a, T0 + S) for a in e.take(T0 + S, force=True)]
    assert [(r["sequence"], r["occurrences"]) for r in out] == [(2, 2)]
