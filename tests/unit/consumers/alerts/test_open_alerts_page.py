"""``/alerts`` and ``/alerts.json`` of the alerts service: rendering (escaping, order, the row bound), the
JSON, the snapshot taken beside a busy consume loop, and the page behind the web config's basic auth."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from prometheus_client import CollectorRegistry

from gpupipe.web.server import HttpServer
from gpupipe_consumers.alerts import alerts_page
from gpupipe_consumers.alerts.alerts_page import AlertsPage
from gpupipe_consumers.alerts.engine.alert_record import Alert, to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.alerts.open_alerts_view import (
    MAX_PODS_SHOWN,
    MAX_ROWS,
    render_html,
    render_json,
    view_of,
)
from gpupipe_consumers.plumbing.consume_loop import InRecord

T0 = 1_800_000_000_000
HOSTILE_POD = "<script>alert(1)</script>"
HOSTILE_NODE = 'node-"><img src=x onerror=alert(2)>'


def record(i: int, severity: str = "warning", first_seen_ms: int = T0, **kw: Any) -> dict[str, Any]:
    a = Alert(
        alert_id=f"id{i:05d}",
        key=("gpu", f"node-{i}", f"0000:{i % 256:02x}:00.0", "xid"),
        scope="gpu",
        alertname="GpuXidError",
        signal="xid",
        hostname=f"node-{i}",
        first_seen_ms=first_seen_ms,
        last_seen_ms=first_seen_ms + 1000,
        severity=severity,
        codes=(79,),
        name="GPU has fallen off the bus",
        cause_class="bus",
        action="RESET_GPU",
        nvidia_action="RESET_GPU",
        drain_node=True,
        device=f"0000:{i % 256:02x}:00.0",
        gpu_uuid=f"GPU-{i:04d}",
        gpu_index=i % 8,
        allocations=[("team-a", f"train-{i}", "main")],
        occurrences=3,
    )
    for k, v in kw.items():
        setattr(a, k, v)
    return to_record(a, T0, "t")


def view(records: list[dict[str, Any]], role: str = "single", **kw: Any) -> Any:
    return view_of(records, len(records), instance="it", role=role, taken_at_ms=T0 + 60_000, **kw)


def test_hostile_names_are_escaped_and_no_script_reaches_the_page() -> None:
    rec = record(1, hostname=HOSTILE_NODE, allocations=[("ns", HOSTILE_POD, "c</td>")])
    page = render_html(view([rec]), T0 + 90_000).decode()
    assert "<script" not in page and "<img" not in page and '</td>"' not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "node-&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in page
    assert "c&lt;/td&gt;" in page
    for external in ("src=", 'href="http', "@import", "url("):
        assert external not in page.replace("src=x", "")  # nothing loaded from anywhere


def test_rows_go_by_severity_then_oldest_first() -> None:
    recs = [
        record(1, "warning", T0 - 10_000),
        record(2, "critical", T0),  # newer, yet above every warning
        record(3, "info", T0 - 99_000),
        record(4, "critical", T0 - 5_000),
        record(5, "warning", T0 - 20_000),
    ]
    v = view(recs)
    assert [r.alert_id for r in v.rows] == ["id00004", "id00002", "id00005", "id00001", "id00003"]
    page = render_html(v, T0 + 60_000).decode()
    positions = [page.index(f'data-alert-id="{r.alert_id}"') for r in v.rows]
    assert positions == sorted(positions)
    assert "1m 05s" in page  # the age of id00004, first seen 65 s before now


def test_the_page_is_bounded_and_says_how_many_more() -> None:
    recs = [record(i, first_seen_ms=T0 + i) for i in range(MAX_ROWS + 7)]
    v = view(recs)
    assert len(v.rows) == MAX_ROWS and v.more == 7 and v.total == MAX_ROWS + 7
    page = render_html(v, T0).decode()
    assert page.count("<tr data-alert-id=") == MAX_ROWS
    assert "7 more open alerts not shown" in page
    assert f'data-alert-id="id{MAX_ROWS + 6:05d}"' not in page  # the newest are the ones left out
    doc = json.loads(render_json(v, T0))
    assert doc["open_alerts"] == MAX_ROWS + 7 and doc["shown"] == MAX_ROWS and doc["more"] == 7
    # one alert's many pods and long names stay a few lines of the page; the JSON keeps them whole
    many = record(1, allocations=[("ns", "p" * 5000 + str(k), "c") for k in range(64)])
    page = render_html(view([many]), T0).decode()
    assert len(page) < 20_000 and f"+{64 - MAX_PODS_SHOWN} more" in page
    assert len(json.loads(render_json(view([many]), T0))["alerts"][0]["pods"]) == 64


def test_the_json_says_what_the_page_shows() -> None:
    rec = record(
        7, "critical", T0 - 3_600_000, allocations=[("team-a", "train-7", "main"), ("team-b", "eval", "")]
    )
    doc = json.loads(render_json(view([rec]), T0))
    assert doc["instance"] == "it" and doc["role"] == "single" and doc["stale"] is False
    (a,) = doc["alerts"]
    assert a == {
        "alert_id": "id00007",
        "alertname": "GpuXidError",
        "severity": "critical",
        "scope": "gpu",
        "node": "node-7",
        "gpu": {"uuid": "GPU-0007", "index": 7, "pci_bus_id": "0000:07:00.0"},
        "gpus": [],
        "pods": [
            {"namespace": "team-a", "pod": "train-7", "container": "main"},
            {"namespace": "team-b", "pod": "eval", "container": ""},
        ],
        "cause_class": "bus",
        "summary": rec["summary"],
        "nvidia_action": "RESET_GPU",
        "action": "RESET_GPU",
        "drain_node": True,
        "first_seen_ms": T0 - 3_600_000,
        "first_seen": "2027-01-15T07:00:00.000Z",
        "age_s": 3600,
        "last_seen_ms": T0 - 3_599_000,
        "occurrences": 3,
        "xid_codes": [79],
    }
    page = render_html(view([rec]), T0).decode()
    for shown in ("node-7", "GPU 7", "GPU-0007", "0000:07:00.0", "team-a/train-7/main", "team-b/eval",
                  "bus", "RESET_GPU", "1h 00m", "id00007", ">yes<"):  # fmt: skip
        assert shown in page, shown


def test_a_standby_says_so() -> None:
    page = render_html(view([], role="standby"), T0).decode()
    assert "standby" in page and "No open alerts." in page
    assert "standby" in json.loads(render_json(view([], role="standby"), T0))["note"]


# ----------------------------------------------------------------------- the snapshot beside the loop


def xid_rec(offset: int, host: str, bus: str, code: int, pod: str) -> InRecord:
    value = {
        "event_id": f"e{offset}",
        "timestamp_ms": T0,
        "hostname": host,
        "kind": "xid",
        "xid": code,
        "pci_bus_id": bus,
        "uuid": None,
        "message": "",
        "source": "simulated",
        "allocations": [{"namespace": "team-a", "pod": pod, "container": "main"}],
    }
    return InRecord("gpu.xid.v1", 0, offset, None, "XidEvent", value, T0)


def loaded_service() -> AlertsHandler:
    svc = AlertsHandler(
        sink=ListSink(),
        registry=CollectorRegistry(),
        clock=lambda: T0 / 1000 + 5,
        instance="t",
        engine_config=EngineConfig(update_interval_ms=0),
    )
    svc.handle([xid_rec(1, "node-a", "0000:18:00", 79, "p1"), xid_rec(2, "node-b", "0000:28:00", 13, "p2")])
    return svc


def test_the_routes_list_what_the_service_holds() -> None:
    svc = loaded_service()
    page = AlertsPage(svc.open_alerts_snapshot, instance="t", role=lambda: "single")
    doc = json.loads(page.routes()["/alerts.json"](Message()).body)  # type: ignore[arg-type]
    assert {(a["node"], a["gpu"]["pci_bus_id"], a["pods"][0]["pod"]) for a in doc["alerts"]} == {
        ("node-a", "0000:18:00.0", "p1"),
        ("node-b", "0000:28:00.0", "p2"),
    }
    html = page.routes()["/alerts"](Message())
    assert html.code == 200 and html.content_type.startswith("text/html")
    assert "default-src 'none'" in html.headers["Content-Security-Policy"]
    page.routes()["/alerts"](Message())
    assert page.walks == 1  # a second request within REFRESH_S reuses the snapshot


def test_a_busy_loop_leaves_the_page_its_last_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consume loop holds the lock through a broker outage: the page waits LOCK_WAIT_S, no more."""
    monkeypatch.setattr(alerts_page, "LOCK_WAIT_S", 0.2)
    monkeypatch.setattr(alerts_page, "REFRESH_S", 0.0)
    svc = loaded_service()
    page = AlertsPage(svc.open_alerts_snapshot, instance="t", role=lambda: "single")
    held, release = threading.Event(), threading.Event()

    def loop_waiting_for_the_broker() -> None:
        with svc.lock:
            held.set()
            release.wait(10)

    busy = threading.Thread(target=loop_waiting_for_the_broker)
    busy.start()
    held.wait(5)
    try:
        assert page.routes()["/alerts.json"](Message()).code == 503  # nothing to show yet
    finally:
        release.set()
        busy.join()
    assert json.loads(page.routes()["/alerts.json"](Message()).body)["stale"] is False  # type: ignore[arg-type]
    held.clear()
    release.clear()
    busy = threading.Thread(target=loop_waiting_for_the_broker)
    busy.start()
    held.wait(5)
    try:
        doc = json.loads(page.routes()["/alerts.json"](Message()).body)  # type: ignore[arg-type]
        assert doc["stale"] is True and doc["open_alerts"] == 2
    finally:
        release.set()
        busy.join()


def test_the_page_asks_for_the_password_like_metrics(tmp_path: Path) -> None:
    svc = loaded_service()
    page = AlertsPage(svc.open_alerts_snapshot, instance="t", role=lambda: "single")
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{bcrypt.hashpw(b'pw', bcrypt.gensalt(4)).decode()}'\n")
    http = HttpServer("127.0.0.1:0", web, routes=page.routes(), health=lambda: (True, {})).start()
    try:

        def get(path: str, auth: bool) -> int:
            req = urllib.request.Request(f"http://127.0.0.1:{http.port}{path}")
            if auth:
                req.add_header("Authorization", "Basic " + base64.b64encode(b"prometheus:pw").decode())
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert get("/alerts", False) == 401 and get("/alerts.json", False) == 401
        assert get("/alerts", True) == 200 and get("/alerts.json", True) == 200
    finally:
        http.close()
