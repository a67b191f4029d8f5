"""Recompute per-namespace GPU-hours, energy and cost from the raw samples in the lake, with Spark.

A data-platform job that checks the bill: it reads the ``samples`` table (every GpuSample) and
applies chargeback's accounting rules in Spark SQL, then reads the ``chargeback_windows`` table
(what ``gpupipe chargeback`` billed) through the same Iceberg catalog, and prints both, per
namespace, as one JSON document. On the same input the two agree to 1e-9 relative
(``tests/integration/consumers/lake/test_spark.py``).

The rules (docs/chargeback.md has them all), per GPU key (a MIG slice's UUID, else the GPU's) in
time order:

* a sample accounts the time since the key's previous sample; the first one its nominal interval
  (``interval_ms``, 10 s when missing, at most 600 s); a gap over ``cap = min(2.5 x interval,
  600 s)`` bills ``cap``; a GPU silent for longer than chargeback keeps its state (one window,
  its grace and 600 s) starts anew; a repeated sample (same key, same timestamp) counts once;
* energy is the energy counter's delta over the gap when the counter went up by no more than
  3 kW x the gap, else ``power_w x`` the accounted time. The counter is the sample's own
  ``total_energy_mj``; a MIG slice without one bills its ``slice_fraction`` of the parent GPU's
  (``mig_parent_energy_mj``);
* a whole GPU's time counts 1, a MIG slice's its ``slice_fraction``. The time and energy go to
  ``__unallocated__`` when NVML lost the GPU or no pod holds it, to ``__unattributed__`` when the
  kubelet could not say, to the one pod holding all of it, and on a shared GPU (time-sliced or
  DRA-shared: several pods, or one holding fewer replicas than ``shared_replicas``) by measured
  use and replicas held (:func:`with_pod_shares`);
* the whole-GPU record of a GPU in MIG mode bills no time: the capacity no slice covers
  (``1 - mig_configured_fraction``) goes to ``__unallocated__``, with that share of the GPU's
  energy when the slices bill theirs (``mig_energy_by_slice``); otherwise the GPU's energy goes
  whole to ``__mig_shared__``;
* cost is GPU-hours x the model's price per GPU-hour plus kWh x the price per kWh, from the same
  price table file chargeback reads (``--prices``).

Per-sample arithmetic over a sample's allocations and processes is Spark's higher-order functions
(``transform``, ``filter``, ``aggregate``, ``exists``), no Python UDF: the job stays in the JVM and
each rule reads as one expression. Not repeated: a node clock that stepped back (chargeback's
running maximum per GPU) and samples stamped over a minute ahead of their Kafka record (billed at
broker time); the recipe takes each GPU's samples in timestamp order.

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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from gpupipe.domain.prices import load_price_table

DEFAULT_INTERVAL_MS = 10_000
MAX_GAP_FACTOR = 2.5
MAX_GAP_LIMIT_MS = 600_000
MAX_PLAUSIBLE_POWER_W = 3_000.0
#: How long chargeback keeps a silent GPU's last sample (window + grace + the gap limit, its
#: defaults): a GPU silent for longer starts anew, as its first sample.
STALE_MS = 3_600_000 + 300_000 + MAX_GAP_LIMIT_MS
UNALLOCATED = "__unallocated__"
UNATTRIBUTED = "__unattributed__"
MIG_SHARED = "__mig_shared__"


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


def _unit(x: Column) -> Column:
    """``x`` clamped to [0, 1], null and NaN to 0, as chargeback clamps a ratio (Spark orders NaN
    above every number, so least/greatest alone would let it through as 1)."""
    return F.when((x >= 0) & ~F.isnan(x), F.least(x, F.lit(1.0))).otherwise(F.lit(0.0))


def _share(namespace: Column | str, weight: Column | float) -> Column:
    """One party's part of a sample's GPU time (and energy) as a fraction of it."""
    ns = F.lit(namespace) if isinstance(namespace, str) else namespace
    w = F.lit(weight) if isinstance(weight, float) else weight
    return F.struct(ns.alias("namespace"), w.cast("double").alias("weight"))


def _sum_v(procs: Column) -> Column:
    return F.aggregate(procs, F.lit(0.0), lambda acc, p: acc + p["v"])


def with_pod_shares(s: DataFrame) -> DataFrame:
    """``s`` with ``shares``: who pays for each sample's GPU time, as (namespace, weight) pairs
    whose weights add up to 1.

    * lost: ``__unallocated__``; the kubelet could not say: ``__unattributed__``; no pod holds
      it: ``__unallocated__``;
    * each pod's allocation units are its distinct replicas (1 for a device without replica ids,
      as with DRA); the GPU's capacity is ``shared_replicas`` (at least the units held);
    * one pod holding the whole capacity: that pod, whatever runs on it;
    * shared otherwise, with a measured use: the processes' summed ``sm_util_ratio`` (each clamped
      to 1, the sum scaled down to 1), or where no process reports SM, the GPU's activity split by
      ``used_memory_bytes``. Each holder pays its processes' part of that use, its units' part of
      the use of processes no pod owns, and its units' part of the idle rest over the capacity; a
      pod using a GPU it does not hold pays its own use; the idle part of replicas no one holds is
      ``__unallocated__``;
    * shared with nothing measured: units over capacity each, the rest ``__unallocated__``.

    The arrays the rule reads more than once are columns of their own (dropped at the end), so
    Spark computes each once per sample rather than inlining it into every use.
    """
    allocs = F.coalesce(F.col("allocations"), F.array())
    pods = F.array_distinct(
        F.transform(allocs, lambda a: F.struct(a["namespace"].alias("ns"), a["pod"].alias("pod")))
    )
    units = F.transform(
        pods,
        lambda p: F.struct(
            p["ns"].alias("ns"),
            p["pod"].alias("pod"),
            F.greatest(
                F.size(
                    F.array_distinct(
                        F.transform(
                            F.filter(
                                allocs,
                                lambda a: (
                                    (a["namespace"] == p["ns"])
                                    & (a["pod"] == p["pod"])
                                    & a["replica"].isNotNull()
                                ),
                            ),
                            lambda a: a["replica"],
                        )
                    )
                ),
                F.lit(1),
            ).alias("n"),
        ),
    )
    s = s.withColumn("_units", units)
    units = F.col("_units")
    held = F.aggregate(units, F.lit(0), lambda acc, u: acc + u["n"])
    replicas = F.col("shared_replicas")
    s = s.withColumn("_held", held)
    held = F.col("_held")
    s = s.withColumn("_capacity", F.when(replicas > 0, F.greatest(replicas, held)).otherwise(held))
    capacity = F.col("_capacity")

    # The processes with a measure, each with its owner: its (namespace, pod), or nulls where the
    # node could not place it (either missing or empty).
    procs = F.coalesce(F.col("processes"), F.array())

    def measured(keep: Callable[[Column], Column], value: Callable[[Column], Column]) -> Column:
        def owned(p: Column) -> Column:
            placed = (F.length(p["namespace"]) > 0) & (F.length(p["pod"]) > 0)
            return F.struct(
                F.when(placed, p["namespace"]).alias("ns"),
                F.when(placed, p["pod"]).alias("pod"),
                value(p).alias("v"),
            )

        return F.transform(F.filter(procs, keep), owned)

    by_sm = measured(
        lambda p: (p["sm_util_ratio"] > 0) & ~F.isnan(p["sm_util_ratio"]),
        lambda p: F.least(p["sm_util_ratio"], F.lit(1.0)),
    )
    by_memory = measured(
        lambda p: p["used_memory_bytes"] > 0, lambda p: p["used_memory_bytes"].cast("double")
    )
    s = s.withColumn("_by_sm", by_sm).withColumn("_by_memory", by_memory)
    by_sm, by_memory = F.col("_by_sm"), F.col("_by_memory")
    sm_ok = F.size(by_sm) > 0
    memory_ok = ~sm_ok & (F.size(by_memory) > 0) & F.coalesce(F.col("activity") > 0, F.lit(False))
    s = s.withColumn("_m", F.when(sm_ok, by_sm).when(memory_ok, by_memory))  # null: nothing measures use
    m = F.col("_m")
    total = _sum_v(m)
    s = s.withColumn("_total", total)
    total = F.col("_total")
    s = s.withColumn("_used", F.when(sm_ok, F.least(total, F.lit(1.0))).when(memory_ok, F.col("activity")))
    used = F.col("_used")
    idle = F.lit(1.0) - used
    unplaced = used * (_sum_v(F.filter(m, lambda p: p["ns"].isNull())) / total)

    def own(ns: Column, pod: Column) -> Column:
        """The pod's weight in the measured use."""
        return _sum_v(F.filter(m, lambda p: (p["ns"] == ns) & (p["pod"] == pod))) / total

    holders = F.transform(
        units,
        lambda u: _share(
            u["ns"], used * own(u["ns"], u["pod"]) + unplaced * u["n"] / held + idle * u["n"] / capacity
        ),
    )
    guests = F.transform(
        F.array_distinct(
            F.transform(
                F.filter(
                    m,
                    lambda p: (
                        p["ns"].isNotNull()
                        & ~F.exists(units, lambda u: (u["ns"] == p["ns"]) & (u["pod"] == p["pod"]))
                    ),
                ),
                lambda p: F.struct(p["ns"].alias("ns"), p["pod"].alias("pod")),
            )
        ),
        lambda g: _share(g["ns"], used * own(g["ns"], g["pod"])),
    )
    # Replicas no one holds: their part of the idle time (of all of it when nothing is measured).
    idle_unheld = F.when(capacity > held, _share(UNALLOCATED, idle * (capacity - held) / capacity))
    free = F.array_compact(F.array(idle_unheld))
    by_use = F.concat(holders, guests, free)
    unheld = F.when(capacity > held, _share(UNALLOCATED, (capacity - held) / capacity))
    by_allocation = F.concat(
        F.transform(units, lambda u: _share(u["ns"], u["n"] / capacity)), F.array_compact(F.array(unheld))
    )
    shares = (
        F.when(F.coalesce(F.col("gpu_lost"), F.lit(False)), F.array(_share(UNALLOCATED, 1.0)))
        .when(F.col("allocations_known") == F.lit(False), F.array(_share(UNATTRIBUTED, 1.0)))
        .when(F.size(units) == 0, F.array(_share(UNALLOCATED, 1.0)))
        .when((F.size(units) == 1) & (capacity == held), F.array(_share(units[0]["ns"], 1.0)))
        .when(m.isNull(), by_allocation)
        .otherwise(by_use)
    )
    temporary = ("_units", "_held", "_capacity", "_by_sm", "_by_memory", "_m", "_total", "_used")
    return s.withColumn("shares", shares).drop(*temporary)


def recompute(samples: DataFrame, start_ms: int, end_ms: int) -> DataFrame:
    """Per (namespace, gpu_model): gpu_seconds and energy_joules, every sample's parts added up.

    ``samples`` must reach back far enough before ``start_ms`` for each GPU's previous sample
    (the caller reads STALE_MS more)."""
    mig = F.col("mig")
    s = samples.select(
        F.coalesce(mig["mig_uuid"], F.col("uuid")).alias("key"),  # a MIG slice has a timeline of its own
        "model_name",
        "interval_ms",
        "gpu_lost",
        "allocations_known",
        "allocations",
        "processes",
        "shared_replicas",
        "mig",
        "mig_enabled",
        "mig_configured_fraction",
        "mig_energy_by_slice",
        "power_w",
        "_kafka_partition",
        "_kafka_offset",
        F.unix_millis("timestamp_ms").alias("ts"),
        # Activity: SM activity where reported, else utilisation, clamped to 0..1; null when lost.
        F.when(
            ~F.coalesce(F.col("gpu_lost"), F.lit(False)),
            F.least(F.greatest(F.coalesce("sm_active_ratio", "gpu_util_ratio"), F.lit(0.0)), F.lit(1.0)),
        ).alias("activity"),
        # The energy counter and the share of its delta that is the sample's: its own, else on a
        # MIG slice the parent GPU's, by the slice's fraction (NVML measures only the whole GPU).
        F.coalesce("total_energy_mj", F.when(mig.isNotNull(), F.col("mig_parent_energy_mj"))).alias("mj"),
        F.when(
            F.col("total_energy_mj").isNull() & F.col("mig_parent_energy_mj").isNotNull() & mig.isNotNull(),
            _unit(mig["slice_fraction"]),
        )
        .otherwise(F.lit(1.0))
        .alias("mj_share"),
        # The share of a whole GPU the time is worth: a slice its fraction, a MIG-mode GPU's own
        # record none (its slices bill it).
        F.when(mig.isNotNull(), _unit(mig["slice_fraction"]))
        .when(F.coalesce(F.col("mig_enabled"), F.lit(False)), F.lit(0.0))
        .otherwise(F.lit(1.0))
        .alias("fraction"),
    )
    # A repeated sample (same GPU, same timestamp) counts once: the first on the topic.
    first = Window.partitionBy("key", "ts").orderBy("_kafka_partition", "_kafka_offset")
    s = s.withColumn("_n", F.row_number().over(first)).where("_n = 1").drop("_n")
    by_gpu = Window.partitionBy("key").orderBy("ts")
    s = s.withColumn("prev_ts", F.lag("ts").over(by_gpu)).withColumn("prev_mj", F.lag("mj").over(by_gpu))
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
    delta = (F.col("mj") - F.col("prev_mj")).cast("double") * F.col("mj_share")
    measured = (
        F.col("has_ref")
        & F.col("prev_mj").isNotNull()
        & F.col("mj").isNotNull()
        & (delta >= 0)
        & (delta <= MAX_PLAUSIBLE_POWER_W * gap)
    )
    estimated = F.when(F.col("power_w") >= 0, F.col("power_w").cast("double") * F.col("dt_ms") / 1000.0)
    s = s.withColumn(
        "energy_j", F.when(measured, delta / 1000.0).otherwise(F.coalesce(estimated, F.lit(0.0)))
    )
    s = s.where((F.col("ts") >= start_ms) & (F.col("ts") < end_ms))

    # The record of a GPU in MIG mode (not a slice) bills no time of its own: the capacity no slice
    # covers goes to __unallocated__, with that share of the energy when the slices bill the rest
    # by slice; else its energy stays whole, as __mig_shared__.
    by_slice = F.coalesce(F.col("mig_energy_by_slice"), F.lit(False))
    uncovered = F.when(
        F.col("mig_configured_fraction").isNotNull(), _unit(F.lit(1.0) - F.col("mig_configured_fraction"))
    ).otherwise(F.lit(0.0))
    free_s = F.col("dt_ms") / 1000.0 * uncovered

    def part(namespace: str, seconds: Column, joules: Column) -> Column:
        return F.struct(F.lit(namespace).alias("namespace"), seconds.alias("seconds"), joules.alias("joules"))

    parent = F.array_compact(
        F.array(
            F.when(~by_slice, part(MIG_SHARED, F.lit(0.0), F.col("energy_j"))),
            F.when(
                free_s > 0,
                part(
                    UNALLOCATED, free_s, F.when(by_slice, F.col("energy_j") * uncovered).otherwise(F.lit(0.0))
                ),
            ),
        )
    )
    s = with_pod_shares(s)
    gpu_s = F.col("dt_ms") / 1000.0 * F.col("fraction")
    shares = F.transform(
        F.col("shares"),
        lambda sh: F.struct(
            sh["namespace"].alias("namespace"),
            (gpu_s * sh["weight"]).alias("seconds"),
            (F.col("energy_j") * sh["weight"]).alias("joules"),
        ),
    )
    is_parent = mig.isNull() & F.coalesce(F.col("mig_enabled"), F.lit(False))
    parts = s.select("model_name", F.explode(F.when(is_parent, parent).otherwise(shares)).alias("c"))
    return parts.groupBy(F.col("c.namespace").alias("namespace"), "model_name").agg(
        F.sum("c.seconds").alias("gpu_seconds"),
        F.sum("c.joules").alias("energy_joules"),
    )


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
        rows = recompute(samples, start_ms, end_ms)
        result = {
            "recomputed": priced([r.asDict() for r in rows.collect()], args.prices),
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
