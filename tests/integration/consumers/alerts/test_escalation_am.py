"""An escalating alert as a pager sees it: the real Alertmanager with the shipped config, a webhook receiver.

A contained ECC error (Xid 94, warning) whose row remapping then fails (Xid 64 on the same GPU) is one
incident that escalates to critical. Its Alertmanager labels change with the severity, so the sender
keeps the warning label set firing beside the critical one until the incident ends, and the shipped
inhibit rules keep that earlier set quiet. What the receivers must get: the warning page, then the
critical page on the critical route, no RESOLVED and no second page while the GPU is broken, and one
RESOLVED on each route when the incident ends.

The engine runs in process with real time (Alertmanager compares times with its own clock); its
records go through the real :class:`~gpupipe.clients.alertmanager.AlertmanagerSender` and its thread. The
config is ``deploy/alertmanager/alertmanager.yml`` with its routes' timers shortened and both receivers
pointed at the webhook; the repeat intervals stay as shipped, so any second page here is a defect.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe_consumers.alerts.am_shape import am_labels, gpu_alert_shape
from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from tests.am_webhook import Notification, WebhookReceiver
from tests.integration.consumers.alerts.test_inhibition import xid
from tests.integration.consumers.alerts.test_service import Alertmanager, wait_until
from tests.integration.kafka_util import REPO

pytestmark = pytest.mark.integration

S = 1000
CONTAINED = "Contained: SM (0x1). RST: No, D-RST: No"
CRITICAL, DEFAULT = "/critical", "/default"


@pytest.fixture
def pager(tmp_path: Path) -> Iterator[tuple[Alertmanager, WebhookReceiver]]:
    with WebhookReceiver() as hook:
        cfg = yaml.safe_load((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
        for route in [cfg["route"], *cfg["route"].get("routes", [])]:
            route["group_wait"] = "1s"
            route["group_interval"] = "1s"
        paths = {"default": DEFAULT, "gpu-critical": CRITICAL}
        cfg["receivers"] = [
            {"name": name, "webhook_configs": [{"url": hook.url(path), "send_resolved": True}]}
            for name, path in paths.items()
        ]
        am = Alertmanager(tmp_path)
        (am.dir / "am.yml").write_text(yaml.safe_dump(cfg))
        am.start()
        try:
            yield am, hook
        finally:
            am.stop()


def _seen(ns: list[Notification], path: str, status: str, severity: str, code: str) -> bool:
    return any(
        a["labels"]["severity"] == severity and a["labels"].get("xid") == code
        for n in ns
        if n.path == path
        for a in n.alerts(status)
    )


def _feed(e: EngineFacade, sender: AlertmanagerSender, now: int) -> list[dict[str, Any]]:
    e.tick(now)
    recs = [to_record(a, now) for a in e.take(now)]
    for r in recs:
        sender.update(r)
    return recs


def test_an_escalation_pages_once_per_route_and_resolves_only_at_the_end(
    pager: tuple[Alertmanager, WebhookReceiver],
) -> None:
    am, hook = pager
    e = EngineFacade(EngineConfig())
    sender = AlertmanagerSender(am.url, shape=gpu_alert_shape, resend_interval_ms=S, batch_delay_s=0.05)
    sender.start()
    try:
        now = int(time.time() * 1000)
        e.on_xid(xid(94, now, "node-e", 0, pid=7, msg=CONTAINED), now)
        (warning,) = _feed(e, sender, now)
        assert (warning["severity"], warning["status"]) == ("warning", "firing")
        hook.wait_for(lambda ns: _seen(ns, DEFAULT, "firing", "warning", "94"), 20, "the warning page")

        now = int(time.time() * 1000)
        e.on_xid(xid(64, now, "node-e", 0, msg="Row remapping failed"), now)
        (critical,) = _feed(e, sender, now)
        assert critical["alert_id"] == warning["alert_id"] and critical["severity"] == "critical"
        assert am_labels(critical) != am_labels(warning)  # a second label set, routed critical
        hook.wait_for(lambda ns: _seen(ns, CRITICAL, "firing", "critical", "94"), 20, "the critical page")

        # Alertmanager still holds the warning set, inhibited by the critical one: the incident is open
        # under both (a warning set sent resolved would leave the API and UI saying it is over).
        def states() -> dict[str, str] | None:
            got = {a["labels"]["severity"]: a["status"]["state"] for a in am.alerts()}
            return got if got == {"warning": "suppressed", "critical": "active"} else None

        wait_until(states, 20, "the warning set suppressed under the critical one")

        # A flush of the warning route's group after the escalation: an application fault on another
        # GPU of the node joins that group and is notified on its own, without the escalated set.
        now = int(time.time() * 1000)
        e.on_xid(xid(13, now, "node-e", 3, pid=9, msg="Graphics SM Warp Exception"), now)
        (app,) = _feed(e, sender, now)
        assert app["severity"] == "warning" and app["cause_class"] == "application"
        flushed = hook.wait_for(lambda ns: _seen(ns, DEFAULT, "firing", "warning", "13"), 20, "Xid 13's page")
        assert [n for n in flushed if n.alerts("resolved")] == []  # no RESOLVED while the GPU is broken
        canary = next(n for n in flushed if _seen([n], DEFAULT, "firing", "warning", "13"))
        assert [a["labels"].get("xid") for a in canary.alerts()] == ["13"]  # the warning set stays quiet

        ended_at = time.monotonic()
        assert e.acknowledge(warning["alert_id"], int(time.time() * 1000), "GPU replaced") is not None
        _feed(e, sender, int(time.time() * 1000))

        def both_resolved(ns: list[Notification]) -> bool:
            critical_done = _seen(ns, CRITICAL, "resolved", "critical", "94")
            return critical_done and _seen(ns, DEFAULT, "resolved", "warning", "94")

        got = hook.wait_for(both_resolved, 20, "RESOLVED on both routes")
    finally:
        sender.stop()

    def told(path: str) -> list[tuple[str, str, str]]:
        return [
            (a["status"], a["labels"]["severity"], a["labels"].get("xid", ""))
            for n in got
            if n.path == path
            for a in n.alerts()
            if a["labels"].get("pci_bus_id") == warning["pci_bus_id"]
        ]

    # one page per route and one RESOLVED each, the RESOLVED only after the incident ended
    assert told(CRITICAL) == [("firing", "critical", "94"), ("resolved", "critical", "94")]
    assert told(DEFAULT) == [("firing", "warning", "94"), ("resolved", "warning", "94")]
    assert all(n.received_s >= ended_at for n in got for a in n.alerts("resolved"))
