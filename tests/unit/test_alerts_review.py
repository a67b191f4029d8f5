"""Findings of the alerts review (``alerts-review.md``, D1-D17), each reproduced at the engine level.

Every test here failed on the reviewed commit (586e909) and names its finding. Real-service counterparts
(Alertmanager, Kafka, the CLI) are in ``tests/integration/test_alerts_inhibition.py`` and
``tests/integration/test_alerts_review_service.py``.
"""

from __future__ import annotations

from typing import Any

from consumers.alerts.alert_record import to_record
from consumers.alerts.dedupe import AlertEngine, EngineConfig

T0 = 1_800_000_000_000
S = 1000
MIN = 60 * S
BUS = [f"0000:{0x18 + 16 * g:02x}:00" for g in range(8)]
_n = 0


def xid(
    code: int | None,
    ts: int,
    host: str = "node-a",
    g: int = 0,
    *,
    pid: int | None = None,
    msg: str = "",
    pod: str = "train-0",
    kind: str = "xid",
    uuid: str | None = None,
) -> dict[str, Any]:
    global _n
    _n += 1
    return {
        "event_id": f"{host}|{g}|{code}|{ts}|{_n}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": kind,
        "xid": code,
        "pci_bus_id": BUS[g],
        "uuid": uuid,
        "gpu_index": g,
        "pid": pid,
        "process_name": "python3" if pid else None,
        "message": msg,
        "source": "kmsg",
        "allocations": [{"namespace": "ml", "pod": pod, "container": "main"}] if pod else [],
    }


def records(e: AlertEngine, now: int) -> list[dict[str, Any]]:
    return [to_record(a, now) for a in e.take(now)]


# ------------------------------------------------------------------------------------------- D1


def test_d1_job_kill_on_8_gpus_opens_no_node_storm() -> None:
    e = AlertEngine(EngineConfig())
    for g in range(8):
        e.on_xid(xid(45, T0 + g, g=g, pid=100 + g), T0 + g)
    e.on_xid(xid(79, T0 + 500, g=5, msg="GPU has fallen off the bus."), T0 + 500)
    out = records(e, T0 + S)
    assert not [r for r in out if r["scope"] == "node"]
    r79 = next(r for r in out if r["xid_codes"][0] == 79)
    assert r79["parent_alert_id"] is None and r79["severity"] == "critical"


def test_d1_xid43_on_three_gpus_is_no_burst_but_hardware_faults_are() -> None:
    e = AlertEngine(EngineConfig())
    for g in range(3):
        e.on_xid(xid(43, T0 + g, g=g, pid=10 + g), T0 + g)
    assert not [r for r in records(e, T0 + S) if r["scope"] == "node"]
    for g in range(3, 6):
        e.on_xid(xid(79, T0 + 2 * S + g, g=g), T0 + 2 * S + g)
    node = [r for r in records(e, T0 + 3 * S) if r["scope"] == "node"]
    assert len(node) == 1 and node[0]["severity"] == "critical" and len(node[0]["gpus"]) == 3


# ------------------------------------------------------------------------------------------- D8


def test_d8_uuid_and_pod_found_later_keep_the_alertmanager_identity() -> None:
    from consumers.alerts.alert_record import am_labels

    e = AlertEngine(EngineConfig(update_interval_ms=0))
    e.on_xid(xid(95, T0, pod="", msg="Uncontained: FBHUB. RST: Yes, D-RST: No"), T0)
    first = records(e, T0)[0]
    e.on_xid(xid(95, T0 + 5 * S, uuid="GPU-1111", pod="train-0", msg="Uncontained: FBHUB."), T0 + 5 * S)
    second = records(e, T0 + 5 * S)[0]
    assert first["alert_id"] == second["alert_id"] and second["gpu_uuid"] == "GPU-1111"
    assert am_labels(first) == am_labels(second)  # no spurious RESOLVED, silences keep matching
