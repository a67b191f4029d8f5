"""STORM: 10,000 XID events in one second across 1,000 GPUs, through `gpupipe alerts` on a real broker.

The fleet is 125 nodes x 8 GPUs; every GPU reports 10 XIDs in the second, alternating between two codes
(2,000 distinct (GPU, XID) pairs; every node has all 8 GPUs failing, so every node also gets a burst
rollup). The events are encoded first, then published at an even pace over one second.

The alerts service runs in this process, wired exactly as `gpupipe alerts` wires it (AlertsService, default
settings: 10 min dedupe window, 30 s update interval, health signals on), in its own thread. Figures:

* ``alerts_storm_catchup``: seconds from the end of the burst (the last record acknowledged by Kafka)
  until the service had handled all 10,000 records and published what they caused -- consumer lag back
  to zero (the consume loop counts a record only after its batch was handled and the resulting alerts
  were flushed to Kafka). ratio = 5.0 s (the target) / that time, floored at 50 ms.
* ``alerts_storm_dedupe``: allowed alerts (one per (GPU, XID) plus one per node) / distinct alert ids the
  service published. >= 1 means no (GPU, XID) was alerted twice.

It also checks that nothing was lost: after a final flush, the occurrence counts of the GPU alerts add
up to the 10,000 events. Exit status 1 if a check fails.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter

from common import bench_kafka, figure, ratio_line
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from gpupipe.commands.cli import build_parser
from gpupipe.common.logs import setup_logging
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.alerts.command import options_from_args
from gpupipe_consumers.alerts.service import AlertsService
from gpupipe_schemas.codec import AvroCodec

NODES = 125
GPUS_PER_NODE = 8
EVENTS = 10_000
BURST_S = 1.0
SLICES = 100
CODES = (13, 31, 43, 48, 63, 74, 79, 94, 95, 119)
MESSAGES = {
    79: "GPU has fallen off the bus.",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
}


def storm_events(now_ms: int) -> list[dict]:
    gpus = [(n, g) for n in range(NODES) for g in range(GPUS_PER_NODE)]
    per_gpu = EVENTS // len(gpus)
    out = []
    for rep in range(per_gpu):
        for i, (n, g) in enumerate(gpus):
            gi = n * GPUS_PER_NODE + g
            code = CODES[gi % len(CODES)] if rep % 2 == 0 else CODES[(gi + 3) % len(CODES)]
            host, bus = f"storm-node-{n:04d}", f"0000:{0x18 + 0x10 * g:02x}:00"
            ts = now_ms + (rep * len(gpus) + i) * 1000 // EVENTS
            out.append(
                {
                    "event_id": f"{host}|kmsg|{bus}|{code}|{ts}|{rep}",
                    "timestamp_ms": ts,
                    "hostname": host,
                    "kind": "xid",
                    "xid": code,
                    "pci_bus_id": bus,
                    "gpu_index": g,
                    "uuid": f"GPU-{gi:08d}-0000-4000-8000-000000000000",
                    "model_name": "NVIDIA H200",
                    "driver_version": "570.124.06",
                    "pid": 1000 + rep if code in (13, 31, 43, 94, 95) else None,
                    "process_name": "python3" if code in (13, 31, 43, 94, 95) else None,
                    "message": MESSAGES.get(code, "storm"),
                    "gpu_instance_id": None,
                    "compute_instance_id": None,
                    "mig_uuid": None,
                    "source": "kmsg",
                    "allocations": [
                        {
                            "namespace": f"team-{n % 7}",
                            "pod": f"train-{n}",
                            "container": "main",
                            "resource_name": "nvidia.com/gpu",
                            "replica": None,
                        }
                    ],
                }
            )
    return out


def read_alerts(bootstrap: str, topic: str) -> list[dict]:
    codec = AvroCodec()
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"b-{uuid.uuid4()}", "enable.auto.commit": False}
    )
    md = c.list_topics(topic, timeout=10).topics[topic]
    ends = {}
    parts = []
    for p in md.partitions:
        _, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if high > 0:
            ends[p] = high
            parts.append(TopicPartition(topic, p, OFFSET_BEGINNING))
    c.assign(parts)
    out: list[dict] = []
    done: set[int] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(ends) and time.monotonic() < deadline:
        for m in c.consume(2000, 0.5):
            if m.error():
                continue
            out.append(codec.decode(m.value()).record)
            if m.offset() + 1 >= ends[m.partition()]:
                done.add(m.partition())
    c.close()
    return out


def main() -> int:
    setup_logging("warning", "text")
    logging.getLogger("gpupipe.kafka").setLevel(logging.ERROR)
    bootstrap = bench_kafka()
    prefix = f"bench-alerts-{uuid.uuid4().hex[:8]}."
    ensure_topics(
        bootstrap,
        [topics.XID, topics.SAMPLES, topics.ALERTS, topics.DEADLETTER, topics.CHARGEBACK],
        prefix=prefix,
    )
    t_xid = topics.with_prefix(prefix, topics.XID)
    t_alerts = topics.with_prefix(prefix, topics.ALERTS)
    args = build_parser().parse_args(
        [
            "alerts",
            "--bootstrap-servers",
            bootstrap,
            "--topic-prefix",
            prefix,
            "--group-id",
            f"{prefix}alerts",
            "--from-beginning",
            "--instance-id",
            "bench",
            "--no-create-topics",
        ]
    )
    app = AlertsService(options_from_args(args))
    stop = threading.Event()
    runner = threading.Thread(target=app.run, args=(stop,), name="alerts", daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while (
        len([tp for tp in app.loop.assigned if tp[0] == t_xid]) < topics.DEFAULT_SPECS[topics.XID].partitions
    ):
        if time.monotonic() > deadline:
            raise SystemExit("alerts service did not get its partitions within 60 s")
        time.sleep(0.05)

    events = storm_events(int(time.time() * 1000))
    enc = AvroCodec().encoder("XidEvent", t_xid).encode
    payloads = [(e["uuid"].encode(), enc(e)) for e in events]
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    per_slice = len(payloads) // SLICES
    began = time.monotonic()
    for s in range(SLICES):
        for key, value in payloads[s * per_slice : (s + 1) * per_slice]:
            producer.produce(t_xid, value, key)
        producer.poll(0)
        pause = began + (s + 1) * BURST_S / SLICES - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    left = producer.flush(30)
    burst_end = time.monotonic()
    if left:
        raise SystemExit(f"{left} storm records not delivered")

    def handled() -> float:
        return app.registry.get_sample_value("gpupipe_consumer_records_total", {"topic": t_xid}) or 0.0

    deadline = time.monotonic() + 120
    while handled() < EVENTS and time.monotonic() < deadline:
        time.sleep(0.005)
    caught_up = time.monotonic()
    n_handled = int(handled())
    stop.set()
    runner.join(60)

    records = read_alerts(bootstrap, t_alerts)
    latest: dict[str, dict] = {}
    for r in records:
        if r["status"] == "action":
            continue
        if r["alert_id"] not in latest or r["sequence"] >= latest[r["alert_id"]]["sequence"]:
            latest[r["alert_id"]] = r
    gpu_alerts = [r for r in latest.values() if r["scope"] == "gpu"]
    node_alerts = [r for r in latest.values() if r["scope"] == "node"]
    per_pair = Counter((r["hostname"], r["pci_bus_id"], r["xid_codes"][0]) for r in gpu_alerts)
    pairs = {(e["hostname"], e["pci_bus_id"], e["xid"]) for e in events}
    allowed = len(pairs) + NODES
    emitted = len(latest)
    occurrences = sum(r["occurrences"] for r in gpu_alerts)

    seconds = max(0.0, caught_up - burst_end)
    ratio_line("alerts_storm_catchup", 5.0 / max(seconds, 0.05), 1.0)
    ratio_line("alerts_storm_dedupe", allowed / max(emitted, 1), 1.0)
    figure("events", EVENTS)
    figure("gpus", NODES * GPUS_PER_NODE)
    figure("nodes", NODES)
    figure("burst_seconds", burst_end - began, "s")
    figure("seconds_to_zero_lag_after_burst", seconds, "s")
    figure("handled", n_handled)
    figure("handle_rate", n_handled / max(caught_up - began, 1e-9), "events/s")
    figure("gpu_xid_pairs", len(pairs))
    figure("alerts_gpu", len(gpu_alerts))
    figure("alerts_node", len(node_alerts))
    figure("alert_records_published", len(records))
    figure("occurrences_sum", occurrences)
    problems = []
    if n_handled < EVENTS:
        problems.append(f"only {n_handled} of {EVENTS} events handled within 120 s")
    if any(n > 1 for n in per_pair.values()):
        problems.append(
            f"{sum(1 for n in per_pair.values() if n > 1)} (GPU, XID) pairs alerted more than once"
        )
    if len(node_alerts) > NODES:
        problems.append(f"{len(node_alerts)} node alerts for {NODES} nodes")
    if occurrences != EVENTS:
        problems.append(f"occurrences add up to {occurrences}, not {EVENTS}")
    for p in problems:
        print(f"  FAILED: {p}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
