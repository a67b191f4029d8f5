"""Benchmarks: simulated producer throughput and bytes per sample on the wire.

1. producer_throughput: the real `--speed max` loop (simulate, encode, frame,
   produce to the local broker, flush) vs bare fastavro encoding of the same
   records, both in this process. Target: >= 0.70.
2. wire_size: dcgm-exporter text exposition bytes for a GPU / compressed Avro
   bytes per GpuSample as stored by the broker (log segment bytes on disk).
   Target: >= 20 (i.e. Avro on Kafka at most 1/20 of the exposition).
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
import uuid
from pathlib import Path

from common import BENCH_KAFKA_DIR, bench_kafka, best_of, figure, ratio_line
from fastavro import schemaless_writer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.command import fleet_config
from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.service import run_simulated
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

NODES, GPUS = 16, 8
T0 = 1_795_000_000_000


def make_args(ticks: int, interval_ms: int = 1000) -> argparse.Namespace:
    return argparse.Namespace(
        interval=interval_ms,
        nodes=NODES,
        gpus_per_node=GPUS,
        seed=7,
        xid_rate=0.002,
        hostname_prefix="sim-node",
        start_time=T0,
        duration=ticks * interval_ms,
        speed=0.0,
    )


def records(ticks: int) -> list[dict]:
    fleet = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS, seed=7))
    out = []
    for k in range(ticks):
        out += fleet.tick(T0 + k * 1000)[0]
    return out


def bare_encode_s(recs: list[dict]) -> float:
    parsed = catalog.current("GpuSample").parsed

    def run() -> float:
        t = time.perf_counter()
        for r in recs:
            buf = io.BytesIO()
            schemaless_writer(buf, parsed, r)
            buf.getvalue()
        return time.perf_counter() - t

    return best_of(3, run)


def produce_s(bootstrap: str, ticks: int, compression: str = "zstd") -> tuple[float, str, int]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, [topics.SAMPLES, topics.XID], prefix=prefix)
    t_s, t_x = prefix + topics.SAMPLES, prefix + topics.XID
    pub = Publisher(producer_config(bootstrap, compression=compression))
    codec = AvroCodec()
    args = make_args(ticks)
    t = time.perf_counter()
    run_simulated(
        args,
        fleet_config(args),
        pub,
        ProducerMetrics(),
        threading.Event(),
        t_s,
        t_x,
        codec.encoder("GpuSample").encode,
        codec.encoder("XidEvent").encode,
    )
    left = pub.flush(120)
    dt = time.perf_counter() - t
    assert left == 0 and pub.failed == 0, f"undelivered={left} failed={pub.failed}"
    return dt, t_s, pub.sent


def topic_bytes_on_disk(topic: str) -> int:
    total = 0
    for d in (BENCH_KAFKA_DIR / "data").glob(f"{topic}-*"):
        total += sum(f.stat().st_size for f in Path(d).glob("*.log"))
    return total


# -- dcgm-exporter exposition of the same samples (labels as dcgm-exporter has them) ---------------
EXPO_FIELDS = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda r: r["sm_clock_mhz"]),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", lambda r: r["mem_clock_mhz"]),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", lambda r: r["memory_temp_c"]),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda r: r["gpu_temp_c"]),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda r: r["power_w"]),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda r: r["total_energy_mj"],
    ),
    (
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
        lambda r: r["pcie_replay_count"],
    ),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda r: _pct(r["gpu_util_ratio"])),
    (
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory utilization (in %).",
        lambda r: _pct(r["mem_copy_util_ratio"]),
    ),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", lambda r: _pct(r["enc_util_ratio"])),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", lambda r: _pct(r["dec_util_ratio"])),
    (
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error encountered.",
        lambda r: r["last_xid"] or 0,
    ),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", lambda r: r["fb_free_bytes"] >> 20),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", lambda r: r["fb_used_bytes"] >> 20),
    (
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory reserved (in MiB).",
        lambda r: r["fb_reserved_bytes"] >> 20,
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        lambda r: r["remapped_rows_uncorrectable"],
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        lambda r: r["remapped_rows_correctable"],
    ),
    (
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
        lambda r: int(bool(r["row_remap_failure"])),
    ),
    (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        lambda r: r["gr_engine_active_ratio"],
    ),
    (
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        lambda r: r["tensor_active_ratio"],
    ),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        lambda r: r["dram_active_ratio"],
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "The rate of data transmitted over the PCIe bus - including both "
        "protocol headers and data payloads - in bytes per second.",
        lambda r: r["pcie_tx_bytes_per_s"],
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "The rate of data received over the PCIe bus - including both "
        "protocol headers and data payloads - in bytes per second.",
        lambda r: r["pcie_rx_bytes_per_s"],
    ),
    (
        "DCGM_FI_PROF_SM_ACTIVE",
        "gauge",
        "The ratio of cycles an SM has at least 1 warp assigned.",
        lambda r: r["sm_active_ratio"],
    ),
    (
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "gauge",
        "The ratio of number of warps resident on an SM.",
        lambda r: r["sm_occupancy_ratio"],
    ),
]


def _pct(v: float | None) -> float | None:
    return None if v is None else round(v * 100)


def exposition(node_samples: list[dict]) -> str:
    lines = []
    for name, typ, help_, get in EXPO_FIELDS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {typ}")
        for r in node_samples:
            v = get(r)
            if v is None:
                continue
            labels = (
                f'gpu="{r["gpu_index"]}",UUID="{r["uuid"]}",pci_bus_id="{r["pci_bus_id"]}",'
                f'device="nvidia{r["gpu_index"]}",modelName="{r["model_name"]}"'
            )
            if r["mig"]:
                labels += f',GPU_I_PROFILE="{r["mig"]["profile"]}",GPU_I_ID="{r["mig"]["gpu_instance_id"]}"'
            labels += f',Hostname="{r["hostname"]}",DCGM_FI_DRIVER_VERSION="{r["driver_version"]}"'
            if r["allocations"]:
                a = r["allocations"][0]
                labels += f',container="{a["container"]}",namespace="{a["namespace"]}",pod="{a["pod"]}"'
            lines.append(f"{name}{{{labels}}} {v}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ticks", type=int, default=200, help="ticks of 16x8 GPUs (default 200 = 25,600 samples)"
    )
    a = ap.parse_args()
    bootstrap = bench_kafka()
    recs = records(a.ticks)
    n = len(recs)

    enc_s = bare_encode_s(recs)
    prod = min((produce_s(bootstrap, a.ticks) for _ in range(2)), key=lambda x: x[0])
    prod_s, topic_zstd, sent = prod
    assert sent == n
    ratio_line("producer_throughput", enc_s / prod_s, 0.70)
    figure("producer_records_per_s", n / prod_s)
    figure("bare_fastavro_encode_per_s", n / enc_s)

    _, topic_lz4, _ = produce_s(bootstrap, a.ticks, "lz4")
    _, topic_none, _ = produce_s(bootstrap, a.ticks, "none")
    time.sleep(
        1.0
    )  # let the broker write its segment files (not a test: a settling pause for a size reading)
    zstd_b = topic_bytes_on_disk(topic_zstd) / n
    lz4_b = topic_bytes_on_disk(topic_lz4) / n
    none_b = topic_bytes_on_disk(topic_none) / n
    by_node: dict[str, list[dict]] = {}
    for r in recs[-NODES * GPUS :]:
        by_node.setdefault(r["hostname"], []).append(r)
    expo_b = sum(len(exposition(v).encode()) for v in by_node.values()) / (NODES * GPUS)
    json_b = sum(len(json.dumps(r).encode()) for r in recs[:2000]) / 2000
    avro_b = sum(len(AvroCodec().encoder("GpuSample").encode(r)) for r in recs[:2000]) / 2000
    ratio_line("wire_size", expo_b / zstd_b, 20.0, fmt="%.1f")
    figure("kafka_bytes_per_sample_zstd", zstd_b, "B")
    figure("kafka_bytes_per_sample_lz4", lz4_b, "B")
    figure("kafka_bytes_per_sample_uncompressed", none_b, "B")
    figure("avro_single_object_bytes_per_sample", avro_b, "B")
    figure("json_bytes_per_sample", json_b, "B")
    figure("dcgm_exposition_bytes_per_gpu", expo_b, "B")


if __name__ == "__main__":
    main()
