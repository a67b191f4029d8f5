"""AlertsHandler wiring without Kafka: sink, Alertmanager and cordon hooks, bad input, restore, CLI checks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpupipe.commands.cli import main
from gpupipe_consumers.alerts.cordon import Cordoner
from gpupipe_consumers.alerts.engine.facade import EngineConfig
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet

T0 = 1_800_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> float:
        return self.ms / 1000


class FakeAm:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def update(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)


_OFFSETS = itertools.count()


def inrec(name: str, value: dict[str, Any], offset: int | None = None) -> InRecord:
    """A consumed record; offsets grow as a topic's do (the engine tells replays by position)."""
    topic = "gpu.xid.v1" if name == "XidEvent" else "gpu.samples.v1"
    return InRecord(topic, 0, next(_OFFSETS) if offset is None else offset, None, name, value, T0)


def xid(code: Any, eid: str, host: str = "node-a", bus: str = "0000:18:00", ts: int = T0) -> dict[str, Any]:
    return {
        "event_id": eid,
        "timestamp_ms": ts,
        "hostname": host,
        "kind": "xid",
        "xid": code,
        "pci_bus_id": bus,
        "uuid": None,
        "message": "GPU has fallen off the bus." if code == 79 else "",
        "source": "simulated",
        "allocations": [],
    }


def service(**kw: Any) -> tuple[AlertsHandler, ListSink, Clock]:
    sink, clock = ListSink(), Clock()
    kw.setdefault("engine_config", EngineConfig(update_interval_ms=0))
    svc = AlertsHandler(sink=sink, registry=CollectorRegistry(), clock=clock, instance="t", **kw)
    return svc, sink, clock


def test_handle_publishes_and_feeds_alertmanager_and_cordoner() -> None:
    am = FakeAm()
    results: list[Any] = []
    svc, sink, clock = service(alertmanager=am)
    cordoner = Cordoner(None, dry_run=True, max_per_hour=1, on_result=results.append, clock=clock)
    svc.cordoner = cordoner
    svc.handle([inrec("XidEvent", xid(79, "e1")), inrec("XidEvent", xid(13, "e2", bus="0000:28:00"))])
    assert [r["status"] for r in sink.records] == ["firing", "firing"]
    assert [r["alert_id"] for r in am.records] == [r["alert_id"] for r in sink.records]
    assert cordoner.process(cordoner._queue.get_nowait()).outcome == "dry_run"
    svc.on_cordon_result(results[0])
    action = sink.records[-1]
    assert action["status"] == "action" and action["remediation"]["outcome"] == "dry_run"
    assert action["alert_id"] == sink.records[0]["alert_id"] and action["instance"] == "t"


def test_bad_records_are_skipped_and_counted_not_fatal() -> None:
    svc, sink, _ = service()
    broken = [
        inrec("XidEvent", {"nonsense": True}, 0),
        inrec("XidEvent", xid("seventy-nine", "e1"), 1),
        inrec("XidEvent", {**xid(79, "e2"), "allocations": "not-a-list"}, 2),
        inrec("GpuSample", {"timestamp_ms": "x"}, 3),
        inrec(
            "GpuSample",
            {"hostname": "h", "pci_bus_id": "0000:18:00", "timestamp_ms": T0, "ecc_dbe_volatile_total": "?"},
            4,
        ),
        inrec("XidEvent", xid(79, "e3"), 5),
        inrec("ChargebackWindow", {}, 6),
    ]
    rejected = svc.handle(broken)
    assert [(r.offset, reason) for r, reason, _ in rejected] == [
        (0, "invalid-record"),
        (3, "invalid-record"),
        (6, "unexpected-record-type"),
    ]
    assert svc.errors == 2
    assert not svc.handle(
        [
            inrec(
                "GpuSample",
                {
                    "hostname": "h",
                    "pci_bus_id": "0000:18:00",
                    "timestamp_ms": T0 + 1,
                    "ecc_dbe_volatile_total": 3,
                },
            )
        ]
    )
    assert any(r["xid_codes"][:1] == [79] for r in sink.records)  # the good ones still made it


def test_tick_resolves_and_restore_continues(tmp_path: Any) -> None:
    svc, sink, clock = service(engine_config=EngineConfig(update_interval_ms=0, resolve_after_ms=60_000))
    # Xid 13 (an application fault: expires by quiet time; a 79 would stay until evidence of recovery)
    svc.handle([inrec("XidEvent", xid(13, "e1"))])
    clock.ms = T0 + 50_000
    svc.handle([inrec("XidEvent", xid(13, "e2", bus="0000:28:00", ts=T0 + 50_000))])
    clock.ms = T0 + 60_000
    assert svc.tick() == 1
    assert sink.records[-1]["status"] == "resolved"

    am = FakeAm()
    svc2, sink2, clock2 = service(
        engine_config=EngineConfig(update_interval_ms=0, resolve_after_ms=60_000), alertmanager=am
    )
    clock2.ms = T0 + 61_000
    assert svc2.restore(sink.records) == 1
    assert [r["status"] for r in am.records] == ["firing"]  # Alertmanager learns the open alert again
    svc2.handle([inrec("XidEvent", xid(13, "e3", bus="0000:28:00", ts=T0 + 61_000))])
    last = sink2.records[-1]
    assert (
        last["alert_id"] == sink.records[1]["alert_id"] and last["occurrences"] == 2 and last["sequence"] == 2
    )


def test_simulated_fleet_through_the_service() -> None:
    svc, sink, clock = service()
    fleet = SimulatedFleet(FleetConfig(nodes=4, gpus_per_node=8, xid_rate_per_gpu_hour=600, seed=3))
    off = 0
    for k in range(60):
        samples, xids = fleet.tick(T0 + k * 1000)
        clock.ms = T0 + k * 1000
        batch = [inrec("GpuSample", s, off + i) for i, s in enumerate(samples)]
        batch += [inrec("XidEvent", x, off + len(samples) + i) for i, x in enumerate(xids)]
        off += len(batch)
        svc.handle(batch)
        svc.tick()
    firing = [r for r in sink.records if r["status"] == "firing"]
    assert firing and svc.errors == 0
    keys = {(r["alert_id"]) for r in firing if r["sequence"] == 1}
    assert len(keys) == len([r for r in firing if r["sequence"] == 1])


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--dedupe-window", "0s"], "greater than zero"),
        (["--node-burst-gpus", "1"], "at least 2"),
        (["--cordon-max-per-hour", "-1"], "must not be negative"),
        (["--alertmanager-url", "am:9093"], "http://"),
        (["--cordon"], "--cordon needs the Kubernetes API"),
        (["--cordon-max-share", "0"], "--cordon-max-share"),
        (["--ha", "--ha-session-timeout", "500ms"], "--ha-session-timeout"),
        (["--max-devices", "0"], "--max-nodes, --max-devices, --max-devices-per-node and --max-open-alerts"),
        (["--max-devices-per-node", "0"], "--max-devices-per-node"),
        (["--max-open-alerts", "0"], "--max-open-alerts must be at least 1"),
        (["--node-ca-file", "/nonexistent/ca.crt"], "--node-ca-file /nonexistent/ca.crt: No such file"),
    ],
)
def test_cli_config_errors_exit_2(flags: list[str], needle: str, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc = main(["alerts", *flags, "--bootstrap-servers", "127.0.0.1:1"])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_cli_bad_duration_is_a_usage_error(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["alerts", "--resolve-after", "soon"])
    assert exc.value.code == 2
