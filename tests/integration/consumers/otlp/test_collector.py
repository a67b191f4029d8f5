"""`gpupipe otlp` against a real broker and a real OpenTelemetry Collector (scripts/otelcol-local):
crafted records -> Kafka -> the exporter -> the collector over gRPC and over HTTP -> the collector's
JSON-lines file, compared with the mapping of docs/otel.md; a collector outage loses nothing; and
both transports work with mutual TLS."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.otlp import mapping
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.otlp_records import MIG_UUID, UUID, alloc, attrs, num, points, sample, xid
from tests.pki import Pki

pytestmark = pytest.mark.integration

OTELCOL = (
    Path(os.environ.get("GPUPIPE_CACHE", Path.home() / ".cache" / "gpupipe")) / "bin" / "otelcol-gpupipe"
)
T0 = int(time.time() * 1000) - 60_000  # recent: the consume loop refuses event times far from now


def wait_for(cond: Any, timeout: float, what: str, *logs: Path, proc: Any = None) -> None:
    """Wait for ``cond``; fail at once, with the logs, if ``proc`` (the exporter) exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            what = f"{what}: the exporter exited with {proc.returncode}"
            break
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


class Collector:
    """A real collector: the otlp receiver on two free ports, the file exporter writing JSON lines."""

    def __init__(self, tmp: Path, tls: dict[str, str] | None = None) -> None:
        if not os.access(OTELCOL, os.X_OK):
            pytest.fail(f"{OTELCOL} is missing: run scripts/ensure-deps (or scripts/otelcol-local)")
        self.tmp = tmp
        self.grpc_port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls = tls or {}
        self.runs = 0
        self.log = tmp / "otelcol.log"

    @property
    def files(self) -> list[Path]:
        return [self.tmp / f"otel-{i}.jsonl" for i in range(self.runs)]

    def start(self) -> None:
        out = self.tmp / f"otel-{self.runs}.jsonl"
        self.runs += 1
        cfg = {
            "receivers": {
                "otlp": {
                    "protocols": {
                        "grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}", **self.tls_config},
                        "http": {"endpoint": f"127.0.0.1:{self.http_port}", **self.tls_config},
                    }
                }
            },
            "exporters": {"file": {"path": str(out), "flush_interval": "100ms"}},
            "service": {
                "telemetry": {"metrics": {"level": "none"}},
                "pipelines": {
                    "metrics": {"receivers": ["otlp"], "exporters": ["file"]},
                    "logs": {"receivers": ["otlp"], "exporters": ["file"]},
                },
            },
        }
        path = self.tmp / "otelcol.json"  # the collector reads YAML, and JSON is YAML
        path.write_text(json.dumps(cfg))
        log = self.log.open("a")
        self.proc = hygiene.popen([str(OTELCOL), f"--config={path}"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: "Everything is ready" in self.log.read_text(), 60, "the collector", self.log)

    @property
    def tls_config(self) -> dict[str, Any]:
        return {"tls": self.tls} if self.tls else {}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            hygiene.stop_group(self.proc, timeout=10)
        self.proc = None

    def requests(self) -> tuple[list[ExportMetricsServiceRequest], list[ExportLogsServiceRequest]]:
        metrics, logs = [], []
        for f in self.files:
            if not f.exists():
                continue
            for line in f.read_text().splitlines():
                if not line.endswith("}"):
                    continue  # a line being written
                if '"resourceMetrics"' in line:
                    metrics.append(Parse(line, ExportMetricsServiceRequest()))
                elif '"resourceLogs"' in line:
                    logs.append(Parse(line, ExportLogsServiceRequest()))
        return metrics, logs


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def start_otlp(
    kafka: str,
    prefix: str,
    tmp: Path,
    endpoint: str,
    protocol: str,
    port: int,
    *extra: str,
    env: dict[str, str] | None = None,
) -> Any:
    log = (tmp / "otlp.log").open("a")
    proc = hygiene.popen(
        [
            *GPUPIPE,
            "otlp",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--group-id",
            f"{prefix}otlp",
            "--from-beginning",
            "--otlp-endpoint",
            endpoint,
            "--otlp-protocol",
            protocol,
            "--otlp-timeout",
            "3s",
            "--listen",
            f"127.0.0.1:{port}",
            "--log-format",
            "text",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    log.close()
    return proc


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def publish(kafka: str, prefix: str, samples: list[dict[str, Any]], xids: list[dict[str, Any]]) -> None:
    codec = AvroCodec()
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "linger.ms": 5})
    enc_s, enc_x = codec.encoder("GpuSample"), codec.encoder("XidEvent")
    for s in samples:
        p.produce(
            prefix + "gpu.samples.v1",
            enc_s.encode(s),
            (s.get("mig") or {}).get("mig_uuid", s["uuid"]).encode(),
        )
    for x in xids:
        p.produce(prefix + "gpu.xid.v1", enc_x.encode(x), x["uuid"].encode())
    assert p.flush(30) == 0


def crafted(t_ms: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mig = {
        "mig_uuid": MIG_UUID,
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.18gb",
        "slice_fraction": 1 / 7,
    }
    samples = [
        sample(timestamp_ms=t_ms),
        sample(timestamp_ms=t_ms, uuid="GPU-free", gpu_index=4, allocations=[], pcie_window_ms=20),
        sample(timestamp_ms=t_ms, mig=mig, allocations=[alloc("team-b", "infer-1", replica=None)]),
    ]
    return samples, [xid(timestamp_ms=t_ms), xid(event_id="ev-2", xid=13, timestamp_ms=t_ms, message="")]


Row = tuple[tuple[tuple[str, Any], ...], str, str, tuple[tuple[str, Any], ...], Any, int, int]


def metric_rows(reqs: list[ExportMetricsServiceRequest]) -> set[Row]:
    """(resource attributes, name, unit, point attributes, value, start, time) of every data point."""
    out = set()
    for req in reqs:
        for res, m, pa, dp in points(req):
            value = num(dp)
            out.add(
                (
                    tuple(sorted(res.items())),
                    m.name,
                    m.unit,
                    tuple(sorted(pa.items())),
                    round(value, 9) if isinstance(value, float) else value,
                    dp.start_time_unix_nano,
                    dp.time_unix_nano,
                )
            )
    return out


def log_rows(reqs: list[ExportLogsServiceRequest]) -> list[tuple[Any, ...]]:
    out = []
    for req in reqs:
        for rl in req.resource_logs:
            for sl in rl.scope_logs:
                for lr in sl.log_records:
                    out.append(
                        (
                            tuple(sorted(attrs(rl.resource.attributes).items())),
                            lr.time_unix_nano,
                            lr.severity_number,
                            lr.severity_text,
                            lr.body.string_value,
                            tuple(sorted(attrs(lr.attributes).items())),
                            lr.event_name,
                        )
                    )
    return sorted(out)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_records_reach_the_collector_as_the_documented_otlp(
    kafka: str, topic_prefix: str, tmp_path: Path, collector: Collector, protocol: str
) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.xid.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    samples, xids = crafted(T0)
    publish(kafka, topic_prefix, samples, xids)
    port = free_port()
    endpoint = f"http://127.0.0.1:{collector.grpc_port if protocol == 'grpc' else collector.http_port}"
    proc = start_otlp(kafka, topic_prefix, tmp_path, endpoint, protocol, port)
    want_metrics = metric_rows([mapping.metrics_request(samples)])
    want_logs = log_rows([mapping.logs_request(xids)])
    try:
        wait_for(
            lambda: (
                metric_rows(collector.requests()[0]) >= want_metrics
                and len(log_rows(collector.requests()[1])) >= len(want_logs)
            ),
            120,
            "every point and log record at the collector",
            tmp_path / "otlp.log",
            collector.log,
            proc=proc,
        )
        status, body = healthz(port)
        assert status == 200 and "exports_failing" not in body, body
    finally:
        hygiene.stop_group(proc, timeout=30)
    got_metrics, got_logs = collector.requests()
    assert metric_rows(got_metrics) == want_metrics
    assert log_rows(got_logs) == want_logs

    # The mapping table's cells, read back from what the collector wrote.
    rows = metric_rows(got_metrics)
    by_name: dict[str, set[str]] = {}
    for _, name, unit, *_ in rows:
        by_name.setdefault(name, set()).add(unit)
    assert by_name["hw.gpu.utilization"] == {"1"} and by_name["hw.gpu.memory.usage"] == {"By"}
    assert (
        by_name["hw.power"] == {"W"}
        and by_name["hw.energy"] == {"J"}
        and by_name["hw.temperature"] == {"Cel"}
    )
    energy = {dict(pa)["hw.id"]: v for res, n, _, pa, v, *_ in rows if n == "hw.energy"}
    assert energy[UUID] == pytest.approx(123_456.789)
    pod_res = {dict(res).get("k8s.pod.name") for res, *_ in rows}
    assert pod_res == {"train-0", "infer-1", None}  # None: the unallocated GPU under its node
    io = {
        (dict(pa)["hw.id"], dict(pa)["network.io.direction"]): (v, s, t)
        for _, n, _, pa, v, s, t in rows
        if n == "hw.gpu.io"
    }
    assert io[("GPU-free", "receive")] == (40_000, (T0 - 20) * 1_000_000, T0 * 1_000_000)  # 2 MB/s x 20 ms
    crit = [r for r in log_rows(got_logs) if dict(r[5])["gpupipe.xid.event_id"] == "ev-1"]
    assert [(r[2], r[3], r[4]) for r in crit] == [(21, "CRITICAL", "GPU has fallen off the bus.")]
    a = dict(crit[0][5])
    assert (a["gpupipe.xid.code"], a["gpupipe.xid.cause"], a["gpupipe.xid.action"]) == (
        79,
        "bus",
        "RESTART_BM",
    )
    assert dict(crit[0][0])["k8s.pod.name"] == "train-0"


def test_a_collector_outage_loses_nothing(
    kafka: str, topic_prefix: str, tmp_path: Path, collector: Collector
) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.xid.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    port = free_port()
    proc = start_otlp(kafka, topic_prefix, tmp_path, f"http://127.0.0.1:{collector.grpc_port}", "grpc", port)
    logs = (tmp_path / "otlp.log", collector.log)
    try:
        wait_for(lambda: healthz(port)[0] == 200, 120, "the exporter to start", *logs, proc=proc)
        before, xb = crafted(T0)
        publish(kafka, topic_prefix, before, xb)
        wait_for(
            lambda: len(log_rows(collector.requests()[1])) >= 2, 120, "the first records", *logs, proc=proc
        )
        collector.stop()
        # During the outage: readings from three more instants, and XIDs.
        during_s, during_x = [], []
        for i in range(1, 4):
            s, x = crafted(T0 + i * 1000)
            during_s += s
            during_x += [{**e, "event_id": f"{e['event_id']}-{i}"} for e in x]
        publish(kafka, topic_prefix, during_s, during_x)
        wait_for(
            lambda: healthz(port)[0] == 503 and "exports_failing" in healthz(port)[1],
            120,
            "/healthz to say so",
            *logs,
            proc=proc,
        )
        body = healthz(port)[1]
        assert "UNAVAILABLE" in body["exports_failing"] and body["records_held"] > 0, body
        collector.start()
        want = metric_rows([mapping.metrics_request(before + during_s)])
        want_logs = log_rows([mapping.logs_request(xb + during_x)])
        wait_for(
            lambda: (
                metric_rows(collector.requests()[0]) >= want
                and set(log_rows(collector.requests()[1])) >= set(want_logs)
            ),
            180,
            "every record after the collector came back",
            *logs,
            proc=proc,
        )
        wait_for(lambda: healthz(port)[0] == 200, 60, "/healthz to recover", *logs, proc=proc)
    finally:
        hygiene.stop_group(proc, timeout=30)
    assert metric_rows(collector.requests()[0]) == want
    assert set(log_rows(collector.requests()[1])) == set(want_logs)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_mutual_tls_and_headers_from_the_environment(
    kafka: str, topic_prefix: str, tmp_path: Path, protocol: str
) -> None:
    pki = Pki(tmp_path)
    crt, key = pki.server()
    client_crt, client_key = pki.client("gpupipe-otlp")
    tls = {"cert_file": str(crt), "key_file": str(key), "client_ca_file": str(pki.ca)}
    collector = Collector(tmp_path, tls=tls)
    collector.start()
    proc = None
    try:
        ensure_topics(kafka, ["gpu.samples.v1", "gpu.xid.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
        samples, xids = crafted(T0)
        publish(kafka, topic_prefix, samples, xids)
        port = collector.grpc_port if protocol == "grpc" else collector.http_port
        proc = start_otlp(
            kafka,
            topic_prefix,
            tmp_path,
            f"https://127.0.0.1:{port}",
            protocol,
            free_port(),
            "--otlp-ca-file",
            str(pki.ca),
            "--otlp-cert-file",
            str(client_crt),
            "--otlp-key-file",
            str(client_key),
            env={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0ken,x-scope-orgid=gpu"},
        )
        want = metric_rows([mapping.metrics_request(samples)])
        wait_for(
            lambda: (
                metric_rows(collector.requests()[0]) >= want and len(log_rows(collector.requests()[1])) >= 2
            ),
            120,
            "every point over TLS",
            tmp_path / "otlp.log",
            collector.log,
            proc=proc,
        )
    finally:
        if proc is not None:
            hygiene.stop_group(proc, timeout=30)
        collector.stop()
    assert metric_rows(collector.requests()[0]) == want
    assert log_rows(collector.requests()[1]) == log_rows([mapping.logs_request(xids)])
