"""Benchmark: the metrics service's whole Python path per sample, against bare fastavro decoding.

Run: ``.venv/bin/python bench/bench_metrics_pipeline.py`` (about a minute; no broker needed).
``GPUPIPE_BENCH_GPUS`` (default 10000) sets the fleet.

What a consumed sample costs the service, measured in one process with the service's own objects:
batches of ``confluent_kafka.Message`` (500 a batch, as ``consume()`` returns them at 10k/s) go
through :meth:`ConsumeLoop.process <gpupipe_consumers.plumbing.consume_loop.ConsumeLoop.process>`
(its decoder is the service's :class:`~gpupipe_consumers.metrics.decode.MetricsDecoder`),
:class:`MetricsHandler` and the store, and the store is scraped (``render_parts``, as two
Prometheus servers 2.5 s apart would: one build per 2.5 s of samples) with the shipped default counters.
Records come from the simulated fleet (pods that come and go, time-shared GPUs with processes,
values that move every second), one sample per GPU per second. Not included: librdkafka's fetch
and decompression, HTTP writes.

Baseline: bare ``fastavro.schemaless_reader`` of the same payloads, nothing else. ratio = baseline
time per sample / the service's time per sample, process CPU time, best of the rounds (target 1.0:
the whole path, scrapes included, costs less than decoding the sample with fastavro alone).
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import figure, ratio_line
from confluent_kafka import Message
from fastavro import schemaless_reader
from prometheus_client import CollectorRegistry

from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.gcpolicy import tune_gc
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.service import MetricsHandler, ServiceMetrics, _TimedStore
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

GPUS = int(os.environ.get("GPUPIPE_BENCH_GPUS", "10000"))
ROUNDS = 3
SECONDS_PER_ROUND = 5  # samples per GPU per round
BATCH = 500
SCRAPE_EVERY_S = 2.5  # an HA pair scraping every 5 s, 2.5 s apart: one build per 2.5 s of samples
TOPIC = "gpu.samples.v1"


class _NoConsumer:
    """The loop's consumer, for a loop fed by hand: only ``store_offsets`` is called."""

    def __init__(self, conf: dict) -> None:
        pass

    def store_offsets(self, offsets: object = None) -> None:
        pass


def fleet_messages(seconds: int) -> list[list[Message]]:
    fleet = SimulatedFleet(FleetConfig(nodes=GPUS // 8, gpus_per_node=8, mig_node_ratio=0.0))
    enc = AvroCodec().encoder("GpuSample").encode
    t0 = int(time.time() * 1000)
    out = []
    for s in range(seconds):
        ts = t0 + s * 1000
        out.append(
            [
                Message(
                    topic=TOPIC,
                    partition=i % 12,
                    offset=s,
                    key=r["uuid"].encode(),
                    value=enc(r),
                    timestamp=(1, ts),
                )
                for i, r in enumerate(fleet.tick(ts)[0])
            ]
        )
    return out


def main() -> None:
    t_start = time.perf_counter()
    rows = fleet_messages(1 + ROUNDS * SECONDS_PER_ROUND)
    reg = CollectorRegistry()
    metrics = ServiceMetrics(reg)
    store = _TimedStore(None, options=RenderOptions(), registry=reg)
    store.metrics = metrics
    handler = MetricsHandler(store, samples_topic=TOPIC, xid_topic="gpu.xid.v1", metrics=metrics)
    loop = ConsumeLoop(
        bootstrap="127.0.0.1:9",  # never contacted: the loop is fed by hand
        group_id="bench",
        topics=[TOPIC],
        handler=handler,
        codec=MetricsDecoder(AvroCodec(), store.renderer),  # type: ignore[arg-type]
        deadletter_topic="gpu.deadletter.v1",
        service="metrics",
        registry=reg,
        extra={"log_level": "0"},
        consumer_factory=_NoConsumer,
    )
    for i in range(0, GPUS, BATCH):  # warm-up: every GPU new (label sets rendered)
        loop.process(rows[0][i : i + BATCH])
    store.render_parts()
    tune_gc()  # as the service: frozen after startup and after each scrape (gcpolicy)
    writer = catalog.current("GpuSample").parsed
    per_scrape = int(GPUS * SCRAPE_EVERY_S)
    ours, base, scrape_cpu, builds = [], [], 0.0, 0
    for r in range(ROUNDS):
        round_rows = rows[1 + r * SECONDS_PER_ROUND : 1 + (r + 1) * SECONDS_PER_ROUND]
        n = sum(len(row) for row in round_rows)
        t = time.process_time()
        for row in round_rows:
            for m in row:
                schemaless_reader(io.BytesIO(m.value()[10:]), writer, None)
        base.append((time.process_time() - t) / n)
        since = 0
        t = time.process_time()
        for row in round_rows:
            for i in range(0, GPUS, BATCH):
                batch = row[i : i + BATCH]
                loop.process(batch)
                since += len(batch)
                if since >= per_scrape:
                    s0 = time.process_time()
                    store.render_parts()
                    scrape_cpu += time.process_time() - s0
                    builds += 1
                    since = 0
        ours.append((time.process_time() - t) / n)
    ours_us, base_us = min(ours) * 1e6, min(base) * 1e6
    samples = ROUNDS * SECONDS_PER_ROUND * GPUS
    print(f"metrics_pipeline: {GPUS} GPUs, {samples} samples, {builds} scrape builds, default counters")
    figure("bare_fastavro_decode_us_per_sample", base_us, "us")
    figure("service_path_us_per_sample", ours_us, "us (consume loop + decode + store + scrapes)")
    figure("of_which_scrape_builds_us_per_sample", scrape_cpu / samples * 1e6, "us (all rounds)")
    figure("scrape_build_ms", scrape_cpu / max(1, builds) * 1e3, f"ms for {GPUS} GPUs")
    figure("total_s", time.perf_counter() - t_start, "s")
    ratio_line("metrics_service_path", base_us / ours_us, 1.0)


if __name__ == "__main__":
    main()
