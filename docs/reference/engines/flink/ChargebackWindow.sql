-- ChargebackWindow on gpu.chargeback.v1: generated from schemas/ChargebackWindow.avsc; do not edit by hand.
-- Set the broker with: ALTER TABLE ... SET ('properties.bootstrap.servers' = 'HOST:PORT')
-- Holds enums: Flink's 'avro' format cannot decode them (it has no enum column).
-- Read this topic with 'format' = 'avro-confluent' and a registry
-- (producers with --schema-registry-url).
CREATE TABLE `chargeback_window` (
  `kind` STRING NOT NULL,
  `window_start_ms` TIMESTAMP(3) NOT NULL,
  `window_end_ms` TIMESTAMP(3) NOT NULL,
  `namespace` STRING NOT NULL,
  `team` STRING,
  `node` STRING NOT NULL,
  `gpu_model` STRING NOT NULL,
  `allocated_gpu_seconds` DOUBLE NOT NULL,
  `used_gpu_seconds` DOUBLE NOT NULL,
  `idle_gpu_seconds` DOUBLE NOT NULL,
  `activity_unknown_gpu_seconds` DOUBLE NOT NULL,
  `shared_gpu_seconds` DOUBLE NOT NULL,
  `mig_gpu_seconds` DOUBLE NOT NULL,
  `lost_gpu_seconds` DOUBLE NOT NULL,
  `energy_joules` DOUBLE NOT NULL,
  `energy_estimated_joules` DOUBLE NOT NULL,
  `sample_count` BIGINT NOT NULL,
  `price_per_gpu_hour` DOUBLE NOT NULL,
  `price_per_kwh` DOUBLE NOT NULL,
  `price_source` STRING NOT NULL,
  `cost_allocation` DOUBLE NOT NULL,
  `cost_energy` DOUBLE NOT NULL,
  `cost_total` DOUBLE NOT NULL,
  `currency` STRING NOT NULL,
  `source_partition` INT NOT NULL,
  `instance_id` STRING NOT NULL,
  `emitted_at_ms` TIMESTAMP(3) NOT NULL,
  `workloads` ARRAY<ROW<`owner_kind` STRING, `owner_name` STRING, `labels` MAP<STRING NOT NULL, STRING NOT NULL> NOT NULL, `hpc_job` STRING, `claim_name` STRING, `allocated_gpu_seconds` DOUBLE NOT NULL, `used_gpu_seconds` DOUBLE NOT NULL, `idle_gpu_seconds` DOUBLE NOT NULL, `energy_joules` DOUBLE NOT NULL, `cost_allocation` DOUBLE NOT NULL, `cost_energy` DOUBLE NOT NULL, `cost_total` DOUBLE NOT NULL> NOT NULL> NOT NULL,
  `record_id` STRING,
  `late_offsets` ARRAY<BIGINT NOT NULL> NOT NULL,
  `kafka_headers` MAP<STRING, BYTES> METADATA FROM 'headers' VIRTUAL
) WITH (
  'connector' = 'kafka',
  'topic' = 'gpu.chargeback.v1',
  'properties.bootstrap.servers' = 'localhost:9092',
  'scan.startup.mode' = 'earliest-offset',
  'format' = 'avro'
);
