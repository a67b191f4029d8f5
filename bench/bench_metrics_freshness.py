"""Benchmark: freshness of `gpupipe metrics`, from a sample's publication to its value on /metrics.

Run: ``.venv/bin/python bench/bench_metrics_freshness.py`` (about 40 s; uses the benchmark broker,
GPUPIPE_BENCH_BOOTSTRAP or one started by bench/common.py).

Setup: the real service (``gpupipe metrics`` as a subprocess, default counters: 33 families, so a
scrape of 10k GPUs is about 80 MB) consumes a fresh 12-partition samples topic. This process
publishes 10,000 GPUs' samples per second for ``TICKS`` seconds with the real producer's client
settings (idempotent, zstd, linger 50 ms, murmur2 keyed by GPU), each second's 10k samples spread
over the second in slices of 500 every 50 ms, as a fleet of nodes would. Records are encoded
before the clock starts; a sample's publication time is taken just before its ``produce()``.

Marker: every sample of second ``k`` carries ``power_w = 1000 + k``, so its value on
``DCGM_FI_DEV_POWER_USAGE`` names the sample. A scraper thread GETs /metrics back to back (no
gzip) and, per GPU, notes when each marker first appears. Seen time = when the scrape that showed
it was *sent*: the service renders after receiving the request, so the value was there by then
up to the server's accept delay (the scrape's end time, a strictly later bound, is reported too).
A marker a scrape never showed because the next second's sample replaced it first counts as seen
when its successor was seen (an upper bound). Each latency is thus quantised by the scrape period
(printed), which is dominated by rendering and moving 80 MB; a Prometheus scraping every 15 s
would see the same values with far less load on the service. The first second (every GPU new:
label sets rendered) is warm-up and left out.

ratio = 1.0 / p99 in seconds (target 1.00: p99 under 1 s). Producer, broker, service and scraper
share the machine's cores, and on a 2-core machine they compete; the figures say so.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import REPO, bench_kafka, figure, ratio_line
from confluent_kafka import Producer

from gpupipe import topics
from gpupipe.kafka_admin import ensure_topics
from gpupipe_producer.publish import producer_config
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

GPUS = 10_000
TICKS = 11  # tick 0 is warm-up; 10 measured seconds
SLICES = 20  # publication slices per second (500 samples every 50 ms)
MARK = 1000
_LINE = re.compile(rb'UUID="GPU-bench-(\d{5})"[^}]*\} (\d+)\.')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_payloads() -> list[list[tuple[bytes, bytes]]]:
    """Per tick, the (key, value) of every GPU's sample; power_w = MARK + tick."""
    templates = SimulatedFleet(FleetConfig(nodes=4, gpus_per_node=8, mig_node_ratio=0.0)).tick(
        int(time.time() * 1000)
    )[0]
    enc = AvroCodec().encoder("GpuSample").encode
    out: list[list[tuple[bytes, bytes]]] = []
    for tick in range(TICKS):
        row = []
        for i in range(GPUS):
            uid = f"GPU-bench-{i:05d}"
            rec = {
                **templates[i % len(templates)],
                "uuid": uid,
                "hostname": f"bench-node-{i // 8:04d}",
                "gpu_index": i % 8,
                "mig": None,
                "processes": [],
                "power_w": float(MARK + tick),
                "interval_ms": 1000,
            }
            row.append((uid.encode(), rec))
        out.append(row)
    # timestamps are set at publication; encode with a placeholder now, patch nothing later:
    # the service only checks that a sample is not older than --max-sample-age (5 min).
    now_ms = int(time.time() * 1000)
    return [[(k, enc({**r, "timestamp_ms": now_ms + t * 1000})) for k, r in row] for t, row in enumerate(out)]


class Scraper(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(name="scraper", daemon=True)
        self.url = url
        self.stop = threading.Event()
        # gpu -> tick -> (sent, done, previous scrape's sent): first seen between prev and sent
        self.seen: dict[int, dict[int, tuple[float, float, float]]] = {}
        self.scrapes: list[tuple[float, float, int]] = []  # (sent, done, bytes)

    def run(self) -> None:
        prev = time.time()
        while not self.stop.is_set():
            sent = time.time()
            with urllib.request.urlopen(self.url, timeout=30) as r:
                body = r.read()
            done = time.time()
            self.scrapes.append((sent, done, len(body)))
            start = body.find(b"# TYPE DCGM_FI_DEV_POWER_USAGE ")
            end = body.find(b"# HELP ", start + 1)
            for m in _LINE.finditer(body, start, end if end > 0 else len(body)):
                gpu, tick = int(m.group(1)), int(m.group(2)) - MARK
                ticks = self.seen.setdefault(gpu, {})
                if tick not in ticks:
                    ticks[tick] = (sent, done, prev)
            prev = sent


def wait_healthy(url: str, partitions: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
                doc = json.loads(r.read())
            if doc.get("status") == "ok" and len(doc.get("partitions", [])) == partitions:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("metrics service did not become healthy")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    bootstrap = bench_kafka()
    prefix = f"bench-fresh-{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, topics.ALL, prefix=prefix)
    samples_topic = prefix + topics.SAMPLES
    partitions = topics.DEFAULT_SPECS[topics.SAMPLES].partitions
    port = free_port()
    (REPO / ".run").mkdir(exist_ok=True)
    log = open(REPO / ".run" / "bench-metrics-freshness.log", "wb")  # noqa: SIM115
    svc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpupipe",
            "metrics",
            "--listen",
            f"127.0.0.1:{port}",
            "--bootstrap-servers",
            bootstrap,
            "--topic-prefix",
            prefix,
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        t = time.perf_counter()
        payloads = build_payloads()
        figure("encode_setup_s", time.perf_counter() - t, "s (untimed)")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, partitions)
        producer = Producer(producer_config(bootstrap))
        scraper = Scraper(url + "/metrics")
        published: list[dict[int, float]] = [{} for _ in range(TICKS)]
        per_slice = GPUS // SLICES
        t0 = time.time() + 0.2
        scraper.start()
        for tick in range(TICKS):
            row = payloads[tick]
            for s in range(SLICES):
                due = t0 + tick + s / SLICES
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                pub = published[tick]
                for i in range(s * per_slice, (s + 1) * per_slice):
                    key, value = row[i]
                    pub[i] = time.time()
                    while True:
                        try:
                            producer.produce(samples_topic, value, key)
                            break
                        except BufferError:
                            producer.poll(0.01)
                producer.poll(0)
        behind = time.time() - (t0 + TICKS)
        producer.flush(30)
        last = TICKS - 1
        deadline = time.time() + 10
        while time.time() < deadline and sum(1 for g in scraper.seen.values() if last in g) < GPUS:
            time.sleep(0.1)
        scraper.stop.set()
        scraper.join(30)
    finally:
        svc.terminate()
        try:
            svc.wait(20)
        except subprocess.TimeoutExpired:
            svc.kill()
        log.close()

    lat_sent: list[float] = []
    lat_done: list[float] = []
    lat_low: list[float] = []
    missing = 0
    for gpu in range(GPUS):
        ticks = scraper.seen.get(gpu, {})
        later: tuple[float, float, float] | None = None
        for tick in range(TICKS - 1, 0, -1):  # measured ticks, newest first
            seen = ticks.get(tick, later)
            if seen is None:
                missing += 1
                continue
            later = seen if tick in ticks else later
            lat_sent.append(seen[0] - published[tick][gpu])
            lat_done.append(seen[1] - published[tick][gpu])
            lat_low.append(max(0.0, seen[2] - published[tick][gpu]))
    window = [sc for sc in scraper.scrapes if t0 + 1 <= sc[0] <= t0 + TICKS]  # the measured seconds
    scrape_s = [d - s for s, d, _ in window]
    print(
        f"freshness: {GPUS} GPUs x {TICKS - 1} s measured, {len(window)} scrapes in that time "
        f"({sum(b for *_, b in window) / max(1, len(window)) / 1e6:.0f} MB each), "
        f"{len(lat_sent)} samples timed",
        flush=True,
    )
    figure("p50_s", pct(lat_sent, 0.50), "s")
    figure("p99_s", pct(lat_sent, 0.99), "s")
    figure("max_s", max(lat_sent), "s")
    figure("p99_until_scrape_end_s", pct(lat_done, 0.99), "s")
    figure("p99_lower_bound_s", pct(lat_low, 0.99), "s (not yet there at the previous scrape)")
    figure(
        "scrape_period_mean_s",
        (TICKS - 1) / max(1, len(window)),
        "s",
    )
    figure("scrape_duration_p50_s", pct(scrape_s, 0.5), "s")
    figure("publisher_behind_schedule_s", behind, "s")
    figure("markers_never_seen", missing)
    p99 = pct(lat_sent, 0.99)
    if missing:
        p99 = float("inf")
    ratio_line("metrics_freshness_p99", 1.0 / p99 if p99 > 0 else 0.0, 1.0)


if __name__ == "__main__":
    main()
