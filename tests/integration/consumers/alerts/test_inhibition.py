"""Engine and shipped Alertmanager config agree in a real Alertmanager: rollups (D1), late XIDs (D2).

The engine runs in process (pure, time injected); its records go through the real
:class:`~gpupipe.clients.alertmanager.AlertmanagerSender` to the Debian ``prometheus-alertmanager``
loaded
with ``deploy/alertmanager/alertmanager.yml``: its inhibit rules verbatim, only the route's timers shortened
so that inhibition (which Alertmanager evaluates once a group is flushed) shows within seconds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from tests.integration.consumers.alerts.test_service import Alertmanager, wait_until
from tests.integration.kafka_util import REPO

pytestmark = pytest.mark.integration

T0 = int(time.time() * 1000) - 20 * 60_000  # real time: Alertmanager compares with its clock
S = 1000
MIN = 60 * S
BUS = [f"0000:{0x18 + 16 * g:02x}:00" for g in range(8)]
_n = 0


def xid(code: int, ts: int, host: str, g: int, pid: int | None = None, msg: str = "") -> dict[str, Any]:
    global _n
    _n += 1
    return {
        "event_id": f"{host}|{g}|{code}|{ts}|{_n}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": "xid",
        "xid": code,
        "pci_bus_id": BUS[g],
        "uuid": f"GPU-{host}-{g}",
        "gpu_index": g,
        "pid": pid,
        "process_name": "python3" if pid else None,
        "message": msg,
        "source": "kmsg",
        "allocations": [{"namespace": "ml", "pod": f"job-{host}", "container": "main"}],
    }


@pytest.fixture
def shipped_am(tmp_path: Path) -> Any:
    cfg = yaml.safe_load((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route["group_wait"] = "1s"
        route["group_interval"] = "1s"
    am = Alertmanager(tmp_path)
    (am.dir / "am.yml").write_text(yaml.safe_dump(cfg))
    am.start()
    try:
        yield am
    finally:
        am.stop()


def test_job_kill_and_other_cause_bursts_never_hide_a_critical_page(shipped_am: Alertmanager) -> None:
    e = EngineFacade(EngineConfig())
    # node-a: an 8-GPU job killed (Xid 45 on every GPU), then one GPU falls off the bus 15 min later.
    for g in range(8):
        e.on_xid(xid(45, T0 + g, "node-a", g, pid=100 + g), T0 + g)
    # node-b: one multi-GPU job crashes on 3 GPUs (Xid 13: an application burst, warning) and, 15 min
    # later, another GPU falls off the bus.
    for g in range(3):
        e.on_xid(xid(13, T0 + g, "node-b", g, pid=200 + g), T0 + g)
    # node-c: three GPUs fall off the bus at once (a critical bus burst: inhibition still works).
    for g in range(3):
        e.on_xid(xid(79, T0 + g, "node-c", g), T0 + g)
    late = T0 + 15 * MIN
    for host in ("node-a", "node-b"):
        e.on_xid(xid(79, late, host, 5, msg="GPU has fallen off the bus."), late)
    recs = [to_record(a, late) for a in e.take(late)]
    storms = {r["hostname"]: r for r in recs if r["alertname"] == "GpuNodeXidStorm"}
    assert set(storms) == {"node-b", "node-c"}  # a job kill is no node burst
    assert storms["node-b"]["severity"] == "warning" and storms["node-b"]["cause_class"] == "application"

    sender = AlertmanagerSender(shipped_am.url, shape=gpu_alert_shape, resend_interval_ms=MIN)
    for r in recs:
        sender.update(r)
    assert sender.step()

    def states() -> dict[tuple[str, str, str], str] | None:
        got = shipped_am.alerts()
        if len(got) != len(recs) or any(a["status"]["state"] == "unprocessed" for a in got):
            return None
        return {
            (a["labels"]["node"], a["labels"]["alertname"], a["labels"].get("xid", "")): a["status"]["state"]
            for a in got
            if a["labels"].get("pci_bus_id") in (None, BUS[0] + ".0", BUS[5] + ".0")
        }

    def settled() -> dict[tuple[str, str, str], str] | None:
        s = states()
        # inhibition is applied when the groups are flushed (group_wait 1s): wait for node-c's to show
        return s if s and s.get(("node-c", "GpuXidError", "79")) == "suppressed" else None

    got = wait_until(settled, 20, "Alertmanager to process the alerts")
    assert got[("node-a", "GpuXidError", "79")] == "active"  # D1: was suppressed by the job-kill storm
    assert got[("node-b", "GpuXidError", "79")] == "active"  # warning application burst: other cause
    assert got[("node-b", "GpuXidError", "13")] == "suppressed"  # same cause, same severity: the burst pages
    assert got[("node-b", "GpuNodeXidStorm", "")] == "active"
    assert got[("node-c", "GpuNodeXidStorm", "")] == "active"


def test_a_late_fatal_xid_stays_active_in_alertmanager(shipped_am: Alertmanager) -> None:
    # An Xid 79 processed 35 min after it happened was published firing and resolved one
    # tick later; Alertmanager paged and sent RESOLVED while the GPU was still off the bus.
    now = int(time.time() * 1000)
    e = EngineFacade(EngineConfig())
    e.on_xid(xid(79, now - 35 * MIN, "late-node", 0, msg="GPU has fallen off the bus."), now)
    sender = AlertmanagerSender(shipped_am.url, shape=gpu_alert_shape, resend_interval_ms=MIN)
    for step in (0, S, 31 * MIN):  # the first tick, and past --resolve-after
        e.tick(now + step)
        for a in e.take(now + step):
            sender.update(to_record(a, now + step))
    assert sender.step()
    got = wait_until(shipped_am.alerts, 10, "the alert in Alertmanager")
    assert [(a["labels"]["node"], a["status"]["state"]) for a in got] == [("late-node", "active")]
    assert e.open_alerts() and e.open_alerts()[0].status == "firing"
