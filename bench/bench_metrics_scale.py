"""Benchmark: the metrics consumer's cost per GPU from 1k to 50k GPUs, on 1, 2 and 4 replicas.

Run: ``.venv/bin/python bench/bench_metrics_scale.py`` (about 1-2 minutes; ``GPUPIPE_SCALE_GPUS``
takes another comma-separated list of fleet sizes).

In process, as each replica would run it: the fleet's samples are split by the partition their key
hashes to (murmur2, 12 partitions of ``gpu.samples.v1``), and each replica's partitions go to its
own ``SeriesStore`` (partitions dealt evenly, as the group's assignor deals them). Per replica and
round, the work is one sample per GPU through the service's decoder and ``apply_samples`` in
batches (ingest), then one scrape (``render_parts`` after every GPU changed, and gzip at the
service's level 1). The store already holds its GPUs (one untimed warm-up round), so it is steady
state, not first sight. The GC policy is the service's (gcpolicy). Each figure is the best of two
rounds, in the thread's CPU time: the machines these run on are shared, and a replica has its own
cores.

* ``metrics_scale_flat``: cost per GPU (ingest + scrape) on one replica at the smallest fleet over
  the largest; target 1/1.5 (cost per GPU flat within 1.5x).
* ``metrics_scale_replicas_N``: at the largest fleet, one replica's time / N over the busiest of
  N replicas' time; target 1/1.3 (the replicas split the work within 1.3x of linear).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics_render import make_record
from common import figure, ratio_line

from gpupipe.kafka import topics
from gpupipe.kafka.partitioner import key_partition
from gpupipe_consumers.metrics.collectors_csv import default_counters
from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.gcpolicy import after_scrape, tune_gc
from gpupipe_consumers.metrics.http import GzipCache
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.meaning import sample_kafka_key

SIZES = tuple(int(n) for n in os.environ.get("GPUPIPE_SCALE_GPUS", "1000,10000,50000").split(","))
REPLICAS = (1, 2, 4)
PARTITIONS = topics.DEFAULT_SPECS[topics.SAMPLES].partitions
BATCH = 500  # records per apply_samples call, about a consumed batch
ROUNDS = 2
T0_MS = 1_764_460_800_000


class Replica:
    """One replica's store, decoder and gzip cache, and its share of the fleet."""

    def __init__(self, codec: AvroCodec, gpus: list[int]) -> None:
        self.store = SeriesStore(default_counters(), max_gpus=max(len(gpus), 1))
        self.decoder = MetricsDecoder(codec, self.store.renderer)
        self.gzip = GzipCache(level=1)
        self.gpus = gpus

    def round(self, payloads: list[bytes], now_s: float) -> tuple[float, float]:
        """(ingest seconds, scrape seconds) for one sample of each of its GPUs."""
        decode, apply = self.decoder.decode, self.store.apply_samples
        t0 = time.thread_time()
        for i in range(0, len(payloads), BATCH):
            apply([(decode(p).record, 0) for p in payloads[i : i + BATCH]], now_s)
        t1 = time.thread_time()
        b"".join(self.gzip.compress(self.store.render_parts(now_s)))
        after_scrape()  # as the service's scrape does
        return t1 - t0, time.thread_time() - t1


def fleet(n: int) -> tuple[list[list[bytes]], list[int]]:
    """Encoded samples of ``n`` GPUs for the warm-up and each round, and each GPU's partition."""
    codec = AvroCodec()
    enc = codec.encoder("GpuSample").encode
    rng = random.Random(23)
    rounds, parts = [], []
    for k in range(ROUNDS + 1):
        recs = [make_record(i, T0_MS + k * 1000, rng) for i in range(n)]
        if k == 0:
            parts = [key_partition(sample_kafka_key(r), PARTITIONS) for r in recs]
        rounds.append([enc(r) for r in recs])
    return rounds, parts


def measure(n: int, replicas: int, rounds: list[list[bytes]], parts: list[int]) -> list[tuple[float, float]]:
    """Per replica: its best (ingest, scrape) seconds over the rounds."""
    codec = AvroCodec()
    held = [[p for p in range(PARTITIONS) if p % replicas == r] for r in range(replicas)]
    reps = [Replica(codec, [i for i in range(n) if parts[i] in h]) for h in map(set, held)]
    out = []
    for rep in reps:
        mine = [[rnd[i] for i in rep.gpus] for rnd in rounds]
        rep.round(mine[0], 1000.0)  # warm-up: the store learns its GPUs
        timings = [rep.round(mine[k], 1000.0 + k) for k in range(1, ROUNDS + 1)]
        out.append((min(t[0] for t in timings), min(t[1] for t in timings)))
        rep.store = None  # type: ignore[assignment]  # free it before the next replica's
    return out


def main() -> None:
    tune_gc()  # the service process's GC policy
    per_gpu_us: dict[int, float] = {}
    busiest: dict[tuple[int, int], float] = {}
    print(f"{'gpus':>7} {'replicas':>8} {'ingest_us/gpu':>14} {'scrape_us/gpu':>14} {'busiest_s':>10}")
    for n in SIZES:
        rounds, parts = fleet(n)
        for r in REPLICAS:
            res = measure(n, r, rounds, parts)
            total = [i + s for i, s in res]
            busiest[(n, r)] = max(total)
            ingest_us = sum(i for i, _ in res) / n * 1e6
            scrape_us = sum(s for _, s in res) / n * 1e6
            if r == 1:
                per_gpu_us[n] = ingest_us + scrape_us
            print(f"{n:>7} {r:>8} {ingest_us:>14.2f} {scrape_us:>14.2f} {busiest[(n, r)]:>10.3f}", flush=True)
        del rounds, parts
        gc.collect()
    small, large = min(SIZES), max(SIZES)
    figure("cost_per_gpu_us_smallest", per_gpu_us[small])
    figure("cost_per_gpu_us_largest", per_gpu_us[large])
    ratio_line("metrics_scale_flat", per_gpu_us[small] / per_gpu_us[large], 1 / 1.5)
    for r in REPLICAS[1:]:
        ratio_line(f"metrics_scale_replicas_{r}", busiest[(large, 1)] / r / busiest[(large, r)], 1 / 1.3)


if __name__ == "__main__":
    main()
