"""Closed periods stay closed: a producer credential cannot bill a month invoiced long ago.

A forged backlog scaled down, on a real broker with
``gpupipe chargeback`` in a subprocess: made-up GPUs send one sample each, dated 300 days ago and
billed to the namespace ``victim``, on partitions whose watermark is empty, then live samples move
those partitions' event time to now. Before ``--max-sample-age`` they formed windows of that old
month and the monthly report for it grew. Now each is dead-lettered ``too-old`` and the report of
the month is what it was; a node's late replay (samples three hours old, inside the bound) is
still billed.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.domain.prices import PriceTable
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.chargeback.records import WINDOW, GpuTimeAggregate, to_record
from gpupipe_consumers.chargeback.windows import record_id
from gpupipe_schemas.codec import AvroCodec
from tests.integration.chargeback_util import (
    Progress,
    kill_left,
    new_id,
    past_hour_ms,
    read_output,
    read_to_end,
    start_service,
    stop_service,
)
from tests.integration.kafka_util import gpupipe
from tests.synthetic_fleet import blank_sample

pytestmark = pytest.mark.integration

DAY = 86_400_000
PARTITIONS = 12  # the samples topic's (topics.SAMPLES)
ATTACK_PER_PARTITION = 4
ARGS = ("--window", "10m", "--grace", "1m", "--commit-interval", "200ms")


def sample(uuid: str, ns: str, ts: int, interval_ms: int = 10_000) -> dict[str, Any]:
    return blank_sample(
        timestamp_ms=ts,
        hostname="node-v",
        gpu_index=0,
        uuid=uuid,
        pci_bus_id="00000000:10:00.0",
        model_name="NVIDIA H200",
        allocations=[
            {"namespace": ns, "pod": "train-0", "container": "main", "resource_name": "nvidia.com/gpu"}
        ],
        interval_ms=interval_ms,
        gpu_lost=False,
        gpu_util_ratio=0.5,
        power_w=100.0,
    )


def month_of(ts_ms: int) -> tuple[str, str, int]:
    """The UTC month holding ``ts_ms``: its first day, the next month's, and its start in ms."""
    d = dt.datetime.fromtimestamp(ts_ms / 1000, dt.UTC).date().replace(day=1)
    nxt = (d + dt.timedelta(days=32)).replace(day=1)
    start = int(dt.datetime(d.year, d.month, 1, tzinfo=dt.UTC).timestamp() * 1000)
    return d.isoformat(), nxt.isoformat(), start


def month_report(kafka: str, prefix: str, start: str, end: str) -> list[dict[str, Any]]:
    res = gpupipe(
        "report", "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", prefix,
        "--by", "namespace", "--period", "month", "--from", start, "--to", end, "--format", "json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_samples_for_a_long_closed_month_are_dead_lettered_not_billed(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    now = int(time.time() * 1000)
    past = now - 300 * DAY
    first, nxt, month_ms = month_of(past)

    # What that month was invoiced with: one hour of victim's GPU, written by chargeback back then.
    agg = GpuTimeAggregate()
    agg.allocated_s, agg.used_s, agg.energy_j, agg.samples = 3600.0, 1800.0, 1e6, 360
    ws = month_ms + DAY
    key = (ws, "victim", "node-v", "NVIDIA H200")
    prices = PriceTable(energy_per_kwh=0.1, exact={"nvidia h200": 4.0})
    billed = to_record(
        key, agg, kind=WINDOW, window_ms=3_600_000, prices=prices, partition=0, instance_id="t",
        emitted_at_ms=ws + 3_900_000,
    )  # fmt: skip
    billed["record_id"] = record_id(WINDOW, 0, key, "0")
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    enc_out = AvroCodec().encoder("ChargebackWindow").encode
    p.produce(topic_prefix + topics.CHARGEBACK, enc_out(billed), b"victim/node-v", timestamp=ws + 3_901_000)
    assert p.flush(30) == 0
    invoiced = month_report(kafka, topic_prefix, first, nxt)
    assert [r["namespace"] for r in invoiced] == ["victim"]

    enc = AvroCodec().encoder("GpuSample").encode
    # Partition 0: a node's late replay, three hours old (inside the default bound of a day).
    late = past_hour_ms(3)
    for k in range(6):
        p.produce(t_in, enc(sample("GPU-late", "late-ok", late + k * 10_000)), b"GPU-late", partition=0)
    # Every other partition (watermark empty): made-up GPUs dated 300 days ago, billed to victim.
    attack = 0
    for part in range(1, PARTITIONS):
        for k in range(ATTACK_PER_PARTITION):
            rec = sample(f"GPU-past-{part}-{k}", "victim", past + attack * 1000, interval_ms=600_000)
            p.produce(t_in, enc(rec), f"GPU-past-{part}-{k}".encode(), partition=part)
            attack += 1
    # Then live traffic on every partition: event time moves to now, so the old windows would close.
    for part in range(PARTITIONS):
        p.produce(t_in, enc(sample(f"GPU-live-{part}", "live", now - 120_000)), b"live", partition=part)
    assert p.flush(30) == 0

    group, log = f"cb-closed-{new_id()}", tmp_path / "chargeback.log"
    prog = Progress(kafka, group, t_in)
    procs = {}
    try:
        procs["cb"] = start_service(kafka, topic_prefix, log, *ARGS, "--group-id", group)
        prog.wait_done(90, list(procs.values()))
        assert stop_service(procs["cb"]) == 0, log.read_text()[-3000:]
    finally:
        prog.close()
        kill_left(procs)

    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    old = [r["record_id"] for r in out if r["window_start_ms"] < now - DAY]
    assert old == [billed["record_id"]], "a sample 300 days old was billed"
    late_rows = [r for r in out if r["namespace"] == "late-ok"]
    assert sum(r["allocated_gpu_seconds"] for r in late_rows) == pytest.approx(60.0), "late replay billed"
    dlq = read_to_end(kafka, topic_prefix + topics.DEADLETTER)
    reasons = [dict(m.headers())["gpupipe.dlq.reason"] for m in dlq]
    assert reasons == [b"too-old"] * attack, reasons
    assert month_report(kafka, topic_prefix, first, nxt) == invoiced
