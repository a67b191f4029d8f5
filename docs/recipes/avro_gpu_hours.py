"""GPU-hours per namespace and hour from gpu.samples.v1 with a plain Avro library, no gpupipe code.

Reads the raw framing (producers with --framing samples=raw: the value is the Avro body, the
record header gpupipe.schema names the writer schema as <Name>@<fingerprint hex>) with
confluent-kafka and fastavro, and bills each sample by chargeback's rules
(docs/recipes/gpu-hours.md): the time since its key's previous sample, its fraction of a GPU, and
who pays for it (pod_shares in gpu_shares.py beside it, the shared-GPU split).

Usage: python avro_gpu_hours.py BOOTSTRAP GpuSample.avsc [TOPIC] [--window-ms MS]
Reads the topic from the beginning to its end as of the start. Prints one tab-separated line per
(window start in epoch ms, namespace): window_ms, namespace, gpu_hours.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import fastavro
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from gpu_shares import UNALLOCATED, pod_shares, unit

SCHEMA_HEADER = "gpupipe.schema"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
STALE_MS = 4_500_000  # chargeback forgets a key silent this long (window + grace + gap limit)


def epoch_ms(ts: datetime) -> int:
    """fastavro reads a timestamp-millis field as an aware datetime: back to epoch ms, exactly."""
    return (ts - EPOCH) // timedelta(milliseconds=1)


def bill(samples: list[dict[str, Any]], window_ms: int) -> dict[tuple[int, str], float]:
    """(window start ms, namespace) -> GPU-seconds (gpu-hours.md, 1 and 2)."""
    out: dict[tuple[int, str], float] = defaultdict(float)
    last: dict[str, int] = {}
    for s in sorted(samples, key=lambda s: s["timestamp_ms"]):
        mig = s.get("mig")
        key, ts = (mig["mig_uuid"] if mig else s["uuid"]), epoch_ms(s["timestamp_ms"])
        interval = min(s["interval_ms"] if (s.get("interval_ms") or 0) > 0 else 10_000, 600_000)
        cap = min(int(interval * 2.5), 600_000)
        prev = last.get(key)
        if prev is not None and ts == prev:
            continue  # the same sample again
        gap = None if prev is None or ts - prev > STALE_MS else ts - prev
        dt = interval if gap is None else max(interval, cap) if gap > cap else gap
        last[key] = ts
        window = ts - ts % window_ms
        if mig is None and s.get("mig_enabled"):  # a MIG-mode GPU's own record: uncovered capacity
            configured = s.get("mig_configured_fraction")
            free = 0.0 if configured is None else unit(1.0 - configured)
            if free > 0:
                out[(window, UNALLOCATED)] += dt / 1000 * free
            continue
        gpu_s = dt / 1000 * (unit(mig["slice_fraction"]) if mig else 1.0)
        for ns, w in pod_shares(s).items():
            out[(window, ns)] += gpu_s * w
    return out


def read_topic(bootstrap: str, topic: str, avsc: str) -> list[dict[str, Any]]:
    """Every record of ``topic`` up to its end offsets at the start, decoded with ``avsc``."""
    with open(avsc) as f:
        schema = fastavro.parse_schema(json.load(f))
    canonical = fastavro.schema.to_parsing_canonical_form(schema)
    want = f"{schema['name'].rsplit('.', 1)[-1]}@{fastavro.schema.fingerprint(canonical, 'CRC-64-AVRO')}"
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "avro-gpu-hours", "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
        todo = {p for p, end in ends.items() if end > 0}
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in todo])
        out = []
        while todo:
            for m in c.consume(1000, timeout=1.0):
                if m.error() or m.partition() not in todo:
                    continue
                named = dict(m.headers() or ()).get(SCHEMA_HEADER, b"").decode()
                if named != want:
                    where = f"{m.partition()}/{m.offset()}"
                    sys.exit(f"record {where}: header {named!r}, not {want} (produced with the raw framing?)")
                out.append(fastavro.schemaless_reader(io.BytesIO(m.value()), schema))
                if m.offset() + 1 >= ends[m.partition()]:
                    todo.discard(m.partition())
        return out
    finally:
        c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bootstrap")
    p.add_argument("avsc")
    p.add_argument("topic", nargs="?", default="gpu.samples.v1")
    p.add_argument("--window-ms", type=int, default=3_600_000)
    args = p.parse_args()
    billed = bill(read_topic(args.bootstrap, args.topic, args.avsc), args.window_ms)
    for (window, ns), secs in sorted(billed.items()):
        print(f"{window}\t{ns}\t{secs / 3600.0!r}")


if __name__ == "__main__":
    main()
