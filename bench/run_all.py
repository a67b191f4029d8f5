"""`make bench`: run every benchmark, then list all ratio lines with their verdict.

Starts one benchmark broker (scripts/kafka-local on its own port and state dir)
for the benchmarks that need Kafka, and stops it at the end. Exits non-zero if a
ratio is below its target or a benchmark failed, so a regression is visible.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from common import REPO, bench_kafka, stop_bench_kafka

BENCHES = [
    "bench_produce.py",
    "bench_kmsg.py",
    "bench_agent_tick.py",
    "bench_nvml_tick.py",
    "bench_metrics_render.py",
    "bench_metrics_pipeline.py",
    "bench_metrics_freshness.py",
    "bench_metrics_freshness_ha.py",
    "bench_metrics_flood.py",
    "bench_metrics_scale.py",  # 1k/10k/50k GPUs on 1, 2 and 4 replicas (about 2 minutes)
    "bench_chargeback.py",
    "bench_alerts.py",
    "bench_alerts_latency.py",
    "bench_alerts_flood.py",
    "bench_alerts_sample_ingest.py",
    "bench_link_health.py",  # NVLink link health on 7,200 healthy link-days and 300 degradations (minutes)
    "bench_podmeta_load.py",
    "bench_lake_writer.py",
    "bench_lake_query.py",  # a day of 1,000 GPUs: produce, replay and query (a few minutes)
    "bench_life_drill.py",  # 30 days of 240 GPUs through the alerts service (minutes)
    "bench_staging.py",  # own 3 brokers: the deployed system through the fault schedule (~7 minutes)
    "kafka_sizing.py",  # own broker: bytes per record per topic and the sizing table (under a minute)
    "soak_chargeback.py",  # own broker; scale with GPUPIPE_SOAK_GPUS (default 10000)
]
RATIO = re.compile(r"^(\S+) ratio=([0-9.]+) target=([0-9.]+)")


def main() -> int:
    here = Path(__file__).parent
    bootstrap = bench_kafka()
    env = {**os.environ, "GPUPIPE_BENCH_BOOTSTRAP": bootstrap, "PYTHONPATH": str(REPO)}
    results: list[tuple[str, float, float]] = []
    failed: list[str] = []
    try:
        for name in BENCHES:
            path = here / name
            if not path.exists():
                continue
            print(f"== {name}", flush=True)
            proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True)
            sys.stdout.write(proc.stdout)
            if proc.returncode != 0:
                sys.stdout.write(proc.stderr[-3000:])
                failed.append(name)
            for line in proc.stdout.splitlines():
                m = RATIO.match(line)
                if m:
                    results.append((m.group(1), float(m.group(2)), float(m.group(3))))
    finally:
        stop_bench_kafka()
    print("\n== summary (higher is better)")
    below = [r for r in results if r[1] < r[2]]
    for name, ratio, target in results:
        print(
            f"{name:32s} ratio={ratio:<8g} target={target:<6g} {'ok' if ratio >= target else 'BELOW TARGET'}"
        )
    for f in failed:
        print(f"{f}: FAILED")
    return 1 if below or failed else 0


if __name__ == "__main__":
    sys.exit(main())
