"""Lake writer throughput: rows/s from decoded GpuSamples to a committed Iceberg append (SQLite
catalog, local warehouse), next to bare fastavro decoding of the same records as the baseline.

Prints ``lake_writer ratio=<writer rows/s / decode rows/s> target=0.5``: the writer's own stage
(buffer, Arrow, Parquet, commit) must keep up with at least half the rate at which the records can
be decoded at all. The service does both, one after the other: its rate is printed too.

    .venv/bin/python bench/bench_lake_writer.py [--ticks 400]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import figure, ratio_line
from prometheus_client import CollectorRegistry
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=400, help="fleet ticks of 128 GPUs each")
    args = ap.parse_args()
    fleet = SimulatedFleet(FleetConfig(nodes=16, gpus_per_node=8))
    t0 = int(time.time() * 1000) - 3_600_000
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    payloads = [enc.encode(s) for i in range(args.ticks) for s in fleet.tick(t0 + i * 1000)[0]]
    began = time.perf_counter()
    decoded = [codec.decode(p).record for p in payloads]
    decode_s = time.perf_counter() - began
    recs = [
        InRecord("gpu.samples.v1", i % 12, i // 12, None, "GpuSample", r, t0) for i, r in enumerate(decoded)
    ]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "wh").mkdir()
        cat = SqlCatalog("bench", uri=f"sqlite:///{d}/c.db", warehouse=(Path(d) / "wh").as_uri())
        spec = BY_NAME["samples"]
        w = LakeWriter(
            {"gpu.samples.v1": (spec, open_table(cat, "gpupipe", spec))},
            CollectorRegistry(),
            flush_rows=50_000,
            flush_interval_s=3600,
        )
        began = time.perf_counter()
        for i in range(0, len(recs), 2000):  # the consume loop's batch size
            w.handle(recs[i : i + 2000])
        w.flush()
        write_s = time.perf_counter() - began
    n = len(recs)
    figure("rows", n)
    figure("commits", w.commits)
    figure("fastavro_decode_rows_per_s", n / decode_s, "rows/s")
    figure("lake_write_rows_per_s", n / write_s, "rows/s (buffer + Arrow + Parquet + commit)")
    figure("decode_then_write_rows_per_s", n / (decode_s + write_s), "rows/s (the service's path)")
    ratio_line("lake_writer", decode_s / write_s, 0.5)


if __name__ == "__main__":
    main()
