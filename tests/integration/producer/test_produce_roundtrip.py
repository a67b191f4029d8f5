"""End to end: simulated samples go to a real broker and come back identical."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from gpupipe.common.durations import parse_iso_ms
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import gpupipe, read_all

pytestmark = pytest.mark.integration

START = "2026-11-30T00:00:00Z"


def test_simulated_samples_roundtrip_identical(kafka: str, topic_prefix: str) -> None:
    nodes, gpus, interval_s, duration_s, seed = 3, 4, 10, 600, 42
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(gpus),
        "--interval",
        f"{interval_s}s",
        "--duration",
        f"{duration_s}s",
        "--start-time",
        START,
        "--speed",
        "max",
        "--seed",
        str(seed),
        "--xid-rate",
        "30",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
    )
    assert res.returncode == 0, res.stderr
    expected_n = nodes * gpus * duration_s // interval_s
    msgs = read_all(kafka, f"{topic_prefix}gpu.samples.v1", expect=expected_n)
    assert len(msgs) == expected_n  # exactly nodes x gpus x duration/interval

    # The same fleet, seed and start time in-process gives the same records.
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=nodes,
            gpus_per_node=gpus,
            interval_ms=interval_s * 1000,
            seed=seed,
            xid_rate_per_gpu_hour=30,
        )
    )
    t0 = parse_iso_ms(START)
    want_samples, want_xids = {}, {}
    for k in range(duration_s // interval_s):
        samples, xids = fleet.tick(t0 + k * interval_s * 1000)
        for r in samples:
            want_samples[(r["mig"]["mig_uuid"] if r["mig"] else r["uuid"], r["timestamp_ms"])] = r
        for x in xids:
            want_xids[x["event_id"]] = x
    codec = AvroCodec()
    got = {}
    for m in msgs:
        rec = codec.decode(m.value()).record
        key = rec["mig"]["mig_uuid"] if rec["mig"] else rec["uuid"]
        assert m.key().decode() == rec["uuid"], "keyed by the physical GPU's UUID (a MIG slice too)"
        got[(key, rec["timestamp_ms"])] = rec
    assert got == want_samples

    # Each GPU's records stay ordered in one partition.
    per_key_partitions: dict[bytes, set[int]] = {}
    for m in msgs:
        per_key_partitions.setdefault(m.key(), set()).add(m.partition())
    assert all(len(p) == 1 for p in per_key_partitions.values())

    xmsgs = read_all(kafka, f"{topic_prefix}gpu.xid.v1", expect=len(want_xids))
    assert want_xids, "an xid rate of 30/GPU-hour over 2 GPU-hours yields events"
    assert {
        codec.decode(m.value()).record["event_id"]: codec.decode(m.value()).record for m in xmsgs
    } == want_xids


def test_topics_created_with_partitions_and_retention(kafka: str, topic_prefix: str) -> None:
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--duration",
        "1s",
        "--speed",
        "max",
        "--topic-partitions",
        "deadletter=2",
        "--topic-retention",
        "alerts=7d",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
    )
    assert res.returncode == 0, res.stderr
    admin = AdminClient({"bootstrap.servers": kafka})
    md = admin.list_topics(timeout=10).topics
    for base, parts in [
        ("gpu.samples.v1", 12),
        ("gpu.xid.v1", 3),
        ("gpu.deadletter.v1", 2),
        ("gpu.chargeback.v1", 3),
        ("gpu.alerts.v1", 3),
    ]:
        assert len(md[topic_prefix + base].partitions) == parts
    res_cfg = admin.describe_configs([ConfigResource("topic", topic_prefix + "gpu.xid.v1")])
    cfg = next(iter(res_cfg.values())).result()
    assert cfg["retention.ms"].value == str(30 * 86_400_000)
    res_cfg = admin.describe_configs([ConfigResource("topic", topic_prefix + "gpu.alerts.v1")])
    assert next(iter(res_cfg.values())).result()["retention.ms"].value == str(7 * 86_400_000)


def test_tail_decodes_and_reports_foreign_bytes(kafka: str, topic_prefix: str) -> None:
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--duration",
        "3s",
        "--speed",
        "max",
        "--start-time",
        START,
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
    )
    assert res.returncode == 0, res.stderr
    topic = f"{topic_prefix}gpu.samples.v1"
    p = Producer({"bootstrap.servers": kafka})
    p.produce(topic, b'{"not": "avro"}', key=b"junk")
    p.flush(10)
    out = gpupipe(
        "tail",
        "gpu.samples.v1",
        "--from-beginning",
        # No --max: the six samples and the junk share partitions in no fixed order, so tail
        # must read until the topic goes quiet to be sure it met the junk.
        "--idle-timeout",
        "5s",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(lines) == 6
    assert {x["timestamp_ms"] for x in lines} == {parse_iso_ms(START) + k * 1000 for k in range(3)}
    assert "not a gpupipe Avro record (not-gpupipe-avro" in out.stderr


def test_tail_into_head_ends_quietly(kafka: str, topic_prefix: str) -> None:
    """`gpupipe tail ... | head -1`, through a real pipe: no traceback, the status of a tool SIGPIPE ends."""
    import subprocess

    from tests.integration.kafka_util import GPUPIPE, REPO

    res = gpupipe(
        "produce", "--source", "simulated", "--nodes", "2", "--gpus-per-node", "8", "--duration", "30s",
        "--speed", "max", "--start-time", START, "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    tail_argv = [*GPUPIPE, "tail", "gpu.samples.v1", "--from-beginning", "--idle-timeout", "10"]
    tail_argv += ["--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
    tail = subprocess.Popen(tail_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert tail.stdout is not None and tail.stderr is not None
    head = subprocess.run(["head", "-1"], stdin=tail.stdout, capture_output=True, text=True, timeout=60)
    tail.stdout.close()  # head's end of the pipe is now the only reader, and it is gone
    err = tail.stderr.read().decode()
    assert tail.wait(60) == 141, err
    assert json.loads(head.stdout)["hostname"].startswith("sim-node-")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_confluent_framing_roundtrip_with_mock_registry(kafka: str, topic_prefix: str) -> None:
    # The mock registry lives in-process, so run producer and reader in this process.
    import argparse

    from gpupipe.kafka.admin import ensure_topics
    from gpupipe_consumers.tail import format_record
    from gpupipe_producer.command import fleet_config
    from gpupipe_producer.publish import Publisher, producer_config
    from gpupipe_producer.self_metrics import ProducerMetrics
    from gpupipe_producer.service import run_simulated
    from gpupipe_schemas.codec import codec_from_url

    ensure_topics(kafka, ["gpu.samples.v1"], prefix=topic_prefix)
    codec = codec_from_url("mock://roundtrip")
    topic = f"{topic_prefix}gpu.samples.v1"
    pub = Publisher(producer_config(kafka))
    args = argparse.Namespace(
        interval=1000,
        nodes=1,
        gpus_per_node=2,
        seed=1,
        xid_rate=0.0,
        hostname_prefix="n",
        start_time=parse_iso_ms(START),
        duration=2000,
        speed=0.0,
    )
    import threading

    run_simulated(
        args,
        fleet_config(args),
        pub,
        ProducerMetrics(),
        threading.Event(),
        topic,
        f"{topic_prefix}gpu.xid.v1",
        codec.encoder("GpuSample", topic).encode,
        codec.encoder("XidEvent").encode,
    )
    assert pub.flush(30) == 0 and pub.failed == 0
    msgs = read_all(kafka, topic, expect=4)
    assert len(msgs) == 4
    for m in msgs:
        assert m.value()[0] == 0  # Confluent magic byte
        line, problem = format_record(codec, m, with_meta=False)
        assert problem is None and json.loads(line)["hostname"] == "n-0000"


def test_unreachable_broker_is_one_clear_line() -> None:
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--bootstrap-servers",
        "127.0.0.1:9",
        "--duration",
        "1s",
        timeout=60,
    )
    assert res.returncode == 3
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "cannot reach Kafka at 127.0.0.1:9" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--interval", "fast"], "bad duration"),
        (["--speed", "warp"], "bad speed"),
        (["--start-time", "noon"], "bad time"),
    ],
)
def test_bad_flags_are_one_clear_line(args: list[str], needle: str) -> None:
    res = gpupipe("produce", *args, timeout=60)
    assert res.returncode == 2
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr


def test_env_vars_set_flags(kafka: str, topic_prefix: str) -> None:
    res = gpupipe(
        "produce",
        "--duration",
        "2s",
        "--speed",
        "max",
        timeout=120,
        env={
            "GPUPIPE_BOOTSTRAP_SERVERS": kafka,
            "GPUPIPE_TOPIC_PREFIX": topic_prefix,
            "GPUPIPE_SOURCE": "simulated",
            "GPUPIPE_NODES": "1",
            "GPUPIPE_GPUS_PER_NODE": "3",
        },
    )
    assert res.returncode == 0, res.stderr
    assert len(read_all(kafka, f"{topic_prefix}gpu.samples.v1", expect=6)) == 6
