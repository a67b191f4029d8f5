"""GPU-hours per namespace and hour from gpu.samples.v1 in Flink SQL (PyFlink), no gpupipe code.

Reads the raw framing (producers with --framing samples=raw) through the generated DDL
(docs/reference/engines/flink/GpuSample.sql) with Flink's Kafka SQL connector and 'avro' format.
Billing follows chargeback: each sample bills the time since its GPU's (or MIG slice's) previous
sample, capped at 2.5 intervals and 600 s, the first sample its own interval; a MIG slice bills its
slice_fraction; a MIG-enabled parent bills nothing; a GPU nobody holds goes to __unallocated__.

Usage: python flink_gpu_hours.py BOOTSTRAP GpuSample.sql JAR[,JAR...] [TOPIC]
Prints one tab-separated line per (window start, namespace): window, namespace, gpu_hours.
"""

import sys

from pyflink.table import EnvironmentSettings, TableEnvironment

bootstrap, ddl_file, jars = sys.argv[1:4]
topic = sys.argv[4] if len(sys.argv) > 4 else "gpu.samples.v1"
env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
conf = env.get_config()
conf.set("pipeline.jars", ";".join("file://" + j for j in jars.split(",")))
conf.set("parallelism.default", "1")
conf.set("table.local-time-zone", "UTC")

with open(ddl_file) as f:
    env.execute_sql(f.read().rstrip().rstrip(";"))
env.execute_sql(
    f"""ALTER TABLE gpu_sample SET ('properties.bootstrap.servers' = '{bootstrap}', 'topic' = '{topic}',
    'scan.bounded.mode' = 'latest-offset', 'properties.group.id' = 'flink-gpu-hours')"""
)
QUERY = """
WITH s AS (
  SELECT timestamp_ms, mig, mig_enabled, allocations, interval_ms,
         LAG(timestamp_ms) OVER (PARTITION BY uuid, COALESCE(mig.mig_uuid, '')
                                 ORDER BY timestamp_ms) AS prev_ts
  FROM gpu_sample
), billed AS (
  SELECT timestamp_ms, allocations,
         CASE WHEN prev_ts IS NULL THEN interval_ms / 1000.0
              ELSE LEAST(TIMESTAMPDIFF(SECOND, prev_ts, timestamp_ms) * 1.0,
                         2.5 * interval_ms / 1000.0, 600.0)
         END * CASE WHEN mig IS NULL THEN 1.0 ELSE mig.slice_fraction END AS secs
  FROM s WHERE mig_enabled IS NULL OR mig_enabled = FALSE
), per_ns AS (
  SELECT timestamp_ms, a.namespace AS namespace, secs / CARDINALITY(allocations) AS secs
  FROM billed CROSS JOIN UNNEST(allocations) AS a
  UNION ALL
  SELECT timestamp_ms, '__unallocated__', secs FROM billed WHERE CARDINALITY(allocations) = 0
)
SELECT DATE_FORMAT(FLOOR(timestamp_ms TO HOUR), 'yyyy-MM-dd HH:mm'), namespace, SUM(secs) / 3600.0
FROM per_ns GROUP BY FLOOR(timestamp_ms TO HOUR), namespace
"""
with env.execute_sql(QUERY).collect() as rows:
    for window, namespace, hours in rows:
        print(f"{window}\t{namespace}\t{hours!r}")
