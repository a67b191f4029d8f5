-- GpuRecommendation on gpu.recommendations.v1: generated from schemas/GpuRecommendation.avsc; do not edit by hand.
-- Set the broker with: ALTER TABLE ... SET ('properties.bootstrap.servers' = 'HOST:PORT')
-- Holds enums: Flink's 'avro' format cannot decode them (it has no enum column).
-- Read this topic with 'format' = 'avro-confluent' and a registry
-- (producers with --schema-registry-url).
CREATE TABLE `gpu_recommendation` (
  `recommendation_id` STRING NOT NULL,
  `sequence` BIGINT NOT NULL,
  `status` STRING NOT NULL,
  `resolve_reason` STRING,
  `timestamp_ms` TIMESTAMP(3) NOT NULL,
  `hostname` STRING NOT NULL,
  `uuid` STRING NOT NULL,
  `mig_uuid` STRING,
  `gpu_index` INT,
  `model_name` STRING NOT NULL,
  `mig_profile` STRING,
  `gpu_fraction` DOUBLE NOT NULL,
  `resource_name` STRING,
  `namespace` STRING NOT NULL,
  `pod` STRING NOT NULL,
  `container` STRING,
  `owner_kind` STRING,
  `owner_name` STRING,
  `team` STRING,
  `labels` MAP<STRING NOT NULL, STRING NOT NULL> NOT NULL,
  `idle_since_ms` TIMESTAMP(3) NOT NULL,
  `last_seen_ms` TIMESTAMP(3) NOT NULL,
  `idle_seconds` DOUBLE NOT NULL,
  `gpu_hours_idle` DOUBLE NOT NULL,
  `cost_wasted` DOUBLE NOT NULL,
  `currency` STRING NOT NULL,
  `idle_threshold` DOUBLE NOT NULL,
  `activity_peak_ratio` DOUBLE,
  `memory_peak_bytes` BIGINT,
  `memory_total_bytes` BIGINT,
  `action` STRING NOT NULL,
  `target` STRING,
  `saving_per_hour` DOUBLE,
  `message` STRING NOT NULL,
  `kafka_headers` MAP<STRING, BYTES> METADATA FROM 'headers' VIRTUAL
) WITH (
  'connector' = 'kafka',
  'topic' = 'gpu.recommendations.v1',
  'properties.bootstrap.servers' = 'localhost:9092',
  'scan.startup.mode' = 'earliest-offset',
  'format' = 'avro'
);
