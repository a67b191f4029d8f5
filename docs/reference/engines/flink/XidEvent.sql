-- XidEvent on gpu.xid.v1: generated from schemas/XidEvent.avsc; do not edit by hand.
-- Set the broker with: ALTER TABLE ... SET ('properties.bootstrap.servers' = 'HOST:PORT')
-- Holds enums: Flink's 'avro' format cannot decode them (it has no enum column).
-- Read this topic with 'format' = 'avro-confluent' and a registry
-- (producers with --schema-registry-url).
CREATE TABLE `xid_event` (
  `event_id` STRING NOT NULL,
  `timestamp_ms` TIMESTAMP(3) NOT NULL,
  `hostname` STRING NOT NULL,
  `kind` STRING NOT NULL,
  `xid` INT,
  `pci_bus_id` STRING NOT NULL,
  `gpu_index` INT,
  `uuid` STRING,
  `model_name` STRING,
  `driver_version` STRING,
  `pid` BIGINT,
  `process_name` STRING,
  `message` STRING NOT NULL,
  `gpu_instance_id` INT,
  `compute_instance_id` INT,
  `mig_uuid` STRING,
  `source` STRING NOT NULL,
  `allocations` ARRAY<ROW<`namespace` STRING NOT NULL, `pod` STRING NOT NULL, `container` STRING NOT NULL, `resource_name` STRING, `replica` INT, `owner_kind` STRING, `owner_name` STRING, `labels` MAP<STRING NOT NULL, STRING NOT NULL> NOT NULL, `priority_class` STRING, `metadata_status` STRING, `hpc_job` STRING, `claim_name` STRING, `claim_namespace` STRING, `dra_pool` STRING, `dra_device` STRING, `dra_share_id` STRING> NOT NULL> NOT NULL,
  `boot_id` STRING,
  `vendor` STRING NOT NULL,
  `operational` ROW<`module_signature` STRING NOT NULL, `module_event_code` INT NOT NULL, `category_id` INT NOT NULL, `category` STRING, `severity` INT NOT NULL, `log_level` INT NOT NULL, `scope` INT NOT NULL, `originator` INT NOT NULL, `attributes` INT NOT NULL, `module_instance` INT, `chiplet_id` INT, `trace_id` BIGINT NOT NULL, `instance_id` BIGINT, `group_cursor` BIGINT, `group_size` INT, `group_index` INT, `group_attributes` INT, `driver_timestamp_us` BIGINT, `legacy_xid` INT, `legacy_sources` ARRAY<STRING NOT NULL> NOT NULL, `contexts` ARRAY<ROW<`context_type` INT NOT NULL, `source_context_type` INT, `format_version` INT, `legacy_xid` INT, `data` BYTES> NOT NULL> NOT NULL>,
  `kafka_headers` MAP<STRING, BYTES> METADATA FROM 'headers' VIRTUAL
) WITH (
  'connector' = 'kafka',
  'topic' = 'gpu.xid.v1',
  'properties.bootstrap.servers' = 'localhost:9092',
  'scan.startup.mode' = 'earliest-offset',
  'format' = 'avro'
);
