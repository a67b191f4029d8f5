-- GPU-hours per namespace and hour from gpu.samples.v1 in Flink SQL, no gpupipe code: run after the
-- generated docs/reference/engines/flink/GpuSample.sql by FlinkSql.java (docs/recipes/flink.md),
-- with bootstrap=HOST:PORT and topic=TOPIC. Rows: window_ms, namespace, gpu_hours.
-- Each sample's time and its MIG fraction are docs/recipes/gpu-hours.md's section 1, who pays its
-- section 2 (the shared-GPU split by measured use included): chargeback's GPU-seconds to 1e-9
-- (tests/integration/recipes/test_flink_gpu_hours.py, `make recipe-check`).
ALTER TABLE gpu_sample SET (
  'properties.bootstrap.servers' = '${bootstrap}', 'topic' = '${topic}',
  'scan.bounded.mode' = 'latest-offset', 'properties.group.id' = 'flink-gpu-hours'
);
WITH k AS (
  SELECT *,
    -- not COALESCE(mig.mig_uuid, uuid): mig_uuid is NOT NULL inside the nullable mig, and Flink's
    -- planner takes it for never null, so that COALESCE returns NULL for every whole GPU
    CASE WHEN mig IS NULL THEN uuid ELSE mig.mig_uuid END AS k,
    -- epoch milliseconds (TIMESTAMPDIFF counts whole seconds)
    CAST(TIMESTAMPDIFF(SECOND, TIMESTAMP '1970-01-01 00:00:00', timestamp_ms) AS BIGINT) * 1000
      + MOD(EXTRACT(MILLISECOND FROM timestamp_ms), 1000) AS ts,
    CAST(LEAST(CASE WHEN interval_ms > 0 THEN interval_ms ELSE 10000 END, 600000) AS BIGINT) AS iv
  FROM gpu_sample
), gaps AS (
  SELECT *, ts - LAG(ts) OVER (PARTITION BY k ORDER BY ts) AS gap,
         LEAST(CAST(FLOOR(iv * 5 / 2) AS BIGINT), 600000) AS cap_ms
  FROM k
), timed AS (
  SELECT *,
    CAST(CASE WHEN gap IS NULL OR gap > 4500000 THEN iv
              WHEN gap > cap_ms THEN GREATEST(iv, cap_ms)
              ELSE gap END AS DOUBLE) / 1000
      * CASE WHEN mig IS NULL THEN CAST(1 AS DOUBLE)
             ELSE GREATEST(LEAST(mig.slice_fraction, CAST(1 AS DOUBLE)), CAST(0 AS DOUBLE)) END AS t,
    mig IS NULL AND mig_enabled IS TRUE AS parent,
    GREATEST(LEAST(COALESCE(sm_active_ratio, gpu_util_ratio), CAST(1 AS DOUBLE)), CAST(0 AS DOUBLE)) AS act
  FROM gaps WHERE gap IS NULL OR gap > 0
), held AS (
  SELECT k, ts, a.namespace AS namespace, a.pod AS pod,
         CAST(GREATEST(COUNT(DISTINCT a.replica), 1) AS DOUBLE) AS n
  FROM timed CROSS JOIN UNNEST(allocations) AS a
  WHERE NOT parent AND NOT gpu_lost AND allocations_known
  GROUP BY k, ts, a.namespace, a.pod
), units AS (
  SELECT timed.k, timed.ts, MAX(timed.t) AS t, MAX(timed.act) AS act, COUNT(*) AS holders,
         SUM(held.n) AS h, CAST(MAX(COALESCE(timed.shared_replicas, 0)) AS DOUBLE) AS rep
  FROM timed JOIN held ON timed.k = held.k AND timed.ts = held.ts
  GROUP BY timed.k, timed.ts
), sized AS (
  SELECT k, ts, t, act, holders, h, CASE WHEN rep > 0 THEN GREATEST(rep, h) ELSE h END AS c FROM units
), owners AS (
  -- measured use per owner: a process' (namespace, pod) when both are set, else NULL (unplaced)
  SELECT k, ts, ons, opod, SUM(sm) AS sm, SUM(mem) AS mem FROM (
    SELECT timed.k, timed.ts,
      CASE WHEN p.namespace <> '' AND p.pod <> '' THEN p.namespace END AS ons,
      CASE WHEN p.namespace <> '' AND p.pod <> '' THEN p.pod END AS opod,
      CASE WHEN p.sm_util_ratio > 0 THEN LEAST(p.sm_util_ratio, CAST(1 AS DOUBLE)) END AS sm,
      CASE WHEN p.used_memory_bytes > 0 THEN CAST(p.used_memory_bytes AS DOUBLE) END AS mem
    FROM timed CROSS JOIN UNNEST(processes) AS p
    WHERE NOT parent AND NOT gpu_lost AND allocations_known
  ) GROUP BY k, ts, ons, opod
), totals AS (
  SELECT k, ts, SUM(sm) AS sm, SUM(mem) AS mem FROM owners GROUP BY k, ts
), z AS (
  -- u: the GPU's measured use (NULL: split by units alone, as an exclusive GPU is), by SM or memory
  SELECT sized.*,
    CASE WHEN holders = 1 AND c = h THEN CAST(NULL AS STRING)
         WHEN tot.sm > 0 THEN 'sm' WHEN tot.mem > 0 AND act > 0 THEN 'mem' END AS by_,
    CASE WHEN holders = 1 AND c = h THEN CAST(NULL AS DOUBLE)
         WHEN tot.sm > 0 THEN LEAST(tot.sm, CAST(1 AS DOUBLE)) WHEN tot.mem > 0 AND act > 0 THEN act END AS u,
    CASE WHEN tot.sm > 0 THEN tot.sm ELSE tot.mem END AS total
  FROM sized LEFT JOIN totals AS tot ON sized.k = tot.k AND sized.ts = tot.ts
), ow AS (
  SELECT o.k, o.ts, o.ons, o.opod, CASE WHEN z.by_ = 'sm' THEN o.sm ELSE o.mem END AS w
  FROM owners AS o JOIN z ON o.k = z.k AND o.ts = z.ts
  WHERE z.u IS NOT NULL AND (CASE WHEN z.by_ = 'sm' THEN o.sm ELSE o.mem END) > 0
), unplaced AS (
  SELECT k, ts, SUM(w) AS w FROM ow WHERE ons IS NULL GROUP BY k, ts
), shares AS (
  SELECT timed.ts, CASE WHEN timed.gpu_lost THEN '__unallocated__' ELSE '__unattributed__' END AS namespace,
         timed.t AS secs
  FROM timed WHERE NOT parent AND (gpu_lost OR NOT allocations_known)
  UNION ALL
  SELECT ts, '__unallocated__', t * (1 - GREATEST(LEAST(COALESCE(mig_configured_fraction, 0), 1), 0))
  FROM timed WHERE parent
  UNION ALL
  SELECT ts, '__unallocated__', t FROM timed
  WHERE NOT parent AND NOT gpu_lost AND allocations_known AND CARDINALITY(allocations) = 0
  UNION ALL
  -- each holder: its measured use, its part of the unplaced use by units held, and of the idle rest
  -- by units of capacity
  SELECT z.ts, held.namespace,
    CASE WHEN z.u IS NULL THEN z.t * held.n / z.c
         ELSE z.t * (z.u * COALESCE(ow.w, 0) / z.total + z.u * COALESCE(un.w, 0) / z.total * held.n / z.h
                     + (1 - z.u) * held.n / z.c) END
  FROM z JOIN held ON z.k = held.k AND z.ts = held.ts
  LEFT JOIN ow ON ow.k = z.k AND ow.ts = z.ts AND ow.ons = held.namespace AND ow.opod = held.pod
  LEFT JOIN unplaced AS un ON un.k = z.k AND un.ts = z.ts
  UNION ALL
  -- a pod whose processes run on a GPU it does not hold: its measured use
  SELECT z.ts, ow.ons, z.t * z.u * ow.w / z.total
  FROM ow JOIN z ON ow.k = z.k AND ow.ts = z.ts
  LEFT JOIN held ON held.k = ow.k AND held.ts = ow.ts AND held.namespace = ow.ons AND held.pod = ow.opod
  WHERE ow.ons IS NOT NULL AND held.k IS NULL
  UNION ALL
  SELECT ts, '__unallocated__', t * COALESCE(1 - u, 1) * (c - h) / c FROM z WHERE c > h
)
SELECT ts - MOD(ts, 3600000) AS window_ms, namespace, SUM(secs) / 3600 AS gpu_hours
FROM shares GROUP BY ts - MOD(ts, 3600000), namespace;
