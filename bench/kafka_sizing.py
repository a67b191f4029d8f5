"""Kafka sizing, measured: bytes per record of each topic on a real broker, producer throughput, and
the sizing table they give for 10k and 100k GPUs at 1 s and 10 s.

Starts its own broker with scripts/kafka-local (own KAFKA_LOCAL_DIR and ports, so it never meets a
running one) and always stops it. For each topic (samples, XIDs, alerts, chargeback windows) it
encodes records with the project's codec (samples and XIDs from gpupipe_producer.simulated; alerts
and windows filled from their Avro schemas with the fleet's hosts and XID texts), produces them with
the producer's real settings (`producer_config`: zstd, linger 50 ms, acks=all, idempotent) to a topic
created with the shipped specs, and reads the log segment bytes on disk.

Samples are produced twice: as a backfill (`--speed max`, large batches) and as node agents send
them (one node's 8 GPUs a tick, flushed: small batches, worse compression). The table uses the node
agent figure. Throughput: records/s of one producer into a one-partition topic (the per-partition
ceiling on this machine). Arithmetic: bench/kafka_sizing_table.py.

XIDs, alerts and windows are produced one record a flush, as they are sent (no batch to compress).

Ratio: kafka_sizing = budget / measured on-disk bytes per sample (node-agent batches). The budget,
500 B per sample (43 MB per GPU-day at 1 s, 50 MB/s of ingress per copy at 100k GPUs a second), is
an absolute budget, not a baseline run side by side.

    PYTHONPATH=. .venv/bin/python bench/kafka_sizing.py [--ticks 400]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from common import REPO, figure, ratio_line
from kafka_sizing_table import Measured, render, sizing_rows
from lake_records import fill

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

STATE = REPO / ".run" / "kafka-sizing"
PORT = int(os.environ.get("GPUPIPE_SIZING_PORT", "19292"))
T0 = 1_795_000_000_000
BUDGET_B_PER_SAMPLE = 500.0
FLEETS = [(10_000, 1.0), (10_000, 10.0), (100_000, 1.0), (100_000, 10.0)]


def kafka(cmd: str) -> str:
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(STATE),
        "KAFKA_PORT": str(PORT),
        "KAFKA_CONTROLLER_PORT": str(PORT + 1),
    }
    args = [str(REPO / "scripts" / "kafka-local"), cmd] + (
        ["--port", str(PORT), "--fresh"] if cmd == "start" else []
    )
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if cmd == "start" and out.returncode != 0:
        raise SystemExit(f"sizing broker did not start:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def disk_bytes(topic: str) -> int:
    return sum(f.stat().st_size for d in (STATE / "data").glob(f"{topic}-*") for f in Path(d).glob("*.log"))


def samples_and_xids(ticks: int) -> tuple[list[dict], list[dict]]:
    fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8, seed=7))
    samples = [s for k in range(ticks) for s in fleet.tick(T0 + k * 1000)[0]]
    # XIDs at a high rate only to get enough of them; each record is as the agent sends it
    hot = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8, seed=8, xid_rate_per_gpu_hour=400.0))
    xids = [x for k in range(80) for x in hot.tick(T0 + k * 1000)[1]]
    return samples, xids


def alerts_from(xids: list[dict]) -> list[dict]:
    out = []
    for i, x in enumerate(xids):
        for status in ("firing", "resolved"):
            out.append(
                fill("GpuAlert")
                | dict(
                    alert_id=str(uuid.UUID(int=i)),
                    status=status,
                    sequence=1 if status == "firing" else 2,
                    alertname="GpuXidError",
                    signal=f"xid:{x['xid']}",
                    xid_codes=[x["xid"]],
                    name=f"XID {x['xid']}",
                    summary=f"XID {x['xid']} on {x['hostname']}",
                    description=x["message"],
                    rule="xid-catalog",
                    catalog_version="r570",
                    hostname=x["hostname"],
                    gpu_uuid=x.get("uuid"),
                    pci_bus_id=x.get("pci_bus_id"),
                    message=x["message"],
                    runbook="https://example.org/runbooks/gpu-xid",
                    instance="alerts-0",
                    first_seen_ms=x["timestamp_ms"],
                    last_seen_ms=T0,
                    emitted_at_ms=T0,
                    occurrences=1,
                )
            )
    return out


def windows(n: int) -> list[dict]:
    return [
        fill(
            "ChargebackWindow",
            window_start_ms=T0 + (i // 16) * 3_600_000,
            window_end_ms=T0 + (i // 16 + 1) * 3_600_000,
            namespace=f"team-{i % 40:02d}",
            team=f"team-{i % 40:02d}",
            node=f"sim-node-{i % 16:04d}",
            gpu_model="NVIDIA H100 80GB HBM3",
            allocated_gpu_seconds=28_800.0 - i % 7,
            used_gpu_seconds=20_000.0 + i * 1.37,
            idle_gpu_seconds=8_000.0 - i * 0.91,
            energy_joules=1.7e7 + i * 13.1,
            sample_count=28_800 - i % 5,
            price_per_gpu_hour=2.5,
            price_per_kwh=0.12,
            cost_allocation=20.0 + i * 0.013,
            cost_energy=0.56 + i * 0.0007,
            cost_total=20.56 + i * 0.0137,
            currency="USD",
            source_partition=i % 12,
            instance_id="chargeback-0",
            emitted_at_ms=T0 + i,
            record_id=str(uuid.UUID(int=i + 1)),
        )
        for i in range(n)
    ]


def produce(bootstrap: str, topic: str, recs: list[tuple[bytes, bytes]], per_flush: int = 0) -> float:
    """Produce (key, value) pairs with the producer's real config; flush every ``per_flush`` (0: once)."""
    pub = Publisher(producer_config(bootstrap))
    t = time.perf_counter()
    for i, (k, v) in enumerate(recs, 1):
        pub.produce(topic, k, v)
        if per_flush and i % per_flush == 0:
            pub.flush(60)
    left = pub.flush(120)
    dt = time.perf_counter() - t
    assert left == 0 and pub.failed == 0, f"{topic}: undelivered={left} failed={pub.failed}"
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=400, help="ticks of 16x8 GPUs (400 = 51,200 samples)")
    ap.add_argument("--agent-ticks", type=int, default=60, help="ticks sent as node agents do (x16 flushes)")
    a = ap.parse_args()
    codec = AvroCodec()
    samples, xids = samples_and_xids(a.ticks)
    enc = {
        name: codec.encoder(name).encode for name in ("GpuSample", "XidEvent", "GpuAlert", "ChargebackWindow")
    }
    data = {
        topics.SAMPLES: [(s["uuid"].encode(), enc["GpuSample"](s)) for s in samples],
        topics.XID: [(x["hostname"].encode(), enc["XidEvent"](x)) for x in xids],
        topics.ALERTS: [(r["alert_id"].encode(), enc["GpuAlert"](r)) for r in alerts_from(xids)],
        topics.CHARGEBACK: [(r["node"].encode(), enc["ChargebackWindow"](r)) for r in windows(1000)],
    }
    for t, recs in data.items():
        figure(
            f"encoded_bytes_per_record[{t}]",
            sum(len(v) for _, v in recs) / len(recs),
            f"B ({len(recs)} records)",
        )
    shutil.rmtree(STATE, ignore_errors=True)
    bootstrap = kafka("start")
    try:
        prefix = f"sizing-{uuid.uuid4().hex[:6]}."
        agent = prefix + "agent." + topics.SAMPLES
        one = prefix + "one-partition"
        ensure_topics(bootstrap, list(data), prefix=prefix)
        ensure_topics(bootstrap, [topics.SAMPLES], prefix=prefix + "agent.")
        ensure_topics(
            bootstrap,
            ["one-partition"],
            prefix=prefix,
            specs={"one-partition": topics.TopicSpec(1, 86_400_000)},
        )
        for t, recs in data.items():
            # samples in backfill batches here (node-agent batches below); the rest one record a
            # flush, as they are sent (an XID, an alert, a window at a time)
            produce(bootstrap, prefix + t, recs, per_flush=0 if t == topics.SAMPLES else 1)
        n_agent = a.agent_ticks * 128
        produce(bootstrap, agent, data[topics.SAMPLES][:n_agent], per_flush=8)
        dt = min(produce(bootstrap, one, data[topics.SAMPLES]) for _ in range(2))
        rate = len(data[topics.SAMPLES]) / dt
        time.sleep(1.0)  # a settling pause for a size reading (not a test): segment files reach the disk
        disk = {t: disk_bytes(prefix + t) / len(recs) for t, recs in data.items()}
        backfill = disk[topics.SAMPLES]
        disk[topics.SAMPLES] = disk_bytes(agent) / n_agent
    finally:
        kafka("stop")
    for t, b in disk.items():
        figure(f"disk_bytes_per_record[{t}]", b, "B (zstd, on the broker's log segments)")
    figure("disk_bytes_per_sample_backfill", backfill, "B (--speed max batches)")
    figure("disk_bytes_per_gpu_day_1s", disk[topics.SAMPLES] * 86_400 / 1e6, "MB (node-agent batches)")
    figure("producer_records_per_s_one_partition", rate, "records/s (GpuSample)")
    rows = sizing_rows(Measured(disk, rate), FLEETS)
    print(render(rows), flush=True)
    ratio_line("kafka_sizing", BUDGET_B_PER_SAMPLE / disk[topics.SAMPLES], 1.0)


if __name__ == "__main__":
    main()
