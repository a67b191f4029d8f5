"""GPU-hours per namespace and hour from the lake's samples table with DuckDB's iceberg extension.

No catalog and no gpupipe code: ``iceberg_scan`` opens the table directory (the lake writes
``metadata/version-hint.text``). Each sample's time follows chargeback's rules in SQL
(docs/recipes/gpu-hours.md, section 1); who pays for it is ``pod_shares`` from gpu_shares.py beside
this file, as a DuckDB Python function (section 2).

Usage: python duckdb_gpu_hours.py SAMPLES_TABLE_DIR [--window-ms MS] [--extension-directory DIR]
  SAMPLES_TABLE_DIR: <warehouse>/gpupipe/samples (a local path or one DuckDB's httpfs reads)
  --extension-directory: where iceberg (and avro) already are, when INSTALL cannot download them
Prints one tab-separated line per (window start in epoch ms, namespace): window_ms, namespace,
gpu_hours.
"""

from __future__ import annotations

import argparse
import json

import duckdb
from gpu_shares import pod_shares

#: Per key in time order: the time each sample bills (gpu-hours.md, section 1), its fraction of a
#: GPU, and for a MIG-mode GPU's own record the capacity no slice covers.
QUERY = """
WITH s AS (
  SELECT *, epoch_ms(timestamp_ms) AS ts, COALESCE(mig.mig_uuid, uuid) AS gpu_key,
         LEAST(CASE WHEN interval_ms > 0 THEN interval_ms ELSE 10000 END, 600000) AS ival
  FROM iceberg_scan({table})
), ordered AS (
  SELECT *, LEAST(FLOOR(ival * 2.5), 600000) AS cap,
         ts - LAG(ts) OVER (PARTITION BY gpu_key ORDER BY ts) AS gap
  FROM s
  QUALIFY gap IS NULL OR gap <> 0  -- the same sample again counts once
), billed AS (
  SELECT *,
         CASE WHEN gap IS NULL OR gap > 4500000 THEN ival  -- first, or forgotten after a silence
              WHEN gap > cap THEN GREATEST(ival, cap) ELSE gap END / 1000.0 AS secs
  FROM ordered
)
SELECT ts - ts % {window} AS window_ms, '__unallocated__' AS namespace,
       secs * LEAST(GREATEST(1.0 - mig_configured_fraction, 0.0), 1.0) AS gpu_s
FROM billed WHERE mig IS NULL AND mig_enabled AND mig_configured_fraction IS NOT NULL
UNION ALL
SELECT window_ms, share.namespace, gpu_s * share.weight FROM (
  SELECT ts - ts % {window} AS window_ms,
         secs * CASE WHEN mig IS NULL THEN 1.0
                     ELSE LEAST(GREATEST(mig.slice_fraction, 0.0), 1.0) END AS gpu_s,
         UNNEST(from_json(pod_shares(to_json(struct_pack(
           gpu_lost, allocations_known, allocations, shared_replicas, processes,
           sm_active_ratio, gpu_util_ratio))), '[{{"namespace": "VARCHAR", "weight": "DOUBLE"}}]')) AS share
  FROM billed WHERE mig IS NOT NULL OR NOT COALESCE(mig_enabled, FALSE)
)
"""


def shares_json(sample: str) -> str:
    """``pod_shares`` over the sample's fields as JSON, as a list of {namespace, weight}."""
    out = pod_shares(json.loads(sample))
    return json.dumps([{"namespace": ns, "weight": w} for ns, w in out.items()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table")
    p.add_argument("--window-ms", type=int, default=3_600_000)
    p.add_argument("--extension-directory", default=None)
    args = p.parse_args()
    config = {"extension_directory": args.extension_directory} if args.extension_directory else {}
    con = duckdb.connect(config=config)
    if not args.extension_directory:
        con.execute("INSTALL iceberg")
    con.execute("LOAD iceberg")
    con.create_function("pod_shares", shares_json, ["VARCHAR"], "VARCHAR", side_effects=False)
    table = "'" + args.table.replace("'", "''") + "'"
    query = QUERY.format(table=table, window=int(args.window_ms))
    rows = con.execute(
        f"SELECT window_ms, namespace, SUM(gpu_s) / 3600.0 FROM ({query}) GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    for window, ns, hours in rows:
        print(f"{window}\t{ns}\t{hours!r}")


if __name__ == "__main__":
    main()
