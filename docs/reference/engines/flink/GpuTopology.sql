-- GpuTopology on gpu.topology.v1: generated from schemas/GpuTopology.avsc; do not edit by hand.
-- Set the broker with: ALTER TABLE ... SET ('properties.bootstrap.servers' = 'HOST:PORT')
-- Holds enums: Flink's 'avro' format cannot decode them (it has no enum column).
-- Read this topic with 'format' = 'avro-confluent' and a registry
-- (producers with --schema-registry-url).
CREATE TABLE `gpu_topology` (
  `hostname` STRING NOT NULL,
  `timestamp_ms` TIMESTAMP(3) NOT NULL,
  `driver_version` STRING,
  `gpus` ARRAY<ROW<`gpu_index` INT NOT NULL, `uuid` STRING NOT NULL, `pci_bus_id` STRING, `gpu_lost` BOOLEAN NOT NULL, `numa_node` INT, `memory_numa_node` INT, `cpu_affinity` STRING, `nvlinks` ARRAY<ROW<`link` INT NOT NULL, `state` STRING, `remote_type` STRING, `remote_pci_bus_id` STRING, `peer_uuid` STRING> NOT NULL> NOT NULL, `nvlink_domain` INT> NOT NULL> NOT NULL,
  `pairs` ARRAY<ROW<`gpu_a` INT NOT NULL, `gpu_b` INT NOT NULL, `pcie_ancestor` STRING, `nvlink_p2p` BOOLEAN> NOT NULL> NOT NULL,
  `kafka_headers` MAP<STRING, BYTES> METADATA FROM 'headers' VIRTUAL
) WITH (
  'connector' = 'kafka',
  'topic' = 'gpu.topology.v1',
  'properties.bootstrap.servers' = 'localhost:9092',
  'scan.startup.mode' = 'earliest-offset',
  'format' = 'avro'
);
