"""Bytes per GPU-day of samples: on the wire (Avro body and header) and in the lake (Parquet data
files plus Iceberg metadata), as committed and after `gpupipe lake maintain`'s compaction.

A simulated fleet (16 nodes x 8 GPUs, one sample a second: the producer's default) is written in
commits of --commit-rows rows; the figures are per sample and scaled to a GPU-day (86,400 samples).
The default commit, 30,720 rows, is what a 1,000-GPU fleet fills in 30 s (the writer's default
--flush-interval). Prints figures only (no ratio): docs/lake.md quotes them.

    PYTHONPATH=. .venv/bin/python bench/lake_sizing.py [--seconds 240] [--commit-rows 30720]
"""

from __future__ import annotations

import argparse
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from common import figure
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe_consumers.lake.maintain import Policy, maintain
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

GPU_DAY = 86_400  # samples of one GPU a day at one a second


def folder_bytes(root: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(f"*{suffix}") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=240, help="seconds of fleet time (128 GPUs)")
    ap.add_argument("--commit-rows", type=int, default=30_720)
    args = ap.parse_args()
    fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8))
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    t0 = int(datetime(2026, 11, 1, 6, tzinfo=UTC).timestamp() * 1000)
    payloads = [enc.encode(s) for i in range(args.seconds) for s in fleet.tick(t0 + i * 1000)[0]]
    n = len(payloads)
    wire = sum(len(p) for p in payloads)
    figure("samples", n)
    figure("wire_bytes_per_sample", wire / n, "B (single-object header + Avro body, uncompressed)")
    figure("wire_bytes_per_gpu_day", wire / n * GPU_DAY / 1e6, "MB")
    recs = [
        InRecord("gpu.samples.v1", 0, i, None, "GpuSample", codec.decode(p).record, t0)
        for i, p in enumerate(payloads)
    ]
    with tempfile.TemporaryDirectory(prefix="lake-sizing-") as d:
        wh = Path(d) / "wh"
        wh.mkdir()
        cat = SqlCatalog("gpupipe", uri=f"sqlite:///{d}/c.db", warehouse=wh.as_uri())
        spec = BY_NAME["samples"]
        table = open_table(cat, "gpupipe", spec)
        w = LakeWriter({"gpu.samples.v1": (spec, table)}, CollectorRegistry(), flush_rows=args.commit_rows)
        for i in range(0, n, 2000):
            w.handle(recs[i : i + 2000])
        w.flush()
        data, meta = folder_bytes(wh, ".parquet"), folder_bytes(wh, ".json") + folder_bytes(wh, ".avro")
        files = sum(1 for _ in wh.rglob("*.parquet"))
        figure("commits", w.commits)
        figure("data_files", files)
        figure("lake_bytes_per_sample", data / n, "B (Parquet, zstd)")
        figure("lake_metadata_bytes_per_sample", meta / n, "B (Iceberg metadata and manifests)")
        figure("lake_bytes_per_gpu_day", (data + meta) / n * GPU_DAY / 1e6, "MB as committed")
        now = datetime(2026, 11, 3, tzinfo=UTC)
        r = maintain(cat.load_table(("gpupipe", "samples")), spec, Policy(min_files=2), now)
        live = cat.load_table(("gpupipe", "samples"))
        live_data = sum(t.file.file_size_in_bytes for t in live.scan().plan_files())
        figure("compacted_data_files", r.files_after)
        figure("compacted_lake_bytes_per_sample", live_data / n, "B (live Parquet after compaction)")
        figure("compacted_lake_bytes_per_gpu_day", live_data / n * GPU_DAY / 1e6, "MB")
        figure("wire_to_lake", wire / live_data, "x smaller in the lake")


if __name__ == "__main__":
    main()
