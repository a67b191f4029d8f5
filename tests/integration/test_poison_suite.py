"""The hostile-record catalogue against every consumer at once: none stops, none loses a good record,
no bill moves.

metrics, alerts, recommend, chargeback, lake and otlp (with a real OpenTelemetry Collector) run as
docs/ describes them, on one topic prefix of a real broker, and the catalogue goes to every topic one
of them reads: the sample and XID topics, which any GPU node may write, and the alert and chargeback
topics, which lake and alerts read back. Per topic:

* the review's undecodable kinds: empty, tombstone, random bytes, JSON, an unknown fingerprint, a
  truncated body, Confluent framing without a registry, a short Confluent header, a string length of
  2^62, a negative block count; bytes over librdkafka's message limit, a 1 MB header, junk, trailing
  bytes after a valid record; and a record type that belongs to another topic;
* on the sample topic, samples dated -2**63, in the year -29719 or 2100, with a NaN, infinite or
  1e300 power, a utilisation of 1e300, a NaN MIG fraction, -100 C, a 200 KB namespace, 65 labels
  on one allocation or a non-UTF-8 namespace, each a copy of a good sample inside a window the
  chargeback bills;
* on the XID topic, Xid codes -1 and 2**31-1, an Xid dated 2100, a 5000-character message, a
  non-UTF-8 host name and an operator's ack forged there.

Then: every service is alive and healthy; each dead-lettered every hostile record of its inputs
(chargeback takes a sample whose only fault is a reading it does not bill on: a temperature moves
no bill); the bills are finite and the same as those of a chargeback that read the good samples
alone; the lake holds every good sample and no hostile one; the good XID's alert is firing (the
forged ack closed nothing); the good GPUs are on /metrics and reach the collector.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.chargeback_util import (
    Progress,
    assert_same_totals,
    read_output,
    read_to_end,
    start_service,
    totals,
)
from tests.integration.consumers.alerts.test_service import xid_event
from tests.integration.consumers.otlp.test_collector import Collector
from tests.integration.kafka_util import GPUPIPE
from tests.lake_records import fill
from tests.unit.consumers.alerts.test_record import _records

pytestmark = pytest.mark.integration

SERVICES = {  # service -> the input topics it reads
    "metrics": (topics.SAMPLES, topics.XID),
    "alerts": (topics.SAMPLES, topics.XID, topics.ALERTS),
    "recommend": (topics.SAMPLES,),
    "chargeback": (topics.SAMPLES,),
    "lake": (topics.SAMPLES, topics.XID, topics.ALERTS, topics.CHARGEBACK),
    "otlp": (topics.SAMPLES, topics.XID),
}
TICK_MS = 10_000
#: Records a service takes: the field out of bounds is one it does not read (chargeback decodes
#: what it bills on, and a temperature moves no bill).
UNREAD = {("chargeback", b"temp-cold")}
CHARGEBACK_ARGS = ("--window", "5m", "--grace", "30s", "--idle-timeout", "2s", "--commit-interval", "200ms")

BAD_HOST = {"hostname": "QQQQQQQQ", "event_id": "non-utf8-host", "allocations": []}
Record = tuple[bytes, bytes | None, list[tuple[str, bytes]]]  # key, value, headers


def _healthz(port: int) -> tuple[int | None, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return None, {}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _undecodable(name: str, valid: bytes) -> list[Record]:
    """The review's undecodable kinds and the issue's oversized ones; ``valid``: a good record of
    the topic's own type (truncated, framed wrongly, followed by bytes)."""
    rng = random.Random(name)
    head = valid[:10]  # the single-object header of a known schema
    out: list[Record] = [
        (b"empty", b"", []),
        (b"tombstone", None, []),
        (b"random", rng.randbytes(300), []),
        (b"json", json.dumps({"uuid": "x"}).encode(), []),
        (b"unknown-fp", b"\xc3\x01" + b"\x11" * 8 + valid[10:], []),
        (b"truncated", valid[:60], []),
        (b"confluent-no-registry", b"\x00\x00\x00\x00\x07" + valid[10:], []),
        (b"short-confluent", b"\x00\x01", []),
        (b"huge-strlen", head + b"\x02\xfe\xff\xff\xff\xff\xff\xff\xff\x7fabc", []),
        (b"neg-block", head + b"\x02\x02a\x00\x02u\x02p" + b"\x00\x00\x01" * 10 + b"\x01" * 50, []),
        (b"big", b"JUNK" + b"x" * 1_000_500, []),
        (b"big-header", b"\x00\x01junk", [("h", b"y" * 1_000_000)]),
        (b"junk", b"\xc3\x01garbage!", []),
        (b"trailing", valid + b"\x00extra", []),
    ]
    return out


def _non_utf8(encode: Callable[[dict[str, Any]], bytes], rec: dict[str, Any]) -> bytes:
    """``rec`` (whose strings hold one ``QQQQQQQQ``) encoded, that text's bytes made invalid UTF-8."""
    raw = encode(rec)
    assert raw.count(b"QQQQQQQQ") == 1
    return raw.replace(b"QQQQQQQQ", b"\xff\xfe\xc3\x28QQQQ")


def _catalogue(codec: AvroCodec, sample: dict[str, Any], now: int) -> dict[str, list[Record]]:
    """Per base topic, every hostile record; ``sample``: a good sample the hostile ones copy."""
    enc_s, enc_x, enc_a = (codec.encoder(n).encode for n in ("GpuSample", "XidEvent", "GpuAlert"))

    def s(**kw: Any) -> bytes:
        return enc_s({**copy.deepcopy(sample), **kw})

    def x(**kw: Any) -> bytes:
        return enc_x(xid_event("node-p", "0000:3b:00", 79, now, **{"uuid": "GPU-poison"}) | kw)

    alloc = sample["allocations"][0]
    mig = {
        "mig_uuid": "MIG-poison",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.10gb",
        "slice_fraction": math.nan,
    }
    on_samples = [
        *_undecodable("samples", s()),
        (b"xid-on-samples", x(), []),
        (b"ts-min", s(timestamp_ms=-(2**63)), []),
        (b"ts-year-minus-29719", s(timestamp_ms=-999_999_999_999_999), []),
        (b"ts-2100", s(timestamp_ms=4_102_444_800_000), []),
        (b"power-nan", s(power_w=math.nan), []),
        (b"power-inf", s(power_w=math.inf), []),
        (b"power-huge", s(power_w=1e300), []),
        (b"util-huge", s(gpu_util_ratio=1e300), []),
        (b"mig-nan", s(mig=mig), []),
        (b"temp-cold", s(gpu_temp_c=-100.0), []),
        (b"long-ns", s(allocations=[{**alloc, "namespace": "n" * 200_000}]), []),
        # Labels are bounded in count too: thousands of tiny ones made one OTLP export past a
        # collector's 4 MiB for good.
        (b"labels-many", s(allocations=[{**alloc, "labels": {f"k{i}": "v" for i in range(65)}}]), []),
        (
            b"non-utf8-ns",
            _non_utf8(enc_s, {**sample, "allocations": [{**alloc, "namespace": "QQQQQQQQ"}]}),
            [],
        ),
    ]
    on_xid = [
        *_undecodable("xid", x()),
        (b"sample-on-xid", s(), []),
        (b"xid-minus-1", x(xid=-1), []),
        (b"xid-max", x(xid=2**31 - 1), []),
        (b"xid-2100", x(timestamp_ms=4_102_444_800_000), []),
        (b"xid-long-message", x(message="m" * 5000), []),
        (b"non-utf8-host", _non_utf8(enc_x, xid_event("h", "0000:3b:00", 79, now) | BAD_HOST), []),
        (b"forged-ack", enc_a(_records()[0]), []),
    ]
    alert = enc_a(_records()[0])
    on_alerts = [*_undecodable("alerts", alert), (b"sample-on-alerts", s(), [])]
    window = codec.encoder("ChargebackWindow").encode(fill("ChargebackWindow", namespace="poison"))
    on_chargeback = [*_undecodable("chargeback", window), (b"sample-on-chargeback", s(), [])]
    return {
        topics.SAMPLES: on_samples,
        topics.XID: on_xid,
        topics.ALERTS: on_alerts,
        topics.CHARGEBACK: on_chargeback,
    }


def _argv(name: str, kafka: str, prefix: str, port: int, tmp: Path, collector: Collector) -> list[str]:
    common = ["--bootstrap-servers", kafka, "--topic-prefix", prefix, "--log-format", "text"]
    common += ["--listen", f"127.0.0.1:{port}"]
    if name == "chargeback":
        return [name, *common, "--group-id", f"{prefix}chargeback", *CHARGEBACK_ARGS]
    if name == "lake":
        lake = ["--catalog-uri", f"sqlite:///{tmp}/catalog.db", "--warehouse", str(tmp / "warehouse")]
        return ["lake", "write", *common, *lake, "--flush-interval", "300ms"]
    if name == "otlp":
        endpoint = f"http://127.0.0.1:{collector.grpc_port}"
        return [name, *common, "--otlp-endpoint", endpoint, "--otlp-protocol", "grpc", "--otlp-timeout", "3s"]
    return [name, *common]


def test_the_catalogue_stops_no_consumer_loses_no_record_and_moves_no_bill(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ref_prefix = topic_prefix + "ref."  # a chargeback that reads the good samples alone
    ensure_topics(kafka, topics.ALL, prefix=topic_prefix)
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=ref_prefix)
    codec = AvroCodec()
    enc_s = codec.encoder("GpuSample").encode
    ports = {name: free_port() for name in SERVICES}
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in SERVICES}
    collector = Collector(tmp_path)
    collector.start()
    ref_log = tmp_path / "chargeback-ref.log"
    ref = start_service(kafka, ref_prefix, ref_log, "--group-id", f"{ref_prefix}chargeback", *CHARGEBACK_ARGS)
    try:
        for name in SERVICES:
            argv = _argv(name, kafka, topic_prefix, ports[name], tmp_path, collector)
            with logs[name].open("wb") as out:
                procs[name] = popen([*GPUPIPE, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        for name in SERVICES:
            wait_for(
                lambda n=name: _healthz(ports[n])[0] == 200 or procs[n].poll() is not None,
                120,
                f"{name} ready",
            )
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]

        # Good samples: 15 minutes of a 2-GPU node, closed windows the chargeback bills, the hostile
        # records in the middle of them, all in one partition (the order the reference reads too).
        now = int(time.time() * 1000)
        start = now - now % 300_000 - 900_000
        fleet = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=2))
        history = [rec for t in range(start, now - 60_000, TICK_MS) for rec in fleet.tick(t)[0]]
        half = len(history) // 2
        hostile = _catalogue(codec, history[half], now)
        p = Producer({"bootstrap.servers": kafka, "message.max.bytes": 2_000_000, "enable.idempotence": True})
        t_samples = topics.with_prefix(topic_prefix, topics.SAMPLES)
        good_sent = 0

        def good(recs: list[dict[str, Any]], prefix: str = topic_prefix) -> None:
            for rec in recs:
                p.produce(
                    topics.with_prefix(prefix, topics.SAMPLES), enc_s(rec), rec["uuid"].encode(), partition=0
                )

        good(history[:half])
        sent: Counter[str] = Counter()
        for base, records in hostile.items():
            for key, value, headers in records:
                part = {"partition": 0} if base == topics.SAMPLES else {}
                p.produce(topics.with_prefix(topic_prefix, base), value, key, headers=headers, **part)
                sent[base] += 1
        good(history[half:])
        good(history, ref_prefix)
        good_sent += len(history)
        good_xid = xid_event("node-good", "0000:3b:00", 79, now, uuid="GPU-good")
        p.produce(
            topics.with_prefix(topic_prefix, topics.XID), codec.encoder("XidEvent").encode(good_xid), b"good"
        )
        assert p.flush(60) == 0

        # -- every rejection dead-lettered, by every reader of the topic -------------------------
        dlq_topic = topics.with_prefix(topic_prefix, topics.DEADLETTER)
        must = {  # (topic, key) of each hostile record the service must dead-letter
            name: {
                (topics.with_prefix(topic_prefix, base), key)
                for base in inputs
                for key, _, _ in hostile[base]
                if (name, key) not in UNREAD
            }
            for name, inputs in SERVICES.items()
        }
        missing: dict[str, set] = {}

        def all_dead_lettered() -> bool:
            dead: dict[str, set] = {name: set() for name in SERVICES}
            for m in read_to_end(kafka, dlq_topic):
                h = dict(m.headers())
                dead.setdefault(h["gpupipe.dlq.service"].decode(), set()).add(
                    (h["gpupipe.dlq.topic"].decode(), m.key())
                )
            missing.update({name: must[name] - dead[name] for name in SERVICES})
            return not any(missing.values())

        try:
            wait_for(all_dead_lettered, 120, "every hostile record dead-lettered by every reader")
        except AssertionError as exc:
            tails = "".join(f"\n--- {n}\n{logs[n].read_text()[-3000:]}" for n in SERVICES if missing[n])
            raise AssertionError(f"{exc}; not dead-lettered: {missing}{tails}") from None
        for name in SERVICES:
            assert procs[name].poll() is None, f"{name} stopped: {logs[name].read_text()[-3000:]}"
            status, detail = _healthz(ports[name])
            assert status == 200, f"{name}: {detail} {logs[name].read_text()[-3000:]}"

        # -- bills: finite, and those of the good samples alone ----------------------------------
        progress = [
            Progress(kafka, f"{prefix}chargeback", topics.with_prefix(prefix, topics.SAMPLES))
            for prefix in (topic_prefix, ref_prefix)
        ]
        try:
            for prog in progress:
                prog.wait_done(120, [procs["chargeback"], ref])
        finally:
            for prog in progress:
                prog.close()
        outputs: list[list[dict[str, Any]]] = []

        def both_closed() -> bool:  # the last window of each closes on its idle timeout
            outputs[:] = [
                read_output(kafka, topics.with_prefix(prefix, topics.CHARGEBACK))
                for prefix in (topic_prefix, ref_prefix)
            ]
            return bool(outputs[1]) and totals(outputs[0]).keys() == totals(outputs[1]).keys()

        try:
            wait_for(both_closed, 60, "the same windows billed with and without the hostile records")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {[sorted(totals(o)) for o in outputs]}") from None
        bills, alone = outputs
        for b in bills:
            assert all(math.isfinite(v) for v in b.values() if isinstance(v, float)), b
        assert_same_totals(totals(bills), totals(alone))

        # -- the good XID's alert fires: the forged ack closed nothing ----------------------------
        def alert_of_good() -> dict[str, Any] | None:
            recs = [
                codec.decode(m.value()).record
                for m in read_to_end(kafka, topics.with_prefix(topic_prefix, topics.ALERTS))
                if m.key() not in {k for k, _, _ in hostile[topics.ALERTS]}
            ]
            mine = [r for r in recs if r.get("hostname") == "node-good" and r.get("status") != "action"]
            return mine[-1] if mine else None

        latest = wait_for(alert_of_good, 60, "the good XID's alert")
        assert latest["status"] == "firing", latest

        # -- the good GPUs on /metrics and at the collector, while samples keep coming -------------
        uuid = history[0]["uuid"]

        def good_everywhere() -> bool:
            recs = fleet.tick(int(time.time() * 1000))[0]
            for rec in recs:
                p.produce(t_samples, enc_s(rec), rec["uuid"].encode())
            p.flush(10)
            nonlocal good_sent
            good_sent += len(recs)
            time.sleep(0.5)  # a scrape after the consume loops' next batch, not a clock to race
            metrics, _ = collector.requests()
            return uuid in _scrape(ports["metrics"]) and any(uuid in str(m) for m in metrics)

        wait_for(good_everywhere, 60, "the good GPU on /metrics and at the collector")
        text = _scrape(ports["metrics"])
        assert 'xid="-1"' not in text and 'xid="2147483647"' not in text
        assert max(len(line) for line in text.splitlines()) < 10_000, "a hostile string reached /metrics"

        # -- the lake: every good sample, no hostile one ------------------------------------------
        def lake_rows() -> float:
            m = re.search(r'gpupipe_lake_rows_total\{table="samples"\} (\S+)', _scrape(ports["lake"]))
            return float(m.group(1)) if m else 0.0

        wait_for(lambda: lake_rows() >= good_sent, 60, f"{good_sent} samples in the lake")
        assert lake_rows() == good_sent
        for name in SERVICES:
            assert procs[name].poll() is None, f"{name} stopped: {logs[name].read_text()[-3000:]}"
        print(f"poison suite: sent {dict(sent)}; dead-lettered { ({n: len(k) for n, k in must.items()}) }")
    finally:
        for proc in [*procs.values(), ref]:
            if proc.poll() is None:
                stop_group(proc)
        collector.stop()
