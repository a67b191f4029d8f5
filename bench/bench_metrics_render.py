"""Benchmark: /metrics rendering and sample ingest of the metrics consumer.

Run: ``.venv/bin/python bench/bench_metrics_render.py`` (about 30-60 s).

1. ``metrics_render``: 10k GPUs x 20 metric families (200k series, dcgm-exporter labels incl.
   pod labels on 75 % of the GPUs). The baseline holds the same series in prometheus_client
   labelled Gauges and renders them with ``generate_latest``. Ours is ``SeriesStore.render``:
   the first scrape after one sample per GPU was ingested (every family joined: the ratio), a
   second scrape with nothing changed (cached), and one after 10 % of the GPUs sent a new sample.
2. ``metrics_ingest``: throughput of decoding with the service's decoder
   (``gpupipe_consumers.metrics.decode``: identity and tail from their bytes, readings checked and left to
   the scrape) plus ``SeriesStore.apply_samples`` (a batch per lock hold, as the service calls it),
   against bare ``fastavro.schemaless_reader`` on the same payloads minus the 10-byte
   single-object header. ratio = ours / baseline throughput (target 2.0), with this file's 20
   families and with the shipped 40-family default counters. ``metrics_ingest_with_render*``
   add the work left to the scrape (converting and rendering a GPU's readings) as if every sample
   were rendered: the strict reading, for a scrape per sample. Steady state: 2k GPUs already known
   to the store (one sample each, untimed), then 5 new samples per GPU timed; the first sample of
   a GPU also renders its label sets (once per GPU and pod change).

Each measurement is repeated and the best run kept, baseline and ours interleaved, so a noisy
machine hurts both alike. Prints ``<name> ratio=<x> target=<t>`` lines plus absolute seconds.
"""

from __future__ import annotations

import gc
import io
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastavro import schemaless_reader
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from gpupipe_consumers.metrics.collectors_csv import default_counters, parse_counters
from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.http import GzipCache
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

GPUS = 10_000
GPUS_PER_NODE = 8
CHANGED_SHARE = 0.10
INGEST_GPUS = 2_000
INGEST_SAMPLES_PER_GPU = 5

# 20 metric families (the dcgm-exporter default set minus the rarely non-zero ones) + the driver label.
COUNTERS_CSV = """\
DCGM_FI_DEV_SM_CLOCK, gauge, SM clock frequency (in MHz).
DCGM_FI_DEV_MEM_CLOCK, gauge, Memory clock frequency (in MHz).
DCGM_FI_DEV_MEMORY_TEMP, gauge, Memory temperature (in C).
DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).
DCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Total energy consumption since boot (in mJ).
DCGM_FI_DEV_PCIE_REPLAY_COUNTER, counter, Total number of PCIe retries.
DCGM_FI_DEV_GPU_UTIL, gauge, GPU utilization (in %).
DCGM_FI_DEV_MEM_COPY_UTIL, gauge, Memory utilization (in %).
DCGM_FI_DEV_ENC_UTIL, gauge, Encoder utilization (in %).
DCGM_FI_DEV_DEC_UTIL, gauge, Decoder utilization (in %).
DCGM_FI_DEV_XID_ERRORS, gauge, Value of the last XID error encountered.
DCGM_FI_DEV_FB_FREE, gauge, Framebuffer memory free (in MiB).
DCGM_FI_DEV_FB_USED, gauge, Framebuffer memory used (in MiB).
DCGM_FI_DEV_FB_RESERVED, gauge, Framebuffer memory reserved (in MiB).
DCGM_FI_PROF_GR_ENGINE_ACTIVE, gauge, Ratio of time the graphics engine is active.
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, gauge, Ratio of cycles the tensor (HMMA) pipe is active.
DCGM_FI_PROF_DRAM_ACTIVE, gauge, Ratio of cycles the device memory interface is active.
DCGM_FI_PROF_PCIE_TX_BYTES, gauge, The rate of data transmitted over the PCIe bus in bytes per second.
DCGM_FI_PROF_PCIE_RX_BYTES, gauge, The rate of data received over the PCIe bus in bytes per second.
DCGM_FI_DRIVER_VERSION, label, Driver Version
"""

MIB = 1 << 20


def make_record(i: int, t_ms: int, rng: random.Random) -> dict:
    """A realistic GpuSample dict for GPU number i (H200 nodes, 3 of 4 GPUs held by a pod)."""
    node, idx = divmod(i, GPUS_PER_NODE)
    busy = rng.random()
    allocated = i % 4 != 3
    ns, pod = f"team-{node % 40:02d}", f"train-{node:05d}-{idx}"
    allocations = (
        [
            {
                "namespace": ns,
                "pod": pod,
                "container": "main",
                "resource_name": "nvidia.com/gpu",
                "replica": None,
            }
        ]
        if allocated
        else []
    )
    used = int(busy * 120_000) * MIB
    return {
        "timestamp_ms": t_ms,
        "hostname": f"gpu-node-{node:05d}",
        "gpu_index": idx,
        "uuid": f"GPU-{i:08x}-5a1e-4c0d-9b7e-{node:012x}",
        "pci_bus_id": f"00000000:{0x18 + idx * 0x10:02X}:00.0",
        "model_name": "NVIDIA H200",
        "driver_version": "570.124.06",
        "numa_node": idx // 4,
        "mig": None,
        "mig_enabled": False,
        "allocations": allocations,
        "processes": [],
        "interval_ms": 1000,
        "gpu_lost": False,
        "gpu_util_ratio": round(busy, 2),
        "mem_copy_util_ratio": round(busy * 0.4, 2),
        "enc_util_ratio": 0.0,
        "dec_util_ratio": 0.0,
        "fb_total_bytes": 143_771 * MIB,
        "fb_free_bytes": 143_771 * MIB - used - 512 * MIB,
        "fb_used_bytes": used,
        "fb_reserved_bytes": 512 * MIB,
        "power_w": round(80 + busy * 600, 3),
        "power_limit_w": 700.0,
        "total_energy_mj": 10_000_000_000 + t_ms,
        "gpu_temp_c": float(30 + int(busy * 40)),
        "memory_temp_c": float(35 + int(busy * 40)),
        "sm_clock_mhz": 1980 if busy > 0.1 else 345,
        "mem_clock_mhz": 3201,
        "clock_event_reasons": 0 if busy > 0.1 else 1,
        "power_violation_ns": 0,
        "thermal_violation_ns": 0,
        "pcie_tx_bytes_per_s": float(int(busy * 2e9)),
        "pcie_rx_bytes_per_s": float(int(busy * 6e9)),
        "pcie_replay_count": 0,
        "nvlink_bandwidth_total_kib": 5_000_000 + t_ms,
        "vgpu_license_status": None,
        "last_xid": None,
        "ecc_sbe_volatile_total": 0,
        "ecc_dbe_volatile_total": 0,
        "ecc_sbe_aggregate_total": 0,
        "ecc_dbe_aggregate_total": 0,
        "retired_pages_sbe": None,
        "retired_pages_dbe": None,
        "retired_pages_pending": None,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "row_remap_pending": False,
        "row_remap_failure": False,
        "gpu_recovery_action": 0,
        "gr_engine_active_ratio": busy,
        "sm_active_ratio": busy * 0.9,
        "sm_occupancy_ratio": busy * 0.4,
        "tensor_active_ratio": busy * 0.6,
        "dram_active_ratio": busy * 0.5,
        "fp64_active_ratio": 0.0,
        "fp32_active_ratio": busy * 0.2,
        "fp16_active_ratio": busy * 0.1,
        "nvlink_tx_bytes_per_s": float(int(busy * 4e10)),
        "nvlink_rx_bytes_per_s": float(int(busy * 4e10)),
    }


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def baseline_registry(store: SeriesStore, records: list[dict]) -> CollectorRegistry:
    """The same 200k series in prometheus_client labelled Gauges (unallocated: empty pod labels)."""
    reg = CollectorRegistry()
    labelnames = [
        "gpu",
        "UUID",
        "pci_bus_id",
        "device",
        "modelName",
        "Hostname",
        "DCGM_FI_DRIVER_VERSION",
        "container",
        "namespace",
        "pod",
    ]
    gauges = [
        (f, Gauge(f.name, f.help, labelnames, registry=reg)) for f in store.families if f.spec is not None
    ]
    for rec in records:
        a = rec["allocations"][0] if rec["allocations"] else {"namespace": "", "pod": "", "container": ""}
        values = (
            str(rec["gpu_index"]),
            rec["uuid"],
            rec["pci_bus_id"],
            f"nvidia{rec['gpu_index']}",
            rec["model_name"],
            rec["hostname"],
            rec["driver_version"],
            a["container"],
            a["namespace"],
            a["pod"],
        )
        for fam, g in gauges:
            src = fam.spec.source
            v = rec.get(src) if src else 0
            g.labels(*values).set(0 if v is None else v)
    return reg


def bench_render() -> None:
    rng = random.Random(7)
    counters = parse_counters(COUNTERS_CSV, source="bench")
    t_ms = 1_764_460_800_000
    records = [make_record(i, t_ms, rng) for i in range(GPUS)]
    store = SeriesStore(counters)
    now = t_ms / 1000.0 + 0.5
    for rec in records:
        store.apply_sample(rec, rec["gpu_index"] % 4, now)
    reg = baseline_registry(store, records)

    # ours, full: nothing cached, every family joined (first scrape, then after any change)
    full_times = []
    for k in range(3):
        gc.collect()
        t0 = time.perf_counter()
        body = store.render(now)
        full_times.append(time.perf_counter() - t0)
        store.apply_sample(make_record(k, t_ms + 1000, rng), 0, now)  # one change: the next scrape re-joins
    # ours, warm: nothing changed since the previous scrape (the joined body is cached)
    store.render_parts(now)
    ours_warm = best(lambda: store.render(now), 5)
    # ours, after 10 % of the GPUs sent a new sample
    changed_times = []
    for k in range(2, 5):
        for i in rng.sample(range(GPUS), int(GPUS * CHANGED_SHARE)):
            store.apply_sample(make_record(i, t_ms + k * 1000, rng), 0, now)
        gc.collect()
        t0 = time.perf_counter()
        store.render(now)
        changed_times.append(time.perf_counter() - t0)
    ours_changed = min(changed_times)

    # gzip (informational): the HTTP layer's cost for a gzip scrape, cold and with the body cached
    gz = GzipCache(level=1)
    store.apply_sample(make_record(0, t_ms + 9000, rng), 0, now)
    parts = store.render_parts(now)
    t0 = time.perf_counter()
    gz_body = b"".join(gz.compress(parts))
    gzip_cold = time.perf_counter() - t0
    gzip_warm = best(lambda: gz.compress(store.render_parts(now)), 3)

    base_times = []
    for _ in range(2):
        gc.collect()
        t0 = time.perf_counter()
        base_body = generate_latest(reg)
        base_times.append(time.perf_counter() - t0)
    baseline = min(base_times)
    ours = min(full_times)
    series = body.count(b"\nDCGM_")
    print(
        f"metrics_render series={series} families={len(store.families)} "
        f"baseline_s={baseline:.3f} ours_full_s={ours:.4f} ours_warm_s={ours_warm:.4f} "
        f"ours_after_10pct_changed_s={ours_changed:.4f} body_mb={len(body) / 1e6:.1f} "
        f"baseline_body_mb={len(base_body) / 1e6:.1f}"
    )
    print(
        f"metrics_gzip level=1 cold_s={gzip_cold:.3f} warm_s={gzip_warm:.4f} "
        f"gzip_mb={len(gz_body) / 1e6:.1f} (informational, HTTP layer)"
    )
    print(
        f"metrics_render_warm ratio={baseline / ours_warm:.1f} "
        f"metrics_render_10pct_changed ratio={baseline / ours_changed:.1f}"
    )
    print(f"metrics_render ratio={baseline / ours:.1f} target=10.0")


def bench_ingest() -> None:
    rng = random.Random(11)
    counters = parse_counters(COUNTERS_CSV, source="bench")
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    writer = catalog.current("GpuSample").parsed
    t0_ms = 1_764_460_800_000
    first = [codec.decode(enc.encode(make_record(i, t0_ms, rng))).record for i in range(INGEST_GPUS)]
    payloads = [
        enc.encode(make_record(i, t0_ms + k * 1000, rng))
        for k in range(1, INGEST_SAMPLES_PER_GPU + 1)
        for i in range(INGEST_GPUS)
    ]
    store = SeriesStore(counters)
    fast = MetricsDecoder(codec, store.renderer)  # what the service decodes with
    decoded = [fast.decode(p).record for p in payloads]
    n = len(payloads)

    t0 = time.perf_counter()
    for rec in first:  # steady state: the store already holds these GPUs (as between rebalances)
        store.apply_sample(rec, 0, 1000.0)
    first_us = (time.perf_counter() - t0) / len(first) * 1e6  # includes rendering each GPU's labels

    def bare(chunk: range) -> None:
        for j in chunk:
            schemaless_reader(io.BytesIO(payloads[j][10:]), writer, None)

    def decode(chunk: range) -> None:
        for j in chunk:
            fast.decode(payloads[j])

    def codec_decode(chunk: range) -> None:
        for j in chunk:
            codec.decode(payloads[j])

    def apply(chunk: range) -> None:  # as the service: a consumed batch under one hold of the lock
        store.apply_samples([(decoded[j], 0) for j in chunk], 1000.0 + chunk[0])

    full = SeriesStore(default_counters())  # the shipped default
    for rec in first:
        full.apply_sample(rec, 0, 1000.0)
    full_dec = MetricsDecoder(codec, full.renderer)
    decoded_default = [full_dec.decode(p).record for p in payloads]

    def apply_default(chunk: range) -> None:
        full.apply_samples([(decoded_default[j], 0) for j in chunk], 1000.0 + chunk[0])

    def decode_default(chunk: range) -> None:
        for j in chunk:
            full_dec.decode(payloads[j])

    # small chunks, the three measured back to back, best of 5 per chunk: a load spike on this
    # shared machine then hits baseline and ours alike instead of skewing the ratio
    chunks = [range(j, min(j + 500, n)) for j in range(0, n, 500)]
    funcs = (bare, decode, apply, apply_default, codec_decode, decode_default)
    best_chunk = {f: [float("inf")] * len(chunks) for f in funcs}
    gc.collect()
    for _ in range(5):
        for ci, chunk in enumerate(chunks):
            for f in funcs:
                t0 = time.perf_counter()
                f(chunk)
                best_chunk[f][ci] = min(best_chunk[f][ci], time.perf_counter() - t0)
    b, d, a, a_default, cd, dd = (sum(best_chunk[f]) for f in funcs)

    # what ingest leaves to the scrape: converting and rendering the readings, once per GPU sampled
    # since the last scrape, whatever the number of samples in between (here 2000 GPUs dirty, the
    # latest of their samples rendered, from new values each time)
    def scrape_render(st: SeriesStore, recs: list[dict]) -> float:
        times = []
        for k in range(1, INGEST_SAMPLES_PER_GPU + 1):
            st.apply_samples([(recs[j], 0) for j in range((k - 1) * INGEST_GPUS, k * INGEST_GPUS)], 1000.0)
            t0 = time.perf_counter()
            st.render(1000.0)
            times.append(time.perf_counter() - t0)
        return min(times[1:]) / INGEST_GPUS  # per GPU; the first also renders the label views

    r, r_default = scrape_render(store, decoded), scrape_render(full, decoded_default)
    print(
        f"metrics_ingest records={n} bare_decode_us={b / n * 1e6:.1f} generated_decode_us={d / n * 1e6:.1f} "
        f"codec_decode_us={cd / n * 1e6:.1f} apply_sample_us={a / n * 1e6:.1f} "
        f"first_sample_of_a_gpu_us={first_us:.1f} ours_per_s={n / (d + a):.0f} baseline_per_s={n / b:.0f} "
        f"scrape_render_us_per_dirty_gpu={r * 1e6:.1f}"
    )
    print(
        f"metrics_ingest_default_counters families={len(full.families)} "
        f"generated_decode_us={dd / n * 1e6:.1f} apply_sample_us={a_default / n * 1e6:.1f} "
        f"scrape_render_us_per_dirty_gpu={r_default * 1e6:.1f}"
    )
    print(f"metrics_ingest ratio={b / (d + a):.2f} target=2.00")
    print(f"metrics_ingest_default_counters ratio={b / (dd + a_default):.2f} target=2.00")
    # the strict reading, informational: every sample also rendered and joined (a scrape per
    # sample; with one sample a second and an HA pair scraping every 5 s, 2.5 s apart, a GPU is
    # rendered once per 2.5 samples: bench_metrics_pipeline.py measures that whole path)
    print(
        f"metrics_ingest_with_render_each_sample: {b / (d + a + r * n):.2f}x bare decode, "
        f"default counters {b / (dd + a_default + r_default * n):.2f}x (informational)"
    )


def main() -> None:
    t0 = time.perf_counter()
    bench_ingest()
    bench_render()
    print(f"bench_metrics_render total_s={time.perf_counter() - t0:.1f}")


if __name__ == "__main__":
    main()
