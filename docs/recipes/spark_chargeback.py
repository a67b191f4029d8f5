"""Recompute per-namespace GPU-hours, energy and cost from the raw samples in the lake, with Spark.

A data-platform job that checks the bill: it reads the ``samples`` table (every GpuSample) and
applies chargeback's accounting rules in Spark SQL, then reads the ``chargeback_windows`` table
(what ``gpupipe chargeback`` billed) through the same Iceberg catalog, and prints both, per
namespace, as one JSON document. On the same input the two agree to 1e-9 relative
(``tests/integration/consumers/lake/test_spark.py``).

The rules (docs/chargeback.md has them all), per GPU in time order:

* a sample accounts the time since the GPU's previous sample; the first one its nominal interval
  (``interval_ms``, 10 s when missing, at most 600 s); a gap over ``cap = min(2.5 x interval,
  600 s)`` bills ``cap``; a GPU silent for longer than chargeback keeps its state (one window,
  its grace and 600 s) starts anew; a repeated sample (same GPU, same timestamp) counts once;
* energy is the ``total_energy_mj`` delta over the gap when the counter went up by no more than
  3 kW x the gap, else ``power_w x`` the accounted time;
* the time and energy go to the one pod holding the GPU, ``__unallocated__`` when none holds it
  (or NVML lost it), ``__unattributed__`` when the kubelet could not say;
* cost is GPU-hours x the model's price per GPU-hour plus kWh x the price per kWh, from the same
  price table file chargeback reads (``--prices``).

Shared GPUs (time-slicing, MPS) and MIG slices follow per-process and per-slice rules this recipe
does not repeat: their samples are counted in ``unsupported_samples`` and left out of
``recomputed``, so a fleet with them shows the difference instead of hiding it.

Run it where pyspark and the jars are (``pip install 'gpupipe[lake-spark]'``,
``scripts/spark-jars``)::

    python docs/recipes/spark_chargeback.py --catalog-uri sqlite:///lake/catalog.db \\
        --warehouse lake/warehouse --prices prices.yaml --jars "$(scripts/spark-jars | tail -1)" \\
        --start 2026-10-01T00:00:00Z --end 2027-01-01T00:00:00Z
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from gpupipe.prices import load_price_table

DEFAULT_INTERVAL_MS = 10_000
MAX_GAP_FACTOR = 2.5
MAX_GAP_LIMIT_MS = 600_000
MAX_PLAUSIBLE_POWER_W = 3_000.0
#: How long chargeback keeps a silent GPU's last sample (window + grace + the gap limit, its
#: defaults): a GPU silent for longer starts anew, as its first sample.
STALE_MS = 3_600_000 + 300_000 + MAX_GAP_LIMIT_MS
UNALLOCATED = "__unallocated__"
UNATTRIBUTED = "__unattributed__"


def spark_session(args: argparse.Namespace) -> SparkSession:
    """A local Spark with the lake's catalog as ``args.catalog_name``: Iceberg's JdbcCatalog on the
    same SQLite file pyiceberg writes (the two share the table layout), or a REST catalog."""
    cat = f"spark.sql.catalog.{args.catalog_name}"
    b = (
        SparkSession.builder.master(args.master)
        .appName("gpupipe-chargeback-recompute")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.extensions", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
        .config(cat, "org.apache.iceberg.spark.SparkCatalog")
    )
    if args.jars:
        b = b.config("spark.jars", args.jars)
    uri = args.catalog_uri
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///") :]).resolve()
        b = b.config(f"{cat}.catalog-impl", "org.apache.iceberg.jdbc.JdbcCatalog")
        b = b.config(f"{cat}.uri", f"jdbc:sqlite:{path}")
    else:
        b = b.config(f"{cat}.type", "rest").config(f"{cat}.uri", uri)
    warehouse = args.warehouse or ("lake/warehouse" if uri.startswith("sqlite:///") else None)
    if warehouse:
        wh = warehouse if "://" in warehouse else Path(warehouse).resolve().as_uri()
        b = b.config(f"{cat}.warehouse", wh)
    for item in args.catalog_property:
        key, _, value = item.partition("=")
        b = b.config(f"{cat}.{key}", value)
    return b.getOrCreate()


def recompute(samples: DataFrame, start_ms: int, end_ms: int) -> tuple[DataFrame, DataFrame]:
    """(per (namespace, gpu_model): gpu_seconds, energy_joules, samples; the unsupported samples).

    ``samples`` must reach back far enough before ``start_ms`` for each GPU's previous sample
    (the caller reads STALE_MS more)."""
    s = samples.select(
        "uuid",
        "hostname",
        "model_name",
        "interval_ms",
        "gpu_lost",
        "allocations_known",
        "allocations",
        "shared_replicas",
        "mig",
        "mig_enabled",
        "power_w",
        "total_energy_mj",
        "_kafka_partition",
        "_kafka_offset",
        F.unix_millis("timestamp_ms").alias("ts"),
    )
    # A repeated sample (same GPU, same timestamp) counts once: the first on the topic.
    first = Window.partitionBy("uuid", "ts").orderBy("_kafka_partition", "_kafka_offset")
    s = s.withColumn("_n", F.row_number().over(first)).where("_n = 1").drop("_n")
    by_gpu = Window.partitionBy("uuid").orderBy("ts")
    s = s.withColumn("prev_ts", F.lag("ts").over(by_gpu)).withColumn(
        "prev_mj", F.lag("total_energy_mj").over(by_gpu)
    )
    interval = F.least(
        F.when(F.col("interval_ms") > 0, F.col("interval_ms").cast("long")).otherwise(DEFAULT_INTERVAL_MS),
        F.lit(MAX_GAP_LIMIT_MS),
    )
    s = s.withColumn("interval", interval).withColumn(
        "cap", F.least(F.floor(F.col("interval") * MAX_GAP_FACTOR).cast("long"), F.lit(MAX_GAP_LIMIT_MS))
    )
    gap = F.col("ts") - F.col("prev_ts")
    has_ref = F.col("prev_ts").isNotNull() & (gap <= STALE_MS)
    s = s.withColumn("has_ref", has_ref).withColumn(
        "dt_ms",
        F.when(~F.col("has_ref"), F.col("interval"))
        .when(gap > F.col("cap"), F.greatest(F.col("interval"), F.col("cap")))
        .otherwise(gap),
    )
    delta = (F.col("total_energy_mj") - F.col("prev_mj")).cast("double")
    measured = (
        F.col("has_ref")
        & F.col("prev_mj").isNotNull()
        & F.col("total_energy_mj").isNotNull()
        & (delta >= 0)
        & (delta <= MAX_PLAUSIBLE_POWER_W * gap)
    )
    estimated = F.when(F.col("power_w") >= 0, F.col("power_w").cast("double") * F.col("dt_ms") / 1000.0)
    s = s.withColumn(
        "energy_j", F.when(measured, delta / 1000.0).otherwise(F.coalesce(estimated, F.lit(0.0)))
    )
    s = s.where((F.col("ts") >= start_ms) & (F.col("ts") < end_ms))

    pods = F.array_distinct(
        F.transform(F.coalesce("allocations", F.array()), lambda a: F.struct(a["namespace"], a["pod"]))
    )
    s = s.withColumn("pods", pods).withColumn("held", F.size("pods"))
    unsupported = F.col("mig").isNotNull() | F.coalesce(F.col("mig_enabled"), F.lit(False))
    # One pod holding fewer replicas than the GPU has shares it with capacity no one holds.
    replicas = F.filter(F.transform("allocations", lambda a: a["replica"]), lambda r: r.isNotNull())
    units = F.greatest(F.size(F.array_distinct(replicas)), F.lit(1))
    shared = (F.col("held") > 1) | (
        (F.col("held") == 1) & (F.coalesce(F.col("shared_replicas"), F.lit(0)) > units)
    )
    lost = F.coalesce(F.col("gpu_lost"), F.lit(False))
    unknown = F.col("allocations_known") == F.lit(False)
    s = s.withColumn("unsupported", (~lost & ~F.coalesce(unknown, F.lit(False)) & shared) | unsupported)
    namespace = (
        F.when(lost, F.lit(UNALLOCATED))
        .when(F.coalesce(unknown, F.lit(False)), F.lit(UNATTRIBUTED))
        .when(F.col("held") == 0, F.lit(UNALLOCATED))
        .otherwise(F.col("pods")[0]["namespace"])
    )
    ok = s.where(~F.col("unsupported")).withColumn("namespace", namespace)
    rows = ok.groupBy("namespace", "model_name").agg(
        F.sum(F.col("dt_ms") / 1000.0).alias("gpu_seconds"),
        F.sum("energy_j").alias("energy_joules"),
        F.count(F.lit(1)).alias("samples"),
    )
    return rows, s.where("unsupported")


def billed(windows: DataFrame, start_ms: int, end_ms: int) -> DataFrame:
    """What chargeback billed per namespace: windows and corrections added up, each record once."""
    w = windows.withColumn("start", F.unix_millis("window_start_ms")).where(
        (F.col("start") >= start_ms) & (F.col("start") < end_ms)
    )
    key = F.coalesce(
        "record_id", F.concat_ws(":", F.lit("@"), F.col("_kafka_partition"), F.col("_kafka_offset"))
    )
    once = Window.partitionBy("_key").orderBy("_kafka_partition", "_kafka_offset")
    w = w.withColumn("_key", key).withColumn("_n", F.row_number().over(once)).where("_n = 1")
    return w.groupBy("namespace").agg(
        (F.sum("allocated_gpu_seconds") / 3600.0).alias("gpu_hours"),
        F.sum("energy_joules").alias("energy_joules"),
        F.sum("cost_allocation").alias("cost_allocation"),
        F.sum("cost_energy").alias("cost_energy"),
        F.sum("cost_total").alias("cost_total"),
    )


def priced(rows: list[dict[str, Any]], prices_file: str | None) -> dict[str, dict[str, float]]:
    """Per namespace: GPU-hours, energy and cost, priced by model as chargeback prices a row."""
    table = load_price_table(prices_file) if prices_file else None
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        per_hour = table.gpu_price(r["model_name"]).per_gpu_hour if table else 0.0
        per_kwh = table.energy_per_kwh if table else 0.0
        alloc = r["gpu_seconds"] / 3600.0 * per_hour
        energy = r["energy_joules"] / 3_600_000.0 * per_kwh
        ns = out.setdefault(
            r["namespace"],
            dict.fromkeys(
                ("gpu_hours", "energy_joules", "cost_allocation", "cost_energy", "cost_total"), 0.0
            ),
        )
        ns["gpu_hours"] += r["gpu_seconds"] / 3600.0
        ns["energy_joules"] += r["energy_joules"]
        ns["cost_allocation"] += alloc
        ns["cost_energy"] += energy
        ns["cost_total"] += alloc + energy
    return out


def _ms(value: str) -> int:
    if value.isdigit():
        return int(value)
    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC).timestamp() * 1000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--catalog-uri", default="sqlite:///lake/catalog.db", help="sqlite:///FILE or a REST URI")
    p.add_argument("--warehouse", default=None, help="the SQL catalog's (default lake/warehouse)")
    p.add_argument("--catalog-name", default="gpupipe", help="as gpupipe lake write's --catalog-name")
    p.add_argument("--catalog-property", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--namespace", default="gpupipe")
    p.add_argument("--prices", default=None, help="chargeback's price table file (YAML)")
    p.add_argument("--start", required=True, help="ISO 8601 or epoch ms, inclusive")
    p.add_argument("--end", required=True, help="ISO 8601 or epoch ms, exclusive")
    p.add_argument("--jars", default=None, help="comma-separated jars (scripts/spark-jars)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--driver-memory", default="1g")
    args = p.parse_args(argv)
    start_ms, end_ms = _ms(args.start), _ms(args.end)

    spark = spark_session(args)
    try:
        name = f"{args.catalog_name}.{args.namespace}"
        samples = spark.table(f"{name}.samples").where(
            (F.unix_millis("timestamp_ms") >= start_ms - STALE_MS) & (F.unix_millis("timestamp_ms") < end_ms)
        )
        rows, unsupported = recompute(samples, start_ms, end_ms)
        result = {
            "recomputed": priced([r.asDict() for r in rows.collect()], args.prices),
            "unsupported_samples": unsupported.count(),
            "billed": {
                r["namespace"]: {k: v for k, v in r.asDict().items() if k != "namespace"}
                for r in billed(spark.table(f"{name}.chargeback_windows"), start_ms, end_ms).collect()
            },
        }
    finally:
        spark.stop()
    json.dump(result, sys.stdout, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
