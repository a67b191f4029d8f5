"""The hostile-record catalogue against every consumer at once: none stops, none loses a good record.

metrics, alerts, recommend and chargeback run as docs/ describes them, on one topic prefix of a real
broker. Any GPU node may write to the sample and XID topics, so the catalogue goes to both: bytes
over librdkafka's message limit, a 1 MB header, junk, an empty value, trailing bytes after a valid
record, samples dated -2**63 or carrying NaN, 1e300 or a 200 KB namespace, Xid codes -1 and 2**31-1,
an Xid dated 2100, an operator's ack forged on the XID topic, and each record type on the other's
topic. Then: every service is alive and healthy, each dead-lettered at least every undecodable
record of its inputs, the good XID's alert is firing (the forged ack closed nothing) and the good
GPU is on /metrics.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe import topics
from gpupipe.kafka_admin import ensure_topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.chargeback_util import read_to_end
from tests.integration.consumers.alerts.test_service import xid_event
from tests.integration.kafka_util import GPUPIPE
from tests.unit.consumers.alerts.test_record import _records

pytestmark = pytest.mark.integration

SERVICES = {  # service -> the input topics it reads
    "metrics": (topics.SAMPLES, topics.XID),
    "alerts": (topics.SAMPLES, topics.XID, topics.ALERTS),
    "recommend": (topics.SAMPLES,),
    "chargeback": (topics.SAMPLES,),
}


def _healthz(port: int) -> tuple[int | None, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return None, {}


def _catalogue(
    codec: AvroCodec, sample: dict[str, Any], now: int
) -> dict[str, list[tuple[bytes, bytes | None, list]]]:
    """Per base topic: (key, value, headers) of every hostile record."""
    enc_s, enc_x, enc_a = (codec.encoder(n).encode for n in ("GpuSample", "XidEvent", "GpuAlert"))

    def s(**kw: Any) -> bytes:
        return enc_s({**copy.deepcopy(sample), **kw})

    def x(**kw: Any) -> bytes:
        return enc_x(xid_event("node-p", "0000:3b:00", 79, now, **{"uuid": "GPU-poison"}) | kw)

    undecodable = [
        (b"big", b"JUNK" + b"x" * 1_000_500, []),
        (b"big-header", b"\x00\x01junk", [("h", b"y" * 1_000_000)]),
        (b"junk", b"\xc3\x01garbage!", []),
        (b"empty", b"", []),
        (b"trailing", s() + b"\x00extra", []),
    ]
    on_samples = [
        *undecodable,
        (b"ts-min", s(timestamp_ms=-(2**63)), []),
        (b"power-nan", s(power_w=float("nan")), []),
        (b"util-huge", s(gpu_util_ratio=1e300), []),
        (b"long-ns", s(allocations=[{**sample["allocations"][0], "namespace": "n" * 200_000}]), []),
        (b"xid-on-samples", x(), []),
    ]
    on_xid = [
        *undecodable,
        (b"xid-minus-1", x(xid=-1), []),
        (b"xid-max", x(xid=2**31 - 1), []),
        (b"xid-2100", x(timestamp_ms=4_102_444_800_000), []),
        (b"forged-ack", enc_a(_records()[0]), []),
        (b"sample-on-xid", s(), []),
    ]
    return {topics.SAMPLES: on_samples, topics.XID: on_xid}


def test_the_catalogue_stops_no_consumer_and_loses_no_good_record(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, topics.ALL, prefix=topic_prefix)
    codec = AvroCodec()
    ports = {name: free_port() for name in SERVICES}
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in SERVICES}
    try:
        for name in SERVICES:
            argv = [name, "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
            argv += ["--listen", f"127.0.0.1:{ports[name]}", "--log-format", "text"]
            with logs[name].open("wb") as out:
                procs[name] = popen([*GPUPIPE, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        for name in SERVICES:
            wait_for(
                lambda n=name: _healthz(ports[n])[0] == 200 or procs[n].poll() is not None,
                120,
                f"{name} ready",
            )
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]

        now = int(time.time() * 1000)
        fleet = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=2))
        good_samples, _ = fleet.tick(now)
        hostile = _catalogue(codec, good_samples[0], now)
        p = Producer({"bootstrap.servers": kafka, "message.max.bytes": 2_000_000, "enable.idempotence": True})
        sent: Counter[str] = Counter()
        for base, records in hostile.items():
            for key, value, headers in records:
                p.produce(topics.with_prefix(topic_prefix, base), value, key, headers=headers)
                sent[base] += 1
        good_xid = xid_event("node-good", "0000:3b:00", 79, now, uuid="GPU-good")
        p.produce(
            topics.with_prefix(topic_prefix, topics.XID), codec.encoder("XidEvent").encode(good_xid), b"good"
        )
        t_samples = topics.with_prefix(topic_prefix, topics.SAMPLES)
        for rec in good_samples:
            p.produce(
                topics.with_prefix(topic_prefix, topics.SAMPLES),
                codec.encoder("GpuSample").encode(rec),
                rec["uuid"].encode(),
            )
        assert p.flush(60) == 0

        dlq_topic = topics.with_prefix(topic_prefix, topics.DEADLETTER)
        must = {  # what every reader of the topic must dead-letter: the undecodable records at least
            name: sum(5 for base in inputs if base in hostile) for name, inputs in SERVICES.items()
        }

        def by_service() -> Counter[str]:
            return Counter(
                dict(m.headers())["gpupipe.dlq.service"].decode() for m in read_to_end(kafka, dlq_topic)
            )

        wait_for(lambda: all(by_service()[n] >= must[n] for n in SERVICES), 120, f"dead letters {must}")
        for name in SERVICES:
            assert procs[name].poll() is None, f"{name} stopped: {logs[name].read_text()[-3000:]}"
            assert _healthz(ports[name])[0] == 200, name

        counts = by_service()
        # every hostile record of their inputs (metrics' XID reader leaves other owners' records alone)
        assert counts["alerts"] >= sent[topics.SAMPLES] + sent[topics.XID], counts
        assert counts["recommend"] >= sent[topics.SAMPLES], counts
        assert counts["chargeback"] >= sent[topics.SAMPLES], counts

        def alert_of_good() -> dict[str, Any] | None:
            recs = [
                codec.decode(m.value()).record
                for m in read_to_end(kafka, topics.with_prefix(topic_prefix, topics.ALERTS))
            ]
            mine = [r for r in recs if r.get("hostname") == "node-good" and r.get("status") != "action"]
            return mine[-1] if mine else None

        latest = wait_for(alert_of_good, 60, "the good XID's alert")
        assert latest["status"] == "firing", latest

        def good_on_metrics() -> bool:
            # samples keep coming, as a fleet's do (metrics shows a GPU while its samples arrive)
            for rec in fleet.tick(int(time.time() * 1000))[0]:
                p.produce(t_samples, codec.encoder("GpuSample").encode(rec), rec["uuid"].encode())
            p.flush(10)
            time.sleep(0.5)  # a scrape after the consume loop's next batch, not a clock to race
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10) as r:
                return good_samples[1]["uuid"] in r.read().decode()

        try:
            wait_for(good_on_metrics, 60, "the good GPU on /metrics")
        except AssertionError:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10)
                .read()
                .decode()
            )
            raise AssertionError(f"{logs['metrics'].read_text()[-3000:]}\n---\n{text[:1500]}") from None
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
        )
        assert 'xid="-1"' not in text and 'xid="2147483647"' not in text
        assert max(len(line) for line in text.splitlines()) < 10_000, (
            "a hostile string reached the exposition"
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop_group(proc)
