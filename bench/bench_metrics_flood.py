"""Benchmark: memory of the metrics consumer under a flood of XIDs for made-up GPUs.

Run: ``.venv/bin/python bench/bench_metrics_flood.py`` (about 30 s).

Any GPU node may write an XidEvent for a UUID that does not exist, and each one used to become a
"GPU" of its own, with a label head per family, kept for an hour: 60k distinct UUIDs took a real
consumer from 53 MB to 1.04 GB of RSS with no line in its log. The store now holds at most
``--max-gpus`` keys (default 20000) and drops the rest, counted.

The flood: 60k XidEvents, each for a new UUID on one of 5000 hosts (the adversarial run's shape),
fed to the store the service uses (shipped default counters) in batches of 500 with a scrape every
5000 events, as a Prometheus scraping during the flood would. Each variant runs in a child
process of its own; RSS (``VmRSS``) is read before the flood, after 20k, 40k and 60k events, and
the peak (``VmHWM``) at the end.

* ``metrics_flood_bounded``: the documented bound. Once the cap is full, more events must not
  grow the store: ratio = growth at 20k / growth at 60k (target 0.9: the last 40k events add at
  most ~10 % more, allocator noise).
* ``metrics_flood_vs_unbounded``: the same flood with no cap (``max_gpus`` beyond the flood, the
  old behaviour): ratio = its RSS growth / the capped growth (target 2.0).
* The peak RSS of the capped run must stay under ``PEAK_BOUND_MB`` (documented here: 20k GPUs known
  only from XIDs, each a few KB of label text, plus the interpreter and a scrape's body).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import figure, ratio_line, status_mb

FLOOD = 60_000
HOSTS = 5_000
BATCH = 500
SCRAPE_EVERY = 5_000
CAP = 20_000
PEAK_BOUND_MB = 600.0


def child(max_gpus: int) -> None:
    import logging

    from gpupipe_consumers.metrics.store import SeriesStore

    logging.disable(logging.WARNING)  # one warning a minute: not what is measured
    store = SeriesStore(max_gpus=max_gpus)
    base = status_mb()
    marks: dict[str, float] = {}
    now_s = 1_790_000_000.0
    for start in range(0, FLOOD, BATCH):
        for i in range(start, start + BATCH):
            store.apply_xid(
                {
                    "event_id": f"flood-{i}",
                    "timestamp_ms": int(now_s * 1000),
                    "hostname": f"flood-host-{i % HOSTS:04d}",
                    "kind": "xid",
                    "xid": 13,
                    "pci_bus_id": "0000:3b:00",
                    "gpu_index": i % 8,
                    "uuid": f"GPU-flood-{i:08d}-0000-4000-8000-000000000000",
                    "model_name": "NVIDIA H200",
                    "driver_version": "570.124.06",
                    "allocations": [],
                },
                ("gpu.xid.v1", 0),
                now_s,
            )
        done = start + BATCH
        now_s += BATCH / 4000.0  # about 4k records/s, as the adversarial producer
        if done % SCRAPE_EVERY == 0:
            store.render(now_s)
        if done % 20_000 == 0:
            marks[str(done)] = status_mb() - base
    print(
        json.dumps(
            {
                "base": base,
                "growth": marks,
                "peak": status_mb("VmHWM"),
                "gpus": store.gpu_count(),
                **store.stats(),
            }
        )
    )


def run_child(max_gpus: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(max_gpus)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    capped = run_child(CAP)
    unbounded = run_child(FLOOD * 10)
    g, u = capped["growth"], unbounded["growth"]
    for name, res in (("capped", capped), ("unbounded", unbounded)):
        figure(f"{name}_gpus", res["gpus"])
        for k, v in res["growth"].items():
            figure(f"{name}_rss_growth_at_{k}", v, "MB")
        figure(f"{name}_peak_rss", res["peak"], "MB")
    figure("capped_dropped", sum(capped["dropped"].values()))
    bounded = g["20000"] / max(g["60000"], 1e-9)
    ratio_line("metrics_flood_bounded", bounded, 0.9)
    ratio_line("metrics_flood_vs_unbounded", u["60000"] / max(g["60000"], 1e-9), 2.0)
    ratio_line("metrics_flood_peak_under_bound", PEAK_BOUND_MB / capped["peak"], 1.0)
    ok = capped["gpus"] == CAP and bounded >= 0.9 and capped["peak"] <= PEAK_BOUND_MB
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
