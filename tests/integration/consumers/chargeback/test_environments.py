"""Chargeback identities on a real broker: two environments side by side, and a fenced twin.

With ``--topic-prefix`` not reaching the group id, ``group.instance.id`` and
``transactional.id``, a staging instance fenced production and took its partitions, and
production billing stopped without an error. The fenced instance lived on as a
healthy zombie and exited 0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_schemas.codec import AvroCodec
from tests.integration.chargeback_util import (
    Progress,
    kill_left,
    new_id,
    past_hour_ms,
    read_output,
    start_service,
    stop_service,
    totals,
    wait_log,
)
from tests.synthetic_fleet import blank_sample

pytestmark = pytest.mark.integration

T0 = past_hour_ms(3)
ARGS = ("--window", "10m", "--grace", "1m", "--commit-interval", "200ms")
SAME_POD_NAME = "gpupipe-chargeback-0"  # what the StatefulSet gives both environments


def samples(ns: str, gpus: int, k_from: int, k_to: int) -> list[dict[str, Any]]:
    return [
        blank_sample(
            timestamp_ms=T0 + k * 10_000,
            hostname=f"node-{g}",
            gpu_index=0,
            uuid=f"GPU-{ns}-{g}",
            pci_bus_id="00000000:10:00.0",
            model_name="NVIDIA H200",
            allocations=[
                {
                    "namespace": ns,
                    "pod": f"{ns}-pod",
                    "container": "c",
                    "resource_name": "nvidia.com/gpu",
                    "replica": None,
                }
            ],
            interval_ms=10_000,
            gpu_lost=False,
            gpu_util_ratio=0.5,
            power_w=100.0,
        )
        for k in range(k_from, k_to)
        for g in range(gpus)
    ]


def produce(
    kafka: str,
    topic: str,
    items: list[dict[str, Any]],
    partition: int | None = None,
    node_clock: bool = False,
) -> None:
    """``node_clock``: stamp each record with its sample's time, as the node agent's producer does
    (CreateTime from the node's own clock, however wrong it is)."""
    enc = AvroCodec().encoder("GpuSample").encode
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "linger.ms": 20})
    for s in items:
        kw: dict[str, Any] = {} if partition is None else {"partition": partition}
        if node_clock:
            kw["timestamp"] = s["timestamp_ms"]
        p.produce(topic, enc(s), s["uuid"].encode(), **kw)
    assert p.flush(30) == 0


def allocated(records: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (ns,), v in totals(records, ("namespace",)).items():
        out[ns] = v["allocated_gpu_seconds"]
    return out


def test_prod_and_staging_with_the_same_pod_name_both_bill(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    envs = {name: f"{topic_prefix}{name}." for name in ("prod", "staging")}
    procs: dict[str, Any] = {}
    progs: dict[str, Progress] = {}
    logs = {name: tmp_path / f"{name}.log" for name in envs}
    try:
        for name, prefix in envs.items():
            ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=prefix)
            produce(kafka, prefix + topics.SAMPLES, samples(name, 4, 0, 90))
        for name, prefix in envs.items():
            # No --group-id: the default must carry the prefix. Same --instance-id in both.
            procs[name] = start_service(kafka, prefix, logs[name], *ARGS, "--instance-id", SAME_POD_NAME)
            wait_log(logs[name], "partitions assigned")
            progs[name] = Progress(kafka, f"{prefix}gpupipe-chargeback", prefix + topics.SAMPLES)
        for name in envs:
            progs[name].wait_done(60, procs.values())
        # New production input after staging started: it must still be billed.
        produce(kafka, envs["prod"] + topics.SAMPLES, samples("prod", 4, 90, 150))
        progs["prod"].refresh_high()
        progs["prod"].wait_done(60, procs.values())
        for name in envs:
            assert stop_service(procs[name]) == 0, logs[name].read_text()[-3000:]
    finally:
        kill_left(procs)
        for prog in progs.values():
            prog.close()
    for name, prefix in envs.items():
        text = logs[name].read_text()
        assert f"transactional_id={prefix}gpupipe-chargeback.{SAME_POD_NAME}" in text, text[-2000:]
    prod = allocated(read_output(kafka, envs["prod"] + topics.CHARGEBACK))
    staging = allocated(read_output(kafka, envs["staging"] + topics.CHARGEBACK))
    # Closed windows (10 min + 1 min grace) per GPU: prod's input reaches 1490 s (windows 0 and 1),
    # staging's 890 s (window 0). Each GPU bills 10 s per sample.
    assert prod == pytest.approx({"prod": 4 * 1200.0})
    assert staging == pytest.approx({"staging": 4 * 600.0})


def test_a_fenced_twin_exits_non_zero_within_seconds(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    produce(kafka, topic_prefix + topics.SAMPLES, samples("a", 2, 0, 30))
    group = f"cb-twin-{new_id()}"
    args = (*ARGS, "--group-id", group, "--instance-id", "twin")
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_service(kafka, topic_prefix, first_log, *args)
    second = None
    try:
        wait_log(first_log, "partitions assigned")
        second = start_service(kafka, topic_prefix, second_log, *args)
        wait_log(second_log, "partitions assigned")
        began = time.monotonic()
        rc = first.wait(timeout=45)
        assert rc != 0, first_log.read_text()[-3000:]
        assert time.monotonic() - began < 45
        assert "fatal" in first_log.read_text().lower()
        assert second.poll() is None, second_log.read_text()[-3000:]
        assert stop_service(second) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
