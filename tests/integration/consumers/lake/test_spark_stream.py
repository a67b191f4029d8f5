"""The Structured Streaming recipe reads gpu.samples.v1 from a real broker as docs/topics.md says
the records are framed: every sample decoded, counted per node with its power, and records of
another schema or framing skipped rather than decoded wrongly."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Producer

from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import REPO
from tests.spark_recipe import run_recipe

pytestmark = pytest.mark.integration

RECIPE = REPO / "docs" / "recipes" / "spark_stream_samples.py"


def test_stream_reads_the_samples_topic(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    topic = topic_prefix + "gpu.samples.v1"
    ensure_topics(kafka, ["gpu.samples.v1"], prefix=topic_prefix)
    enc = AvroCodec().encoder("GpuSample")
    fleet = SimulatedFleet(FleetConfig(nodes=3, gpus_per_node=4))
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    count: Counter[str] = Counter()
    power: dict[str, float] = defaultdict(float)
    for i in range(25):
        for s in fleet.tick(1_790_000_000_000 + i * 1000)[0]:
            p.produce(topic, enc.encode(s), s["uuid"].encode())
            count[s["hostname"]] += 1
            power[s["hostname"]] += s["power_w"] or 0.0
    p.produce(topic, b"\x00\x00\x00\x00\x07" + b"\x02" * 40, b"registry-framed")
    p.produce(topic, b"\xc3\x01" + b"\x00" * 8 + b"\x02" * 40, b"unknown-fingerprint")
    assert p.flush(30) == 0

    args = ["--bootstrap-servers", kafka, "--topic", topic, "--available-now"]
    got = run_recipe(RECIPE, [*args, "--checkpoint", str(tmp_path / "checkpoint")], tmp_path)
    assert got["skipped"] == 2
    assert {h: n["samples"] for h, n in got["nodes"].items()} == dict(count)
    for h, n in got["nodes"].items():
        assert n["power_w"] == pytest.approx(power[h], rel=1e-9)
