"""Benchmark: freshness of `gpupipe metrics` under an HA Prometheus pair (two scrapers, 5 s each).

Run: ``.venv/bin/python bench/bench_metrics_freshness_ha.py`` (about a minute; the benchmark broker
as in bench_metrics_freshness.py). ``GPUPIPE_BENCH_GPUS=20000`` checks a larger fleet per instance.

Same service, topic and publication as ``bench_metrics_freshness.py`` (GPUS samples per second, in
20 slices per second, real producer settings), but the load is what production sees: two scrapers
each pulling the full /metrics every 5 s, offset by 2.5 s. Freshness is then not quantised by a
scrape period: the service's own ``gpupipe_metrics_ingest_delay_seconds`` histogram measures, per
consumed batch, the time from the publication of its oldest sample (the Kafka record timestamp the
producer set at ``produce()``) until the sample is in the store, from where any scrape shows it.
The histogram is read before and after the measured seconds (warm-up: the first second, every GPU
new); p50/p99 are bucket upper bounds. ``gpupipe_consumer_lag_records`` at the end says whether the
consumer kept up.

Prints ``metrics_freshness_p99_ha_pair ratio=<1/p99> target=1.00``.

``GPUPIPE_BENCH_CAPACITY=1``: the capacity search instead. Runs at 10k, 12.5k, 15k... GPUs/s until
one does not hold p99 <= 1 s with the consumer caught up at the end, prints each run and
``metrics_capacity_gpus_per_instance ratio=<largest that held / 20000> target=1.00`` (about a
minute a step). One run per rate: on a shared machine, repeat it and report the spread.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_metrics_freshness as base
from common import REPO, bench_kafka, figure, ratio_line
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.publish import producer_config

SCRAPE_INTERVAL_S = 5.0
CAPACITY_TARGET = 20_000  # GPUs per second per instance (this machine)
DELAY = "gpupipe_metrics_ingest_delay_seconds"
_BUCKET = re.compile(rb"^" + DELAY.encode() + rb'_bucket\{le="([^"]+)"\} (\S+)$', re.M)
_CONSUMED = re.compile(rb"^gpupipe_consumer_records_total\{[^}]*\} (\S+)$", re.M)
_LAG = re.compile(rb"^gpupipe_consumer_lag_records\{[^}]*\} (\S+)$", re.M)


class PeriodicScraper(threading.Thread):
    """One Prometheus of the pair: a full GET of /metrics every interval (the whole body read)."""

    def __init__(self, url: str, offset_s: float) -> None:
        super().__init__(name="scraper", daemon=True)
        self.url, self.offset_s = url, offset_s
        self.stop = threading.Event()
        self.scrapes: list[tuple[float, int]] = []  # (duration, bytes)

    def run(self) -> None:
        if self.stop.wait(self.offset_s):
            return
        while not self.stop.is_set():
            t = time.time()
            n = 0
            with urllib.request.urlopen(self.url, timeout=60) as r:
                # read in pieces and drop them: a Prometheus parses on its own machine, not on
                # the 2 cores this service shares with the broker and the publisher
                while chunk := r.read(1 << 20):
                    n += len(chunk)
            self.scrapes.append((time.time() - t, n))
            self.stop.wait(max(0.0, SCRAPE_INTERVAL_S - (time.time() - t)))


def delay_buckets(url: str) -> dict[float, float]:
    return read_state(url)[0]


_TAIL_KEEP = 2 << 20


def scrape_tail(url: str) -> bytes:
    """The last 2 MB of one scrape, read 1 MB at a time: the service's own families come last, and
    the GPU part (160 MB at 20k GPUs) is neither kept nor parsed. Reading and searching the whole
    body took the publishing thread 1-2 s at 20k GPUs: a gap, then a burst of 20-40k samples that
    the service could only drain in most of a second, which was the p99 this bench reported."""
    keep = b""
    with urllib.request.urlopen(url, timeout=60) as r:
        while chunk := r.read(1 << 20):
            keep = (keep + chunk)[-_TAIL_KEEP:]
    return keep


def read_state(url: str) -> tuple[dict[float, float], float]:
    """The ingest-delay histogram and the samples consumed so far, from one scrape."""
    body = scrape_tail(url)
    consumed = sum(float(v) for v in _CONSUMED.findall(body))
    return {float(le): float(v) for le, v in _BUCKET.findall(body)}, consumed


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc): what the service spent, whatever the
    machine's load, so figures from a busy machine stay comparable."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lag_records(url: str) -> float:
    return sum(float(v) for v in _LAG.findall(scrape_tail(url)))


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding quantile q of the observations between two readings."""
    les = sorted(after)
    total = after[les[-1]] - before.get(les[-1], 0.0)
    if total <= 0:
        return float("inf")
    for le in les:
        if after[le] - before.get(le, 0.0) >= q * total:
            return le
    return float("inf")


def measure(gpus: int, bootstrap: str) -> dict[str, float]:
    """One run: a fresh topic and service, ``gpus`` samples a second for ``base.TICKS`` seconds,
    two scrapers every 5 s; the figures printed by :func:`report`."""
    base.GPUS = gpus
    prefix = f"bench-fresh-ha-{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, topics.ALL, prefix=prefix)
    samples_topic = prefix + topics.SAMPLES
    partitions = topics.DEFAULT_SPECS[topics.SAMPLES].partitions
    port = base.free_port()
    (REPO / ".run").mkdir(exist_ok=True)
    log = open(REPO / ".run" / "bench-metrics-freshness-ha.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "gpupipe", "metrics", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--bootstrap-servers", bootstrap, "--topic-prefix", prefix, "--log-level", "warning"]
    svc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    scrapers: list[PeriodicScraper] = []
    try:
        payloads = base.build_payloads()
        url = f"http://127.0.0.1:{port}"
        base.wait_healthy(url, partitions)
        producer = Producer(producer_config(bootstrap))
        per_slice = gpus // base.SLICES
        t0 = time.time() + 0.2
        scrapers = [PeriodicScraper(url + "/metrics", off) for off in (0.0, SCRAPE_INTERVAL_S / 2)]
        for s in scrapers:
            s.start()
        state0: dict[str, Any] = {}

        def read_before() -> None:  # the service's CPU read with the count it goes with
            state0["s"] = read_state(url + "/metrics")
            state0["cpu"], state0["wall"] = cpu_seconds(svc.pid), time.time()

        reader = threading.Thread(target=read_before, daemon=True)
        for tick in range(base.TICKS):
            if tick == 1:  # the reading after the warm-up second, beside the publisher, not in it
                reader.start()
            row = payloads[tick]
            for sl in range(base.SLICES):
                delay = t0 + tick + sl / base.SLICES - time.time()
                if delay > 0:
                    time.sleep(delay)
                for i in range(sl * per_slice, (sl + 1) * per_slice):
                    key, value = row[i]
                    while True:
                        try:
                            producer.produce(samples_topic, value, key)
                            break
                        except BufferError:
                            producer.poll(0.01)
                producer.poll(0)
        behind = time.time() - (t0 + base.TICKS)
        producer.flush(30)
        reader.join(60)
        before, consumed0 = state0["s"]
        cpu0, wall0 = state0["cpu"], state0["wall"]
        time.sleep(1.0)
        lag_end = lag_records(url + "/metrics")
        after, consumed1 = read_state(url + "/metrics")
        cpu1, wall1 = cpu_seconds(svc.pid), time.time()
    finally:
        for s in scrapers:
            s.stop.set()
        svc.terminate()
        try:
            svc.wait(20)
        except subprocess.TimeoutExpired:
            svc.kill()
        log.close()
    durations = sorted(d for s in scrapers for d, _ in s.scrapes)
    sizes = [n for s in scrapers for _, n in s.scrapes]
    consumed = consumed1 - consumed0
    return {
        "gpus": gpus,
        "p50": quantile(before, after, 0.50),
        "p99": quantile(before, after, 0.99),
        "lag_end": lag_end,
        "scrapes": len(durations),
        "scrape_p50_s": durations[len(durations) // 2] if durations else float("nan"),
        "scrape_mb": max(sizes) / 1e6 if sizes else 0.0,
        "behind_s": behind,
        "cpu_us_per_sample": (cpu1 - cpu0) / consumed * 1e6 if consumed > 0 else float("nan"),
        "cores": (cpu1 - cpu0) / (wall1 - wall0),
        "loadavg": float(Path("/proc/loadavg").read_text().split()[0]),
    }


def report(m: dict[str, float]) -> None:
    print(
        f"freshness_ha: {m['gpus']:.0f} GPUs/s x {base.TICKS - 1} s measured, "
        f"2 scrapers every {SCRAPE_INTERVAL_S} s (load average {m['loadavg']:.2f} at the end)"
    )
    figure("ingest_delay_p50_le_s", m["p50"], "s")
    figure("ingest_delay_p99_le_s", m["p99"], "s")
    figure("consumer_lag_records_at_end", m["lag_end"], "records (1 s after the last publication)")
    figure("scrapes", int(m["scrapes"]))
    figure("scrape_duration_p50_s", m["scrape_p50_s"], "s")
    figure("scrape_mb", m["scrape_mb"], "MB")
    figure("publisher_behind_schedule_s", m["behind_s"], "s")
    # the service's whole CPU (consume, decode, apply, render, HTTP) per sample consumed
    figure("service_cpu_us_per_sample", m["cpu_us_per_sample"], "us")
    figure("service_cpu_cores_used", m["cores"], "cores")


def holds(m: dict[str, float]) -> bool:
    """p99 within 1 s (the histogram's bucket bound) and the consumer caught up at the end."""
    return m["p99"] <= 1.0 and m["lag_end"] < m["gpus"]


def main() -> None:
    bootstrap = bench_kafka()
    if os.environ.get("GPUPIPE_BENCH_CAPACITY"):
        # the largest rate per instance that holds p99 <= 1 s, in 2.5k steps from 10k
        best = 0
        for gpus in range(10_000, 40_001, 2_500):
            m = measure(gpus, bootstrap)
            report(m)
            if not holds(m):
                break
            best = gpus
        print(f"  largest_gpus_per_s_with_p99_le_1s={best}")
        ratio_line("metrics_capacity_gpus_per_instance", best / CAPACITY_TARGET, 1.0)
        return
    m = measure(int(os.environ.get("GPUPIPE_BENCH_GPUS", base.GPUS)), bootstrap)
    report(m)
    p99 = m["p99"]
    ratio_line("metrics_freshness_p99_ha_pair", 1.0 / p99 if 0 < p99 < float("inf") else 0.0, 1.0)


if __name__ == "__main__":
    main()
