"""A lake of chargeback samples and windows, and the readers that must agree on it, for the tests
of the shipped Spark recipe over every catalog (SQLite, REST, REST with an S3 warehouse).

No Kafka: the samples go through the real chargeback engine and, with the windows it closes, through
the real lake writer (offsets as a partitioned topic would give them)."""

from __future__ import annotations

import csv
import io
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pyiceberg.catalog import Catalog

from gpupipe.domain.prices import load_price_table
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.lake.tables import BY_NAME
from gpupipe_consumers.lake.writer import LakeWriter, open_table
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import gpupipe
from tests.paths import REPO
from tests.spark_recipe import run_recipe

PRICES = REPO / "deploy" / "prices.example.yaml"
RECIPE = REPO / "docs" / "recipes" / "spark_chargeback.py"
T0 = 1_790_000_000_000 - 1_790_000_000_000 % 3_600_000  # an hour boundary
HOURS = 3
END = T0 + HOURS * 3_600_000
INTERVAL_MS = 10_000
FIELDS = ("gpu_hours", "energy_joules", "cost_allocation", "cost_energy", "cost_total")

#: Per namespace, what chargeback billed: GPU-hours, energy and cost (FIELDS).
Billed = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Written:
    billed: Billed
    rows: dict[str, int]  # rows written per lake table
    windows: list[dict[str, Any]]  # the engine's records


def fleet_samples() -> list[dict[str, Any]]:
    """Three hours of 16 whole GPUs, with what the accounting rules must handle: dropped samples
    (a gap within the cap), a long gap (billed the cap), a repeated sample, a lost GPU, an unknown
    allocation, an energy counter reset and a missing counter."""
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    fleet = SimulatedFleet(
        FleetConfig(nodes=4, gpus_per_node=4, interval_ms=INTERVAL_MS, mig_node_ratio=0, shared_node_ratio=0)
    )
    out: list[dict[str, Any]] = []
    for i in range(HOURS * 3_600_000 // INTERVAL_MS):
        samples, _ = fleet.tick(T0 + i * INTERVAL_MS)
        for g, s in enumerate(samples):
            if g == 1 and i % 7 == 3:  # dropped: a 20 s gap, billed as it is
                continue
            if g == 2 and 100 <= i < 112:  # 130 s silent: billed the cap
                continue
            if g == 3 and i == 200:
                s["gpu_lost"] = True
            if g == 4 and 300 <= i < 310:
                s["allocations_known"] = False
                s["allocations"] = []
            if g == 5 and i >= 400:  # driver reload: the counter starts again
                s["total_energy_mj"] = s["total_energy_mj"] - 10**9 if s["total_energy_mj"] else None
            if g == 6 and i % 50 == 0:
                s["total_energy_mj"] = None
            s = codec.decode(enc.encode(s)).record  # what a consumer of the topic sees
            out.append(s)
            if g == 7 and i == 500:
                out.append(dict(s))  # a repeated sample
    return out


def build_lake(cat: Catalog, samples: list[dict[str, Any]] | None = None) -> Written:
    """Samples (by default :func:`fleet_samples`) and the windows the chargeback engine closes over
    them, written to the lake; what the engine billed per namespace, how many rows each table got
    and the engine's records."""
    samples = fleet_samples() if samples is None else samples
    engine = build_engine(ChargebackSettings(), load_price_table(PRICES), "test")
    recs: list[InRecord] = []
    offsets = [0, 0]
    for s in samples:
        p = zlib.crc32(s["uuid"].encode()) % 2
        engine.add(s, p, offsets[p], s["timestamp_ms"])
        recs.append(InRecord("gpu.samples.v1", p, offsets[p], None, "GpuSample", s, s["timestamp_ms"]))
        offsets[p] += 1
    windows = engine.poll_closed() + engine.flush_all()
    assert len(windows) > 20
    billed: Billed = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    for w in windows:
        b = billed[w["namespace"]]
        b["gpu_hours"] += w["allocated_gpu_seconds"] / 3600.0
        for f in FIELDS[1:]:
            b[f] += w[f]
    recs += [
        InRecord("gpu.chargeback.v1", 0, i, None, "ChargebackWindow", w, w["emitted_at_ms"])
        for i, w in enumerate(windows)
    ]
    tables = {
        BY_NAME[n].topic: (BY_NAME[n], open_table(cat, "gpupipe", BY_NAME[n]))
        for n in ("samples", "chargeback_windows")
    }
    writer = LakeWriter(tables, CollectorRegistry(), flush_rows=20_000)
    writer.handle(recs)
    writer.flush()
    assert writer.rows_written == len(recs)
    return Written(dict(billed), {"samples": len(samples), "chargeback_windows": len(windows)}, windows)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300)


def assert_spark_agrees(
    engine: Billed, flags: list[str], cwd: Path, env: dict[str, str] | None = None
) -> None:
    """The shipped recipe, on the lake ``flags`` name: its recompute from the raw samples and its
    read of the windows table both match what the chargeback engine billed, to 1e-9 relative."""
    spark = run_recipe(
        RECIPE, [*flags, "--prices", str(PRICES), "--start", str(T0), "--end", str(END)], cwd, env
    )
    assert set(spark) == {"recomputed", "billed"}
    assert set(spark["recomputed"]) == set(spark["billed"]) == set(engine)
    for ns, want in engine.items():
        for f in FIELDS:
            assert close(spark["recomputed"][ns][f], want[f]), (ns, f, spark["recomputed"][ns][f], want[f])
            assert close(spark["billed"][ns][f], want[f]), (ns, f, spark["billed"][ns][f], want[f])


def assert_duckdb_agrees(engine: Billed, flags: list[str], env: dict[str, str]) -> None:
    """`gpupipe lake query` (DuckDB) over the windows table: the engine's sums per namespace."""
    sql = (
        "SELECT namespace, SUM(allocated_gpu_seconds) / 3600.0 AS gpu_hours, SUM(energy_joules) AS e, "
        "SUM(cost_total) AS cost FROM chargeback_windows "
        f"WHERE epoch_ms(window_start_ms) >= {T0} AND epoch_ms(window_start_ms) < {END} GROUP BY 1"
    )
    res = gpupipe("lake", "query", sql, *flags, env=env)
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert {r["namespace"] for r in rows} == set(engine)
    for r in rows:
        want = engine[r["namespace"]]
        assert close(float(r["gpu_hours"]), want["gpu_hours"])
        assert close(float(r["e"]), want["energy_joules"])
        assert close(float(r["cost"]), want["cost_total"])
