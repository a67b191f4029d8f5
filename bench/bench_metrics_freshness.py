"""Benchmark: freshness of `gpupipe metrics`, from a sample's publication to its value on /metrics.

Run: ``.venv/bin/python bench/bench_metrics_freshness.py`` (about a minute; uses the benchmark broker,
GPUPIPE_BENCH_BOOTSTRAP or one started by bench/common.py).

Setup: the real service (``gpupipe metrics`` as a subprocess, default counters: 33 families, so a
scrape of 10k GPUs is about 80 MB) consumes a fresh 12-partition samples topic. This process
publishes 10,000 GPUs' samples per second for ``TICKS`` seconds (a warm-up second, then
``ROUNDS`` rounds of ``ROUND_TICKS``) with the real producer's client settings (idempotent, zstd,
linger 50 ms, murmur2 keyed by GPU), each second's 10k samples spread over the second in slices
of 500 every 50 ms, as a fleet of nodes would. Records are encoded
before the clock starts; a sample's publication time is taken just before its ``produce()``.

Marker: every sample of second ``k`` carries ``power_w = 1000 + k``, so its value on
``DCGM_FI_DEV_POWER_USAGE`` names the sample. A scraper process GETs /metrics back to back (no
gzip) and, per GPU, notes when each marker first appears. Seen time = when the scrape that showed
it was *sent*: the service renders after receiving the request, so the value was there by then
up to the server's accept delay (the scrape's end time, a strictly later bound, is reported too).
A marker a scrape never showed because the next second's sample replaced it first counts as seen
when its successor was seen (an upper bound). Each latency is thus quantised by the scrape period
(printed), which is dominated by rendering and moving 80 MB; a Prometheus scraping every 15 s
would see the same values with far less load on the service. The first second (every GPU new:
label sets rendered) is warm-up and left out.

ratio = 1.0 / the worst round's p99 in seconds (target 1.00: p99 under 1 s in every round).
Producer, broker, service and scraper share the machine's cores, and on a 2-core machine they
compete; the figures say so.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import REPO, bench_kafka, figure, ratio_line
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.publish import producer_config
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

GPUS = 10_000
ROUNDS = 2  # the ratio is the worst round's: a figure that holds in one round only is not held
ROUND_TICKS = 10  # measured seconds per round
TICKS = 1 + ROUNDS * ROUND_TICKS  # tick 0 is warm-up
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


def scrape(url: str, stop: Any, out: Connection) -> None:
    """GET ``url`` back to back (no gzip) until ``stop`` is set, then send back ``(seen, scrapes)``:
    per GPU, per marker tick, ``(sent, done, previous scrape's sent)`` of the scrape that first
    showed it, and ``(sent, done, bytes, time to the response head)`` of every scrape.

    Runs in a process of its own, as Prometheus does: a thread of the publishing process would
    share its GIL with the publisher, every ``recv`` of an 80 MB body giving it up and waiting up to
    a switch interval (5 ms) to take it back, so the scrapes would time the harness's own
    contention along with the service."""
    seen: dict[int, dict[int, tuple[float, float, float]]] = {}
    scrapes: list[tuple[float, float, int, float]] = []
    prev = time.time()
    while not stop.is_set():
        sent = time.time()
        with urllib.request.urlopen(url, timeout=30) as r:
            head = time.time() - sent
            body = r.read()
        done = time.time()
        scrapes.append((sent, done, len(body), head))
        start = body.find(b"# TYPE DCGM_FI_DEV_POWER_USAGE ")
        end = body.find(b"# HELP ", start + 1)
        for m in _LINE.finditer(body, start, end if end > 0 else len(body)):
            gpu, tick = int(m.group(1)), int(m.group(2)) - MARK
            ticks = seen.setdefault(gpu, {})
            if tick not in ticks:
                ticks[tick] = (sent, done, prev)
        if sum(1 for g in seen.values() if TICKS - 1 in g) >= GPUS:
            break  # the last tick is everywhere: nothing more to see
        prev = sent
    out.send((seen, scrapes))
    out.close()


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
    scraper: multiprocessing.process.BaseProcess | None = None
    try:
        t = time.perf_counter()
        payloads = build_payloads()
        figure("encode_setup_s", time.perf_counter() - t, "s (untimed)")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, partitions)
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        results, tx = ctx.Pipe(duplex=False)
        scraper = ctx.Process(target=scrape, args=(url + "/metrics", stop, tx), name="scraper", daemon=True)
        scraper.start()
        tx.close()
        producer = Producer(producer_config(bootstrap))
        published: list[dict[int, float]] = [{} for _ in range(TICKS)]
        per_slice = GPUS // SLICES
        t0 = time.time() + 1.0  # the scraper's interpreter starts meanwhile: tick 0 is warm-up
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
        if not results.poll(10):  # the scraper ends once the last tick is everywhere
            stop.set()
        if not results.poll(60):
            raise SystemExit("the scraper sent nothing back")
        seen, scrapes = results.recv()
        scraper.join(30)
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            own = r.read().decode()
    finally:
        if scraper is not None and scraper.is_alive():  # the publisher failed: end its scraper too
            stop.set()
            scraper.join(5)
            scraper.kill()
        svc.terminate()
        try:
            svc.wait(20)
        except subprocess.TimeoutExpired:
            svc.kill()
        log.close()

    print(
        f"freshness: {GPUS} GPUs, {ROUNDS} rounds of {ROUND_TICKS} s measured, "
        f"{sum(b for _, _, b, _ in scrapes) / max(1, len(scrapes)) / 1e6:.0f} MB per scrape",
        flush=True,
    )
    worst = 0.0
    for r in range(ROUNDS):
        first = 1 + r * ROUND_TICKS
        p99 = report_round(r + 1, range(first, first + ROUND_TICKS), seen, scrapes, published, t0)
        worst = max(worst, p99)
    figure("publisher_behind_schedule_s", behind, "s")
    # The service's own view splits the latency: publication to the store (Kafka and ingest), and
    # the render that a scrape adds (bucket bounds, whole run).
    figure(
        "service_ingest_delay_p99_le_s",
        bucket_quantile(own, "gpupipe_metrics_ingest_delay_seconds_bucket", "", 0.99),
        "s (oldest sample of each consumed batch, publication to store)",
    )
    figure(
        "service_render_p99_le_s",
        bucket_quantile(own, "gpupipe_metrics_render_seconds_bucket", 'stage="render"', 0.99),
        "s",
    )
    ratio_line("metrics_freshness_p99", 1.0 / worst if worst > 0 else 0.0, 1.0)


def bucket_quantile(text: str, name: str, match: str, q: float) -> float:
    """The upper bound of the histogram bucket holding quantile ``q`` (``name`` lines with
    ``match`` in their labels, from an exposition's text)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "{") and match in line:
            le = re.search(r'le="([^"]+)"', line)
            if le:
                buckets.append((float(le.group(1)), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    return next((le for le, n in buckets if n >= q * total), float("inf"))


def report_round(
    n: int,
    ticks: range,
    seen: dict[int, dict[int, tuple[float, float, float]]],
    scrapes: list[tuple[float, float, int, float]],
    published: list[dict[int, float]],
    t0: float,
) -> float:
    """Print one round's figures; returns its p99 (infinite when a marker was never seen)."""
    lat_sent: list[float] = []
    lat_done: list[float] = []
    lat_low: list[float] = []
    missing = 0
    for gpu in range(GPUS):
        got = seen.get(gpu, {})
        later: tuple[float, float, float] | None = None
        for tick in range(TICKS - 1, ticks.start - 1, -1):  # newest first: a successor's sighting
            sighting = got.get(tick, later)
            later = sighting if tick in got else later
            if tick not in ticks:
                continue
            if sighting is None:
                missing += 1
                continue
            lat_sent.append(sighting[0] - published[tick][gpu])
            lat_done.append(sighting[1] - published[tick][gpu])
            lat_low.append(max(0.0, sighting[2] - published[tick][gpu]))
    window = [sc for sc in scrapes if t0 + ticks.start <= sc[0] <= t0 + ticks.stop]
    durations = [d - s for s, d, _, _ in window]
    heads = [h for *_, h in window]
    print(f"round {n}: {len(window)} scrapes, {len(lat_sent)} samples timed", flush=True)
    p99 = pct(lat_sent, 0.99) if lat_sent else float("inf")
    figure(f"round{n}_p50_s", pct(lat_sent, 0.50) if lat_sent else float("inf"), "s")
    figure(f"round{n}_p99_s", p99, "s")
    figure(f"round{n}_max_s", max(lat_sent, default=float("inf")), "s")
    figure(f"round{n}_p99_until_scrape_end_s", pct(lat_done, 0.99) if lat_done else float("inf"), "s")
    figure(
        f"round{n}_p99_lower_bound_s",
        pct(lat_low, 0.99) if lat_low else float("inf"),
        "s (not yet there at the previous scrape)",
    )
    figure(f"round{n}_scrape_period_mean_s", len(ticks) / max(1, len(window)), "s")
    if window:
        figure(f"round{n}_scrape_duration_p50_s", pct(durations, 0.5), "s")
        figure(f"round{n}_scrape_head_p50_s", pct(heads, 0.5), "s (request to response head)")
        figure(f"round{n}_scrape_head_max_s", max(heads), "s")
    figure(f"round{n}_markers_never_seen", missing)
    return float("inf") if missing else p99


if __name__ == "__main__":
    main()
