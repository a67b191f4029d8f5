"""Read gpu.samples.v1 straight from Kafka with Spark Structured Streaming.

Each value is Avro single-object encoded (docs/topics.md): ``C3 01``, the schema's 8-byte
CRC-64-AVRO fingerprint, then the Avro body. The job keeps the records whose header names the
GpuSample schema it decodes with (the repository's ``schemas/GpuSample.avsc``), drops the 10 header
bytes and decodes the body with Spark's ``from_avro``; records of another schema version (or with
the Confluent framing of a registry) are counted as skipped, never decoded with the wrong schema.

Two modes:

* default: runs until stopped, printing each node's average power per minute to the console;
* ``--available-now``: reads what the topic holds, stops, and prints one JSON document: per node
  its samples and summed ``power_w``, and the skipped count
  (``tests/integration/consumers/lake/test_spark_stream.py`` runs it against a real broker).

    python docs/recipes/spark_stream_samples.py --bootstrap-servers kafka:9092 \\
        --jars "$(scripts/spark-jars | tail -1)"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro

from gpupipe_schemas import catalog

SINGLE_OBJECT_MAGIC = b"\xc3\x01"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", default="gpu.samples.v1", help="with the environment's prefix, if any")
    p.add_argument("--available-now", action="store_true", help="read what is there, print a summary, stop")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: a temporary one)")
    p.add_argument("--jars", default=None, help="comma-separated jars (scripts/spark-jars)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--driver-memory", default="1g")
    args = p.parse_args(argv)

    schema = catalog.current("GpuSample")
    header = SINGLE_OBJECT_MAGIC + schema.fingerprint
    b = (
        SparkSession.builder.master(args.master)
        .appName("gpupipe-samples-stream")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if args.jars:
        b = b.config("spark.jars", args.jars)
    spark = b.getOrCreate()
    try:
        raw = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", args.bootstrap_servers)
            .option("subscribe", args.topic)
            .option("startingOffsets", "earliest")
            .load()
        )
        ours = F.substring("value", 1, len(header)) == F.lit(header)
        decoded = raw.select(
            ours.alias("ours"),
            F.when(
                ours,
                from_avro(F.expr(f"substring(value, {len(header) + 1})"), json.dumps(schema.raw)),
            ).alias("s"),
        )
        checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="gpupipe-stream-")
        if args.available_now:
            rows = decoded.select("ours", "s.hostname", "s.power_w")
            q = (
                rows.writeStream.format("memory")
                .queryName("samples")
                .option("checkpointLocation", checkpoint)
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
            got = spark.sql(
                "SELECT hostname, count(*) AS samples, sum(power_w) AS power_w FROM samples "
                "WHERE ours GROUP BY hostname"
            ).collect()
            skipped = spark.sql("SELECT count(*) AS n FROM samples WHERE NOT ours").collect()[0]["n"]
            out = {
                "nodes": {r["hostname"]: {"samples": r["samples"], "power_w": r["power_w"]} for r in got},
                "skipped": skipped,
            }
            json.dump(out, sys.stdout, sort_keys=True)
            print()
        else:
            per_minute = (
                decoded.where("ours")
                .select("s.*")
                .withWatermark("timestamp_ms", "2 minutes")
                .groupBy(F.window("timestamp_ms", "1 minute"), "hostname")
                .agg(F.avg("power_w").alias("avg_power_w"), F.count(F.lit(1)).alias("samples"))
            )
            q = (
                per_minute.writeStream.outputMode("append")
                .format("console")
                .option("truncate", "false")
                .option("checkpointLocation", checkpoint)
                .start()
            )
            q.awaitTermination()
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
