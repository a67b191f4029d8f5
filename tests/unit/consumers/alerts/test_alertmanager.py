"""Alertmanager sender: resend, resolve, label changes, errors, slowness, bounded queue."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpupipe.clients.alertmanager import AlertmanagerFanout, AlertmanagerSender, http_post
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from gpupipe_consumers.alerts.engine.alert_record import iso_ms

T0 = 1_800_000_000_000
MIN = 60_000


def rec(aid: str = "a1", status: str = "firing", severity: str = "critical", **kw: Any) -> dict[str, Any]:
    r = {
        "alert_id": aid,
        "status": status,
        "sequence": 1,
        "scope": "gpu",
        "alertname": "GpuXidError",
        "signal": "xid",
        "severity": severity,
        "xid_codes": [79],
        "name": "FALLEN",
        "summary": f"summary {aid}",
        "description": "desc",
        "cause_class": "bus",
        "action": "RESTART_BM",
        "drain_node": True,
        "catalog_version": "v",
        "hostname": "node-a",
        "gpu_uuid": f"GPU-{aid}",
        "gpu_index": 0,
        "pci_bus_id": f"bus-{aid}",
        "gpus": [f"GPU-{aid}"],
        "allocations": [],
        "first_seen_ms": T0,
        "occurrences": 1,
        "runbook": "reboot",
        "parent_alert_id": None,
        "resolved_at_ms": None,
    }
    r.update(kw)
    return r


class FakePost:
    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.status = 200
        self.raise_exc: Exception | None = None

    def __call__(self, url: str, body: bytes, timeout: float) -> int:
        assert url.endswith("/api/v2/alerts")
        if self.raise_exc is not None:
            raise self.raise_exc
        self.calls.append(json.loads(body))
        return self.status


class Clock:
    def __init__(self, ms: int = T0) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def sender(post: FakePost, clock: Clock, **kw: Any) -> AlertmanagerSender:
    return AlertmanagerSender(
        "http://am:9093/", shape=gpu_alert_shape, post=post, clock=clock, resend_interval_ms=MIN, **kw
    )


def test_firing_is_sent_then_resent_each_interval_with_ends_at() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec())
    assert s.step(T0) and len(post.calls) == 1
    alert = post.calls[0][0]
    assert alert["labels"]["alertname"] == "GpuXidError" and alert["labels"]["xid"] == "79"
    assert alert["startsAt"] == iso_ms(T0) and alert["endsAt"] == iso_ms(T0 + 4 * MIN)
    assert s.step(T0 + 30_000) and len(post.calls) == 1  # nothing due
    assert s.step(T0 + MIN) and len(post.calls) == 2
    assert post.calls[1][0]["endsAt"] == iso_ms(T0 + 5 * MIN)


def test_resolved_is_sent_once_with_resolution_time_then_forgotten() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec())
    s.step(T0)
    s.update(rec(status="resolved", resolved_at_ms=T0 + 5000))
    s.step(T0 + 6000)
    assert post.calls[-1][0]["endsAt"] == iso_ms(T0 + 5000)
    assert len(s) == 0
    s.step(T0 + 10 * MIN)
    assert len(post.calls) == 2


def test_a_forgotten_alert_is_no_longer_resent_nor_resolved() -> None:
    """The alerts service evicted it (a flood past its caps): Alertmanager lets it end at its endsAt."""
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec())
    s.step(T0)
    s.forget("a1")
    assert len(s) == 0
    s.step(T0 + 10 * MIN)
    assert len(post.calls) == 1


def test_alertmanager_down_queues_and_delivers_when_back() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    post.raise_exc = ConnectionRefusedError(111, "refused")
    for i in range(5):
        s.update(rec(f"a{i}"))
    assert not s.step(T0)
    s.update(rec("a0", status="resolved", resolved_at_ms=T0 + 1))
    post.status = 503
    post.raise_exc = None
    assert not s.step(T0 + 1000)
    assert s.failures == 2 and s.pending() == 5
    post.status = 200
    assert s.step(T0 + 2000)
    sent = {a["annotations"]["gpu_uuid"]: a for a in post.calls[-1]}
    assert set(sent) == {f"GPU-a{i}" for i in range(5)}
    assert sent["GPU-a0"]["endsAt"] == iso_ms(T0 + 1)  # the resolution was not lost either
    assert s.pending() == 0 and len(s) == 4


def test_an_escalation_keeps_the_earlier_label_set_firing_until_the_alert_ends() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec(severity="warning"))
    s.step(T0)
    clock.ms = T0 + 1000
    s.update(rec(severity="critical"))
    s.step(T0 + 1000)
    assert {a["labels"]["severity"]: a["endsAt"] for a in post.calls[-1]} == {
        "critical": iso_ms(T0 + 1000 + 4 * MIN)  # the new label set; the warning one is not resolved
    }
    clock.ms = T0 + MIN + 1000
    s.step(T0 + MIN + 1000)  # both re-sent while the alert fires
    assert {a["labels"]["severity"] for a in post.calls[-1]} == {"warning", "critical"}
    s.update(rec(severity="critical", status="resolved", resolved_at_ms=T0 + 2 * MIN))
    s.step(T0 + 2 * MIN)
    assert {a["labels"]["severity"]: a["endsAt"] for a in post.calls[-1]} == {
        "warning": iso_ms(T0 + 2 * MIN),
        "critical": iso_ms(T0 + 2 * MIN),
    }
    assert len(s) == 0


def test_label_change_resolves_old_label_set() -> None:
    from dataclasses import replace

    post, clock = FakePost(), Clock()
    s = AlertmanagerSender(  # a shape that does not keep earlier label sets (recommendations)
        "http://am:9093/",
        shape=lambda r: replace(gpu_alert_shape(r), keep_earlier=False),
        post=post,
        clock=clock,
        resend_interval_ms=MIN,
    )
    s.update(rec(severity="warning"))
    s.step(T0)
    clock.ms = T0 + 1000
    s.update(rec(severity="critical"))
    s.step(T0 + 1000)
    by_sev = {a["labels"]["severity"]: a for a in post.calls[-1]}
    assert by_sev["warning"]["endsAt"] == iso_ms(T0 + 1000)
    assert by_sev["critical"]["endsAt"] == iso_ms(T0 + 1000 + 4 * MIN)
    assert len(s) == 1


def test_resolution_of_a_superseded_alert_does_not_end_its_successor() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec("old"))
    s.update(rec("old", gpu_uuid="GPU-x", pci_bus_id="bus-x"))
    s.update(rec("new", gpu_uuid="GPU-x", pci_bus_id="bus-x"))  # same labels, newer alert
    s.update(rec("old", status="resolved", gpu_uuid="GPU-x", pci_bus_id="bus-x", resolved_at_ms=T0))
    s.step(T0 + 1000)
    x = [a for a in post.calls[-1] if a["labels"].get("pci_bus_id") == "bus-x"]
    assert len(x) == 1 and x[0]["endsAt"] == iso_ms(T0 + 1000 + 4 * MIN)


def test_queue_is_bounded_resolved_dropped_first() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock, max_alerts=3)
    s.update(rec("a"))
    s.update(rec("b", status="resolved"))
    s.update(rec("c"))
    s.update(rec("d"))
    assert len(s) == 3 and s.dropped == 1
    s.step(T0)
    assert {a["annotations"]["gpu_uuid"] for a in post.calls[-1]} == {"GPU-a", "GPU-c", "GPU-d"}


def test_queue_never_evicts_a_firing_alert_review_d9() -> None:
    # With max_alerts=3 and five Xid 79s the two oldest firing alerts were dropped and never
    # reached Alertmanager. Firing alerts are bounded by the engine's open alerts; they are held (and the
    # excess counted), only resolved ones are evicted.
    post, clock = FakePost(), Clock()
    s = sender(post, clock, max_alerts=3)
    for i in range(5):
        s.update(rec(f"n{i}", hostname=f"node-{i}"))
    assert s.dropped == 0 and s.over_limit == 2 and len(s) == 5
    assert s.metrics.over_limit.labels(s.url)._value.get() == 2  # counted, visible on /metrics
    s.step(T0)
    assert {a["labels"]["node"] for a in post.calls[-1]} == {f"node-{i}" for i in range(5)}


def test_batches_are_split() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock, batch_size=2)
    for i in range(5):
        s.update(rec(f"a{i}"))
    assert s.step(T0)
    assert [len(c) for c in post.calls] == [2, 2, 1]


def test_action_records_are_ignored() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec(status="action"))
    assert len(s) == 0


class _SlowAm:
    """A loopback HTTP server that answers after `delay` seconds (or with `status`)."""

    def __init__(self, delay: float, status: int = 200) -> None:
        self.received: list[Any] = []
        self.delay = delay
        self.status = status
        self.release = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.release.wait(outer.delay)
                outer.received.append(json.loads(body))
                try:
                    self.send_response(outer.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:  # the client gave up (timeout): expected here
                    pass

            def log_message(self, *a: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_slow_alertmanager_times_out_and_never_blocks_updates() -> None:
    am = _SlowAm(delay=5.0)
    try:
        s = AlertmanagerSender(
            am.url, shape=gpu_alert_shape, timeout_s=0.3, retry_min_s=0.05, retry_max_s=0.1
        ).start()
        t = time.perf_counter()
        for i in range(200):
            s.update(rec(f"a{i}"))
        # update() only touches memory: all 200 return before the Alertmanager could answer even one
        # post (a bound from the server's delay, not from the machine's speed)
        assert time.perf_counter() - t < am.delay and not am.release.is_set()
        deadline = time.monotonic() + 5
        while s.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.failures >= 1 and "timed out" in s.last_error
        am.delay = 0.0
        am.release.set()
        deadline = time.monotonic() + 5
        while s.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.pending() == 0
        s.stop(1.0)
    finally:
        am.close()
    ids = {a["annotations"]["summary"] for batch in am.received for a in batch}
    assert ids >= {f"summary a{i}" for i in range(200)}


def test_http_post_reports_status_codes() -> None:
    am = _SlowAm(delay=0.0, status=400)
    try:
        assert http_post(am.url + "/api/v2/alerts", b"[]", 2.0) == 400
        am.status = 200
        assert http_post(am.url + "/api/v2/alerts", b"[]", 2.0) == 200
    finally:
        am.close()


def test_fanout_updates_every_sender() -> None:
    posts = [FakePost(), FakePost()]
    fan = AlertmanagerFanout([sender(p, Clock()) for p in posts])
    fan.update(rec())
    assert fan.pending() == 2
    for s in fan.senders:
        s.step(T0)
    assert all(len(p.calls) == 1 for p in posts)


def test_one_invalid_alert_does_not_block_the_rest() -> None:
    class Picky(FakePost):
        def __call__(self, url: str, body: bytes, timeout: float) -> int:
            alerts = json.loads(body)
            if any(a["annotations"].get("gpu_uuid") == "GPU-bad" for a in alerts):
                return 400
            self.calls.append(alerts)
            return 200

    post, clock = Picky(), Clock()
    s = sender(post, clock)
    for aid in ("a", "b", "bad", "c", "d"):
        s.update(rec(aid))
    assert s.step(T0)
    delivered = {a["annotations"]["gpu_uuid"] for batch in post.calls for a in batch}
    assert delivered == {"GPU-a", "GPU-b", "GPU-c", "GPU-d"}
    assert s.dropped == 1 and len(s) == 4 and s.pending() == 0


def test_starts_at_in_the_future_is_clamped_to_now() -> None:
    post, clock = FakePost(), Clock()
    s = sender(post, clock)
    s.update(rec(first_seen_ms=T0 + 10 * MIN))  # node clock ten minutes ahead
    s.step(T0)
    a = post.calls[0][0]
    assert a["startsAt"] == iso_ms(T0) and a["endsAt"] == iso_ms(T0 + 4 * MIN)
    s.update(rec(status="resolved", first_seen_ms=T0 + 10 * MIN, resolved_at_ms=T0 + 1))
    s.step(T0 + 2)
    r = post.calls[1][0]
    assert r["startsAt"] == iso_ms(T0 + 2) and r["endsAt"] == iso_ms(T0 + 2)
