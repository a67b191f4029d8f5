"""`gpupipe otlp` against collectors that refuse a size, redirect, or answer late: the real
OpenTelemetry Collector (scripts/otelcol-local) with its default limits (4 MiB a gRPC message), and
a small HTTP hop in front of it playing the misbehaving proxy (the collector itself never redirects).

Valid samples ( over 4 MiB halted every export behind them), A9 (a 302 was
followed as a bodyless GET that carried the credentials and counted as delivered), A10 (each
attempt at a slow collector timed out after delivery and was resent: five copies).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client import CollectorRegistry

from gpupipe.kafka.admin import ensure_topics
from gpupipe.kafka.ready import Backoff
from gpupipe_consumers.otlp import mapping
from gpupipe_consumers.otlp.export import config_from, transport
from gpupipe_consumers.otlp.handler import ExportAbandoned, OtlpHandler
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests import hygiene
from tests.conftest import free_port
from tests.integration.consumers.otlp.test_collector import Collector, healthz, publish, start_otlp, wait_for
from tests.integration.kafka_util import read_all
from tests.otlp_records import alloc, points, sample

pytestmark = pytest.mark.integration

T0 = int(time.time() * 1000) - 60_000
SECRET = "Bearer SECRET-OTLP-TOKEN"


def big(uuid: str) -> dict[str, Any]:
    """Valid, and about 2.6 MB of OTLP: 256 allocations with 8 long labels each (665 KB on Kafka)."""
    labels = {"k" * 250 + f"/l{j}": "v" * 63 for j in range(8)}
    return sample(
        uuid=uuid,
        timestamp_ms=T0,
        allocations=[alloc(f"ns{i}", f"pod-{i}", labels=labels) for i in range(256)],
    )


def huge(uuid: str) -> dict[str, Any]:
    """Valid (391 KB on Kafka), and 4.5 MB of OTLP alone: the GPU's long names repeat in every point."""
    allocs = [
        alloc(f"ns{i}", f"pod-{i}" + "p" * 200, labels={"k" * 250 + f"/l{j}": "v" * 63 for j in range(4)})
        for i in range(256)
    ]
    return sample(
        uuid=uuid + "u" * 100,
        hostname="h" * 253,
        model_name="m" * 256,
        driver_version="d" * 64,
        pci_bus_id="p" * 32,
        timestamp_ms=T0,
        allocations=allocs,
    )


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    c = Collector(tmp_path_factory.mktemp("otelcol"))  # the receiver's defaults: 4 MiB over gRPC
    c.start()
    try:
        yield c
    finally:
        c.stop()


def exported(collector: Collector, *uuids: str) -> set[str]:
    """Which of the GPUs ``uuids`` had points reach the collector (a text search, the files read
    once: the big lines would take long to parse)."""
    text = "".join(f.read_text() for f in collector.files if f.exists())
    return {u for u in uuids if f'"stringValue":"{u}"' in text}


def copies(collector: Collector, rec: dict[str, Any]) -> float:
    """How many times the collector got the points of ``rec`` (a small sample)."""
    want = len(points(mapping.metrics_request([rec])))
    got = 0
    for f in collector.files:
        for line in f.read_text().splitlines() if f.exists() else ():
            if rec["uuid"] in line and line.endswith("}"):
                got += sum(
                    1
                    for _, _, pa, _ in points(Parse(line, ExportMetricsServiceRequest()))
                    if pa["hw.id"].split("/")[0] == rec["uuid"]
                )
    return got / want


# -- valid samples over the collector's 4 MiB -----------------------------------------------------


def test_samples_over_the_collectors_limit_halt_nothing_behind_them(
    kafka: str, topic_prefix: str, tmp_path: Path, collector: Collector
) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.xid.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    bigs = [big(f"GPU-big-{n}") for n in range(5)]  # 13 MB of OTLP together, each under 3 MiB
    too_big = huge("GPU-huge")
    after = [sample(uuid=f"GPU-after-{n}", timestamp_ms=T0) for n in range(20)]
    publish(kafka, topic_prefix, [*bigs, too_big, *after], [])
    port = free_port()
    endpoint = f"http://127.0.0.1:{collector.grpc_port}"
    proc = start_otlp(kafka, topic_prefix, tmp_path, endpoint, "grpc", port)
    logs = (tmp_path / "otlp.log", collector.log)
    want = mapping.encode_metrics([*bigs, *after]).items
    try:
        wait_for(
            lambda: len(exported(collector, *(s["uuid"] for s in after))) == len(after),
            90,
            "the samples behind the big ones",
            *logs,
            proc=proc,
        )
        wait_for(
            lambda: healthz(port)[1].get("exported_points") == want,
            60,
            "every point counted",
            *logs,
            proc=proc,
        )
        status, body = healthz(port)
        assert status == 200 and "exports_failing" not in body, body
    finally:
        hygiene.stop_group(proc, timeout=30)
    assert len(exported(collector, *(s["uuid"] for s in bigs))) == len(bigs)
    assert not exported(collector, too_big["uuid"])
    dead = read_all(kafka, topic_prefix + "gpu.deadletter.v1", expect=1)
    assert [dict(m.headers())["gpupipe.dlq.reason"] for m in dead] == [b"otlp-too-large"]


def rec(value: dict[str, Any]) -> InRecord:
    return InRecord("gpu.samples.v1", 0, 0, None, "GpuSample", value, 0)


def service(
    endpoint: str, protocol: str, **kw: Any
) -> tuple[OtlpHandler, CollectorRegistry, threading.Event]:
    timeout_s = kw.pop("timeout_s", 10.0)
    cfg = config_from(
        protocol=protocol,
        endpoint=endpoint,
        headers_file=None,
        ca_file=None,
        cert_file=None,
        key_file=None,
        timeout_s=timeout_s,
        environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=" + SECRET.replace(" ", "%20")},
    )
    registry, stop = CollectorRegistry(), threading.Event()
    svc = OtlpHandler(
        transport(cfg), registry, stop=stop, backoff=lambda: Backoff(0.2, 0.5), timeout_s=timeout_s, **kw
    )
    return svc, registry, stop


def test_what_the_collector_refuses_for_size_is_split_and_a_record_too_large_alone_dead_lettered(
    collector: Collector,
) -> None:
    # Our own bound out of the way: the collector's RESOURCE_EXHAUSTED is what splits.
    svc, registry, _ = service(f"http://127.0.0.1:{collector.grpc_port}", "grpc", max_request_bytes=2**30)
    records = [
        rec(big("GPU-split-0")),
        rec(huge("GPU-split-huge")),
        rec(big("GPU-split-1")),
        rec(sample(uuid="GPU-split-2", timestamp_ms=T0)),
    ]
    try:
        rejected = svc.handle(records)
    finally:
        svc.transport.close()
    assert [(r.value["uuid"][:14], reason) for r, reason, _ in rejected] == [
        ("GPU-split-huge", "otlp-too-large")
    ]
    assert "larger than max" in rejected[0][2]
    wait_for(
        lambda: len(exported(collector, "GPU-split-0", "GPU-split-1", "GPU-split-2")) == 3,
        30,
        "the rest",
    )
    sent = mapping.encode_metrics([records[i].value for i in (0, 2, 3)]).items
    assert registry.get_sample_value("gpupipe_otlp_items_total", {"signal": "metrics"}) == sent


# -- a hop in front of the collector's OTLP/HTTP port -------------------------------------


class Hop:
    """An HTTP server in front of the collector: ``forward`` (after ``delay_s``: forwards at once,
    answers late), or ``redirect`` to ``location``. Every request is logged with its Authorization."""

    def __init__(self, upstream: str | None, mode: str = "forward", delay_s: float = 0.0) -> None:
        self.upstream, self.mode, self.delay_s, self.location = upstream, mode, delay_s, ""
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        hop = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                try:
                    self.send_response(code)
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timed out) meanwhile

            def do_GET(self) -> None:
                hop.seen.append(("GET", self.path, self.headers.get("Authorization")))
                self._answer(200)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hop.seen.append(("POST", self.path, self.headers.get("Authorization")))
                if hop.mode == "redirect":
                    self._answer(302, headers={"Location": hop.location})
                    return
                if hop.upstream is None:
                    self._answer(200)
                    return
                req = urllib.request.Request(
                    hop.upstream + self.path,
                    data=body,
                    method="POST",
                    headers={"Content-Type": "application/x-protobuf"},
                )
                with urllib.request.urlopen(req, timeout=10) as resp:
                    answer = resp.read()
                time.sleep(hop.delay_s)
                self._answer(200, answer, {"Content-Type": "application/x-protobuf"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # server_close joins the handlers: none outlives the test
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="otlp-hop", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def posts(self) -> int:
        return sum(1 for m, *_ in self.seen if m == "POST")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def run_handle(svc: OtlpHandler, records: list[InRecord]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["rejected"] = svc.handle(records)
        except ExportAbandoned as exc:
            out["abandoned"] = exc

    t = threading.Thread(target=go, name="otlp-handle")
    t.start()
    return t, out


def test_a_redirect_is_not_followed_and_carries_no_credentials(collector: Collector) -> None:
    thief = Hop(None)
    hop = Hop(f"http://127.0.0.1:{collector.http_port}", mode="redirect")
    hop.location = f"{thief.url}/collect"
    svc, registry, stop = service(hop.url, "http/protobuf")
    rec_ = sample(uuid="GPU-redirected", timestamp_ms=T0)
    thread, out = run_handle(svc, [rec(rec_)])
    try:
        wait_for(lambda: out or (hop.posts() >= 2 and svc.failing), 30, "the redirect retried")
        assert thief.seen == []  # the credentials went nowhere else
        assert not out and svc.exported["metrics"] == 0  # not taken for delivered
        assert "redirect" in svc.failing and thief.url in svc.failing
        hop.mode = "forward"  # the operator points it at the collector: the held batch goes through
        thread.join(30)
        assert out == {"rejected": []}
    finally:
        stop.set()
        thread.join()
        hop.close()
        thief.close()
    assert thief.seen == []
    assert all(auth == SECRET for _, _, auth in hop.seen)
    wait_for(lambda: copies(collector, rec_) >= 1, 30, "the points at the collector")
    assert copies(collector, rec_) == 1
    want = mapping.encode_metrics([rec_]).items
    assert registry.get_sample_value("gpupipe_otlp_items_total", {"signal": "metrics"}) == want
    assert (
        registry.get_sample_value("gpupipe_otlp_exports_total", {"signal": "metrics", "outcome": "ok"}) == 1
    )


def test_a_slow_collector_gets_one_resend_not_one_per_attempt(collector: Collector) -> None:
    # Every answer comes 2 s late; the timeout is 1 s: the first attempt times out after delivery.
    hop = Hop(f"http://127.0.0.1:{collector.http_port}", delay_s=2.0)
    svc, registry, stop = service(hop.url, "http/protobuf", timeout_s=1.0)
    rec_ = sample(uuid="GPU-slow", timestamp_ms=T0)
    thread, out = run_handle(svc, [rec(rec_)])
    try:
        wait_for(lambda: "rejected" in out or hop.posts() >= 4, 60, "the export acknowledged")
    finally:
        stop.set()
        thread.join()
        hop.close()
    assert out == {"rejected": []} and hop.posts() == 2, (out, hop.posts())
    wait_for(lambda: copies(collector, rec_) >= 2, 30, "both copies at the collector")
    assert copies(collector, rec_) == 2  # one resend, and it is counted as maybe duplicated
    items = mapping.encode_metrics([rec_]).items
    assert registry.get_sample_value("gpupipe_otlp_items_total", {"signal": "metrics"}) == items
    assert registry.get_sample_value("gpupipe_otlp_timed_out_items_total", {"signal": "metrics"}) == items
